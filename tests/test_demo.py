import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from builders import kill_after_epochs

pytestmark = pytest.mark.e2e  # tpu2gpu.demo run in child interpreters

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_an_interrupted_demo_is_finished_by_the_next_run(tmp_path):
    """Slow (2-3 minutes on 2 cores: the demo two and a half times). Redundant with default tests: the demo end to end
    is test_readme.py's (`./dev demo`), a killed training run resumed the GCS journey's (test_gcs.py, in a bucket and
    locally) and a run ended after its checkpoint resumed test_damaged_data.py's
    test_a_corrupt_record_ends_the_fold_naming_its_shard_and_the_repaired_run_resumes, an interrupted export never
    looking complete test_an_interrupted_export_never_looks_complete's."""
    root = tmp_path / "demo"
    command = [sys.executable, "-m", "tpu2gpu.demo", "--root", str(root)]
    progress = root / "train" / "work" / "fold0" / "checkpoints" / "progress.json"
    kill_after_epochs(command, progress, 3)
    # Nothing downstream of the interruption looks complete.
    assert not (root / "train" / "export" / "fold0").exists()
    assert not (root / "infer").exists() and not (root / "build").exists()

    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resuming from the checkpoint after epoch" in again.stdout
    macro_f1 = float(re.search(r"macro-F1\s+(0\.\d+) on the held-out test set", again.stdout).group(1))
    assert macro_f1 >= 0.90
    # The demo's backbone is a TF Hub SavedModel (float32 whatever the policy): no float16 signature, and it says so.
    assert "[train] precision: backbone float32, head float32" in again.stdout
    card = json.loads((root / "train" / "export" / "fold0" / "model_card.json").read_text())
    assert card["precisions"] == {"float32": "serving_default"}
    assert card["precision"]["trained"] == {"policy": "float32", "backbone": "float32", "head": "float32"}
    assert card["precision"]["float16_signature"].startswith("not exported: its graph would run")
    assert card["precision"]["signatures"]["serving_default"]["float16_share"] == 0.0

    third = subprocess.run(command, cwd=REPO, capture_output=True, text=True)  # twice works: reuses, replaces
    assert third.returncode == 0 and "already exported" in third.stdout
    assert float(re.search(r"macro-F1\s+(0\.\d+) on", third.stdout).group(1)) == macro_f1
