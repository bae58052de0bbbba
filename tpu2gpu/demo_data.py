"""The embedded demo competition: scikit-learn's handwritten digits laid out like a Kaggle image competition.

    make_demo_competition("data/demo")    # -> train.csv, train/*.png, test/*.png, sample_submission.csv, solution.csv

1,797 real 8x8 scans (shipped inside scikit-learn, so no download) upscaled to 32x32 RGB PNGs, labelled with
class names ("zero".."nine") so the label mapping is exercised. A stratified 20% becomes the unlabelled test set,
whose answers go to solution.csv (what Kaggle keeps hidden) for scoring the demo's submission.
"""

from __future__ import annotations

import csv
from pathlib import Path

from common.core.atomic import staged_dir

import numpy as np

CLASS_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
COMPLETE_MARK = "solution.csv"  # written last


def _write_csv(path: Path, header: tuple[str, ...], rows) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def make_demo_competition(
    out_dir: str | Path, image_size: int = 32, test_fraction: float = 0.2, seed: int = 0, overwrite: bool = False
) -> Path:
    """Write the demo competition into out_dir (reused as it is when already complete, unless overwrite)."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    out_dir = Path(out_dir)
    if (out_dir / COMPLETE_MARK).is_file() and not overwrite:
        return out_dir
    digits = load_digits()
    images = (digits.images / 16.0 * 255.0).round().astype(np.uint8)  # 0..16 ink levels -> 0..255
    ids = np.array([f"digit_{i:04d}" for i in range(len(images))])
    labels = np.array([CLASS_NAMES[t] for t in digits.target])
    train_idx, test_idx = train_test_split(
        np.arange(len(images)), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    with staged_dir(out_dir, overwrite=True) as tmp:
        for split, indices in (("train", train_idx), ("test", test_idx)):
            (tmp / split).mkdir()
            for i in indices:
                gray = Image.fromarray(images[i], mode="L").resize((image_size, image_size), Image.BILINEAR)
                gray.convert("RGB").save(tmp / split / f"{ids[i]}.png")
        _write_csv(tmp / "train.csv", ("id", "label"), zip(ids[train_idx], labels[train_idx], strict=True))
        test_sorted = np.sort(test_idx)
        _write_csv(tmp / "sample_submission.csv", ("id", "label"), ((ids[i], CLASS_NAMES[0]) for i in test_sorted))
        _write_csv(tmp / COMPLETE_MARK, ("id", "label"), ((ids[i], labels[i]) for i in test_sorted))
    return out_dir
