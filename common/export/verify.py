"""An export checked in a fresh interpreter on the CPU, where only TensorFlow can be imported: the float32 signature
reproduces the predictions recorded at export time, a float16 signature really computes in float16 (its difference on
this CPU's float16 kernels is recorded), and every signature gives float32 outputs of the card's width."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common.core.children import cpu_only_environment
from common.export.card import (
    FLOAT16_TOLERANCE,
    OUTPUT_NAME,
    SAVED_MODEL_DIR,
    VERIFY_NAME,
    VERIFY_TOLERANCE,
    ExportError,
    read_card,
    scaled_difference,
)
from common.export.census import FLOAT16_MIN_SHARE, float16_share, saved_census

import numpy as np
import tensorflow as tf

__all__ = ["FLOAT16_TOLERANCE", "VERIFY_TOLERANCE", "check_export", "scaled_difference", "verify_in_fresh_process"]


def verify_in_fresh_process(folder: Path) -> dict:
    """Reload `folder` in a new interpreter that cannot import BLOCKED_IN_CHECK (common.core.children), on the CPU:
    {'max_abs_diff': per signature, 'census': per signature, 'environment': the accelerator settings it saw}."""
    env = cpu_only_environment(os.environ)
    result = subprocess.run(
        [sys.executable, "-m", "common.export.check_child", str(folder)], capture_output=True, text=True, env=env
    )
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-8:])
        raise ExportError(f"the export in {folder} failed its check in a fresh process:\n{tail}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_export(folder: str) -> tuple[dict[str, float], dict[str, dict]]:
    """The fresh-process half of verify_in_fresh_process (run by `python -m common.export.check_child FOLDER`): each
    signature's max difference from the recorded predictions, and its saved graph's op census. A float16 signature
    whose saved graph does not compute in float16 fails."""
    card = read_card(folder, require_complete=False)
    loaded = tf.saved_model.load(str(Path(folder) / SAVED_MODEL_DIR))
    batch = np.load(Path(folder) / VERIFY_NAME)
    diffs, censuses = {}, {}
    for precision, signature in card.precisions.items():
        census = saved_census(Path(folder) / SAVED_MODEL_DIR, signature)
        share = float16_share(census)
        censuses[signature] = {"float16_share": round(share, 4), "ops": census}
        if precision == "float16" and share < FLOAT16_MIN_SHARE:
            raise SystemExit(
                f"{signature} computes only {share:.0%} of its convolutions and matmuls "
                f"in float16 ({census}): not a float16 signature. Fix: train.export_float16=false"
            )
        outputs = loaded.signatures[signature](images=tf.constant(batch["images"]))[OUTPUT_NAME]
        width = card.width
        if outputs.dtype != tf.float32 or outputs.shape[-1] != width:
            raise SystemExit(f"{signature} gives {outputs.dtype.name} {outputs.shape}, not float32 [N, {width}]")
        diffs[precision] = scaled_difference(outputs.numpy(), batch["predictions"])
        # A float16 signature was held to its tolerance before it was saved, in tensor-core arithmetic (writer.py's
        # float16_copy); this CPU's float16 kernels are another arithmetic, so their figure is recorded, not gated.
        if precision == "float32" and not diffs[precision] < VERIFY_TOLERANCE:
            raise SystemExit(
                f"{signature} (reloaded, on this CPU) differs by {diffs[precision]:.2e} from the trained "
                f"model's float32 outputs, computed exactly on the training host (tolerance "
                f"{VERIFY_TOLERANCE:.0e})"
            )
    return diffs, censuses
