"""The host's pace, for reading the suite's time beside another day's (bench/README.md, "The test suite").

    .venv/bin/python bench/host.py

The VM's speed moves from day to day: two figures of one core's pace say how fast this host is now, run alone
(nothing else on the machine): a 512 px JPEG decoded by Pillow (decodes a second) and a Python loop of 3M steps
(seconds). Each is the best of five tries, so a moment's load elsewhere does not count.
"""

from __future__ import annotations

import io
import time

import numpy as np
from PIL import Image

TRIES = 5


def jpeg_decodes_per_second(size: int = 512, decodes: int = 100) -> float:
    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="JPEG", quality=90)
    data = encoded.getvalue()
    best = float("inf")
    for _ in range(TRIES):
        began = time.perf_counter()
        for _ in range(decodes):
            Image.open(io.BytesIO(data)).convert("RGB").load()
        best = min(best, time.perf_counter() - began)
    return decodes / best


def python_loop_seconds(steps: int = 3_000_000) -> float:
    best = float("inf")
    for _ in range(TRIES):
        began = time.perf_counter()
        total = 0
        for i in range(steps):
            total += i
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    print(
        f"host: {jpeg_decodes_per_second():.0f} decodes/s (512 px JPEG, Pillow, one core), "
        f"{python_loop_seconds():.2f} s (Python loop of 3M steps)"
    )


if __name__ == "__main__":
    main()
