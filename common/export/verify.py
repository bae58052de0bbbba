"""An export checked in a fresh interpreter on the CPU, where only TensorFlow can be imported: every
signature reproduces the predictions recorded at export time, and a float16 signature really computes in float16."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common.core.children import cpu_only_environment
from common.export.card import OUTPUT_NAME, SAVED_MODEL_DIR, VERIFY_NAME, ExportError, read_card
from common.export.census import FLOAT16_MIN_SHARE, float16_share, saved_census

import numpy as np
import tensorflow as tf

VERIFY_TOLERANCE = 1e-4

FLOAT16_TOLERANCE = 1e-2  # float16 arithmetic: about 3 significant digits


def verify_in_fresh_process(folder: Path) -> dict:
    """Reload `folder` in a new interpreter that cannot import BLOCKED_IN_CHECK (common.core.children), on the CPU:
    {'max_abs_diff': per signature, 'census': per signature, 'environment': the accelerator settings it saw}."""
    env = cpu_only_environment(os.environ)
    result = subprocess.run([sys.executable, "-m", "common.export.check_child", str(folder)], capture_output=True,
                            text=True, env=env)
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
            raise SystemExit(f"{signature} computes only {share:.0%} of its convolutions and matmuls "
                             f"in float16 ({census}): not a float16 signature. Fix: train.export_float16=false")
        outputs = loaded.signatures[signature](images=tf.constant(batch["images"]))[OUTPUT_NAME]
        width = card.width
        if outputs.dtype != tf.float32 or outputs.shape[-1] != width:
            raise SystemExit(f"{signature} gives {outputs.dtype.name} {outputs.shape}, not float32 [N, {width}]")
        diffs[precision] = scaled_difference(outputs.numpy(), batch["predictions"])
        tolerance = VERIFY_TOLERANCE if precision == "float32" else FLOAT16_TOLERANCE
        if not diffs[precision] < tolerance:
            raise SystemExit(f"{signature} (reloaded, on this CPU) differs by {diffs[precision]:.2e} from the trained "
                             f"model's float32 outputs, computed exactly on the training host (tolerance "
                             f"{tolerance:.0e})")
    return diffs, censuses


def scaled_difference(outputs: np.ndarray, reference: np.ndarray) -> float:
    """max |outputs - reference|, relative to the reference's scale where its values exceed 1 (regression values can
    be large)."""
    scale = max(1.0, float(np.max(np.abs(reference))))
    return float(np.max(np.abs(np.asarray(outputs, np.float32) - reference))) / scale
