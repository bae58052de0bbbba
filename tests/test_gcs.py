"""gs:// for real: TensorFlow's own GCS file system against a fake bucket that checks a bearer token, in a network
namespace of its own (tests/fake_gcs.py; root only, skipped with the reason elsewhere)."""

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from builders import TENSORFLOW_ALONE, write_competition
from fake_gcs import TOKEN, run_with_gcs, service_account_key, unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "root")]

BUCKET_RUN = "gs://bars-bucket/run"

# In the bucket's namespace, from the test's folder: convert into the bucket; train with the output in it, killed
# once its first epoch's checkpoint is pushed; forget the local copy (a new machine), train again (it resumes from
# the bucket) and export; score the export from the bucket and from the local copy with the TF-only inference kernel.
# Then the same run on local paths (records converted here), never killed, scored too: the resume changed nothing.
# Then the bucket loses the export's card (AFTER), its whole folder, and a push is refused half-way: the same training
# command, run again each time as the messages say, repairs the bucket from the local copy.
JOURNEY = """
set -u
py() { "$PYTHON" "$@"; }
killed_after_epoch_1() {  # $1: its log, $2: the training's settings, $3: true once epoch 1's checkpoint is kept
  "$PYTHON" -m train_tpu.train $2 > $1 2>&1 &
  local run=$!
  until eval "$3"; do
    kill -0 $run 2>/dev/null || { echo "KILLED never: the run of $1 ended first"; exit 1; }; sleep 0.05
  done
  kill -9 $run; wait $run 2>/dev/null; echo "KILLED $1"
}
py -c "$CONVERT" > convert.log 2>&1; echo "CONVERT $?"
killed_after_epoch_1 killed.log "$TRAIN" 'grep -q "work/fold0: .* pushed" killed.log'
rm -rf runs/gcs  # a new machine: only the bucket holds the checkpoint
py -m train_tpu.train $TRAIN > resumed.log 2>&1; echo "RESUMED $?"
py -m train_tpu.train $LOCAL_TRAIN > local.log 2>&1; echo "LOCAL $?"  # never killed: the resume changed nothing
# The bucket's export, its local copy and the same run on local paths, scored by one inference process in turn.
py -c "$INFER" "$RUN/export" infer-gcs runs/gcs/output/bars-bucket/run/export infer-local local/export \
    infer-local-run > infer.log 2>&1; echo "INFER_THREE $?"
py -c "$AFTER" > after.log 2>&1; echo "AFTER $?"
py -m train_tpu.train $TRAIN > repaired.log 2>&1; echo "REPAIRED $?"  # the fix the refusal gives, followed
py -c "import tensorflow as tf; tf.io.gfile.rmtree('$RUN')"; echo "EMPTIED $?"  # the bucket's folder emptied by hand
echo 3 > "$FAKE_GCS_WRITES_LEFT"  # then the bucket takes 3 more objects and refuses the rest: a push cut short
py -m train_tpu.train $TRAIN > cut.log 2>&1; echo "CUT $?"
rm "$FAKE_GCS_WRITES_LEFT"
py -m train_tpu.train $TRAIN > refilled.log 2>&1; echo "REFILLED $?"  # the fix the cut push gives, followed
py -c "$INFER" "$RUN/export" infer-refilled > infer-refilled.log 2>&1; echo "INFER_REFILLED $?"
py -c "$NO_MANIFEST" > no-manifest.log 2>&1; echo "NO_MANIFEST $?"
"""

CONVERT = """
import json, sys
import tensorflow as tf
from tpu2gpu.cli import main as cli

url = "gs://bars-bucket/tfr"
convert = ["tfrecords", "--competition", "comp", "--out", url, "--set", "data.folds=2"]
print("CONVERT", cli(convert), "AGAIN", cli(convert))
print("LISTING", json.dumps(sorted(tf.io.gfile.listdir(url))))
print("VERIFY", cli(["verify-records", "--records", url, "--full"]))
print("LOCAL CONVERT", cli([*convert[:4], "tfr", *convert[5:]]))  # the same records on local paths
"""

# The bucket afterwards: what the run left there; an export without its card (an upload cut short) refused by name.
AFTER = """
import json
import tensorflow as tf
from common.export.card import ExportError
from common.inference.ensemble import find_exports

run = "gs://bars-bucket/run"
objects = [f"{d.rstrip('/')}/{n}"[len(run) + 1:] for d, _, files in tf.io.gfile.walk(run) for n in files]
print("BUCKET", json.dumps(sorted(objects)))
tf.io.gfile.remove(run + "/export/fold0/model_card.json")
try:
    find_exports([run + "/export"])  # what infer.exports=[gs://...] does
except ExportError as err:
    print("NO CARD", err)
"""

# Records without their manifest (an upload cut short) refused by name.
NO_MANIFEST = """
import tensorflow as tf
from common.core.config import load_config
from common.core.errors import DataError
from common.data.records import record_set

tf.io.gfile.remove("gs://bars-bucket/tfr/manifest.json")
try:
    record_set("gs://bars-bucket/tfr", load_config(None, []).data, 0)
except DataError as err:
    print("NO MANIFEST", err)
"""


def training_settings(backbone: Path, records: str, out: str) -> str:
    """Two short epochs of fold 0, reproducible (train.seed, a fixed read order, no augmentation)."""
    items = [
        f"runtime.tfrecords={records}",
        f"runtime.output_dir={out}",
        "train.fold=0",
        f"model.hub_handle={backbone}",
        "data.image_size=16",
        "train.epochs=2",
        "train.steps_per_epoch=20",
        "train.batch_size_per_replica=8",
        "train.export_float16=false",
        "data.deterministic=true",
        "data.augment=false",
    ]
    return " ".join(f"--set {item}" for item in items)


def test_a_run_in_a_bucket_converts_trains_is_killed_resumes_from_the_bucket_and_scores(tmp_path, tiny_backbone):
    """The records, the checkpoints and the export in a bucket, end to end; the TF-only inference kernel scores the
    export from the bucket exactly as from the local copy and as the same run on local paths, never killed (the
    resume from the bucket changed nothing); uploads cut short (no card, no manifest) are refused. Then
    the bucket is the truth: an export that lost its card, a folder emptied by hand, and a push refused half-way are
    each repaired by the next run from the complete local copy, nothing trained again; the last repair's export is
    scored from the bucket."""
    write_competition(tmp_path / "comp", ["a", "b"] * 20, size=16, n_test=4)
    # The inference kernel, TensorFlow alone, for each (exports, output folder) pair of its arguments in turn.
    infer = TENSORFLOW_ALONE + (
        "from infer_gpu.infer import main; pairs = list(zip(sys.argv[1::2], sys.argv[2::2])); "
        "sys.exit(next(filter(None, (main(['--set', f'infer.exports=[{e}]', '--set', f'runtime.output_dir={o}', "
        "'--set', 'runtime.competition_dir=comp', '--set', 'runtime.tfrecords=']) for e, o in pairs)), 0))"
    )
    env = {
        "PYTHON": sys.executable,
        "CONVERT": CONVERT,
        "AFTER": AFTER,
        "NO_MANIFEST": NO_MANIFEST,
        "INFER": infer,
        "RUN": BUCKET_RUN,
        "TRAIN": training_settings(tiny_backbone, "gs://bars-bucket/tfr", BUCKET_RUN),
        "LOCAL_TRAIN": training_settings(tiny_backbone, "tfr", "local"),
    }
    run = run_with_gcs(["bash", "-c", f"cd {tmp_path} && {JOURNEY}"], tmp_path / "gcs", ["bars-bucket"], env)
    logs = {p.stem: p.read_text() for p in tmp_path.glob("*.log")}
    report = run.stdout + run.stderr + "".join(f"\n--- {k}\n{v[-2500:]}" for k, v in logs.items())
    for step in (
        "CONVERT",
        "RESUMED",
        "LOCAL",
        "INFER_THREE",
        "AFTER",
        "REPAIRED",
        "EMPTIED",
        "REFILLED",
        "INFER_REFILLED",
        "NO_MANIFEST",
    ):
        assert f"{step} 0" in run.stdout, report
    assert "CUT 2" in run.stdout, report
    assert "KILLED killed.log" in run.stdout and "LOCAL CONVERT 0" in logs["convert"], report

    # Conversion: the shards and the manifest in the bucket; a second one refused without --overwrite.
    convert = logs["convert"]
    assert "CONVERT 0 AGAIN 2" in convert
    assert "tpu2gpu tfrecords: error: gs://bars-bucket/tfr already exists. Fix: pass --overwrite" in convert
    listing = json.loads(convert.split("LISTING ")[1].splitlines()[0])
    assert listing == ["fold0-000-n20.tfrec", "fold1-000-n20.tfrec", "manifest.json", "test-000-n4.tfrec"]
    assert "VERIFY 0" in convert and "3 shards of gs://bars-bucket/tfr (fold0, fold1, test): present and of" in convert

    # The killed run pushed its first checkpoint; the second, on a bare machine, took it from the bucket and resumed.
    assert re.search(r"\[gcs\] gs://bars-bucket/run/work/fold0: \d+ file\(s\), [\d.]+ MB, pushed", logs["killed"])
    resumed = logs["resumed"]
    assert "[gcs] gs://bars-bucket: access granted with the token in GOOGLE_AUTH_TOKEN_FOR_TESTING" in resumed
    assert (
        "[gcs] gs://bars-bucket/run/work/fold0: taken from the bucket into runs/gcs/output/bars-bucket/run/work/fold0"
    ) in resumed
    assert "[train] resuming from the checkpoint after epoch 1" in resumed
    assert "[train] epoch 2:" in resumed and "[train] epoch 1:" not in resumed

    # What the bucket holds: the export (its card), the history, the report; no checkpoint once exported.
    after = logs["after"]
    bucket = json.loads(after.split("BUCKET ")[1].splitlines()[0])
    assert {
        "export/fold0/model_card.json",
        "export/fold0/saved_model/saved_model.pb",
        "export/fold0/history.csv",
        "export/training_report.json",
        "work/fold0/history.csv",
    } <= set(bucket), bucket
    assert not [name for name in bucket if "checkpoints/" in name], bucket
    card = json.loads((tmp_path / "runs/gcs/output/bars-bucket/run/export/fold0/model_card.json").read_text())
    assert card["complete"] and card["config"]["runtime"]["output_dir"] == BUCKET_RUN
    assert [
        row["epoch"] for row in csv_rows(tmp_path / "runs/gcs/output/bars-bucket/run/export/fold0/history.csv")
    ] == ["0", "1"]

    # The inference kernel (TensorFlow alone) scores the export from the bucket as from its local copy, and as the
    # same run on local paths that was never killed: the same probabilities to the last printed digit.
    assert "[gcs] gs://bars-bucket/run/export: 1 export(s)" in logs["infer"]
    assert "[train] epoch 1:" in logs["local"] and "resuming" not in logs["local"]
    from_bucket = (tmp_path / "infer-gcs" / "probabilities.csv").read_text()
    assert len(from_bucket.splitlines()) == 5
    for other in ("infer-local", "infer-local-run"):
        assert (tmp_path / other / "probabilities.csv").read_text() == from_bucket, other
        assert (tmp_path / other / "submission.csv").read_text() == (
            tmp_path / "infer-gcs" / "submission.csv"
        ).read_text()

    # Uploads cut short are refused by name.
    assert (
        "NO CARD gs://bars-bucket/run/export/fold0 holds a SavedModel without its model_card.json: its upload "
        "was cut short, so it is not taken for an export. Fix: run the training again with the same "
        "runtime.output_dir (it uploads that fold again)"
    ) in after
    assert ("NO MANIFEST gs://bars-bucket/tfr has no manifest.json, so data.class_names must list the classes") in logs[
        "no-manifest"
    ]
    assert not Path("gs:").exists() and not (tmp_path / "gs:").exists()

    # The bucket is the truth, the local copy a cache. Following that fix: the complete local export is pushed, card
    # last, and nothing is trained again.
    local = "runs/gcs/output/bars-bucket/run/export/fold0"
    for log in ("repaired", "cut", "refilled"):
        assert (
            "[gcs] gs://bars-bucket/run/export/fold0 has no model_card.json (an upload cut short, or a folder "
            f"emptied): the complete local copy {local} is pushed, its model_card.json last"
        ) in logs[log], log
        assert "[train] epoch" not in logs[log], log
    for log in ("repaired", "refilled"):
        assert re.search(r"\[gcs\] gs://bars-bucket/run/export/fold0: \d+ file\(s\), [\d.]+ MB, pushed", logs[log])
        assert "[train] fold 0: already exported in" in logs[log], log
    # The folder emptied by hand, then a push refused after 3 objects (the write check took one): one error naming
    # what the bucket holds and the fix; the fix, followed, completes the bucket.
    assert (
        "train_tpu: error: pushing runs/gcs/output/bars-bucket/run/export/fold0 to the bucket failed after 2 of "
    ) in logs["cut"], logs["cut"][-2000:]
    assert (
        "it holds gs://bars-bucket/run/export/fold0 without its model_card.json, which no reader takes for "
        "complete. Fix: run the same command again once the bucket answers: it pushes what the bucket lacks from "
        "the local copy in runs/gcs/output/bars-bucket/run"
    ) in logs["cut"]
    # The inference kernel takes the export the last repair pushed from the bucket: the same submission as before.
    assert "[gcs] gs://bars-bucket/run/export: 1 export(s)" in logs["infer-refilled"]
    for name in ("probabilities.csv", "submission.csv"):
        assert (tmp_path / "infer-refilled" / name).read_text() == (tmp_path / "infer-gcs" / name).read_text(), name


def csv_rows(path: Path) -> list[dict]:
    import csv

    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_credential_the_bucket_refuses_ends_the_job_before_training_and_no_secret_is_written(tmp_path):
    """A wrong token, and a service-account key the bucket's token endpoint does not know, are one error naming the
    bucket and the fix before any training; the right key converts into the bucket (its token fetched by TensorFlow
    from the token endpoint). No log or file holds the token or the key."""
    write_competition(tmp_path / "comp", ["a", "b"] * 10, size=16, n_test=2)
    harness = tmp_path / "gcs"
    harness.mkdir()
    key = service_account_key(harness)[0]
    stranger = service_account_key(tmp_path / "stranger")[0]  # a key of the same account the bucket never issued
    convert = "--competition comp --out gs://bars-bucket/tfr --set data.folds=2"
    train = "--set runtime.tfrecords=gs://bars-bucket/tfr --set runtime.output_dir=gs://bars-bucket/run"
    script = f"""
    cd {tmp_path}
    GOOGLE_AUTH_TOKEN_FOR_TESTING=ya29.wrong "$PYTHON" -m train_tpu.train {train} > wrong-token.log 2>&1
    echo "WRONG_TOKEN $?"
    GOOGLE_APPLICATION_CREDENTIALS={stranger} "$PYTHON" -m tpu2gpu.cli tfrecords {convert} > wrong-key.log 2>&1
    echo "WRONG_KEY $?"
    GOOGLE_APPLICATION_CREDENTIALS={key} "$PYTHON" -m tpu2gpu.cli tfrecords {convert} > right-key.log 2>&1
    echo "RIGHT_KEY $?"
    """
    env = {"PYTHON": sys.executable, "GOOGLE_AUTH_TOKEN_FOR_TESTING": None, "HOME": str(tmp_path)}
    run = run_with_gcs(["bash", "-c", textwrap.dedent(script)], harness, ["bars-bucket"], env)
    logs = {p.stem: p.read_text() for p in tmp_path.glob("*.log")}
    report = run.stdout + run.stderr + "".join(f"\n--- {k}\n{v[-2500:]}" for k, v in logs.items())
    assert "WRONG_TOKEN 2" in run.stdout and "WRONG_KEY 2" in run.stdout and "RIGHT_KEY 0" in run.stdout, report

    assert (
        "train_tpu: error: gs://bars-bucket refused reading gs://bars-bucket/tfr (HTTP 401) with the token in "
        "GOOGLE_AUTH_TOKEN_FOR_TESTING. Fix: export GOOGLE_APPLICATION_CREDENTIALS="
    ) in logs["wrong-token"]
    assert "=== fold" not in logs["wrong-token"] and not (tmp_path / "runs").exists()
    assert (
        f"tpu2gpu tfrecords: error: gs://bars-bucket refused writing to gs://bars-bucket/tfr (HTTP 401) with the "
        f"key file GOOGLE_APPLICATION_CREDENTIALS names ({stranger}). Fix:"
    ) in logs["wrong-key"]
    assert (
        "[gcs] gs://bars-bucket: access granted with the key file GOOGLE_APPLICATION_CREDENTIALS names"
        in logs["right-key"]
    )
    assert "TFRecords and manifest.json in gs://bars-bucket/tfr" in logs["right-key"]

    # No secret anywhere: the token the bucket accepts, the wrong one, and each key's private part.
    private_lines = [json.loads(k.read_text())["private_key"].splitlines()[1] for k in (key, stranger)]
    secrets = [TOKEN, "ya29.wrong", *private_lines]
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent not in (harness, stranger.parent)]
    for path in written:
        text = path.read_bytes().decode("utf-8", "replace")
        assert not [s for s in secrets if s in text], path
    assert not [s for s in secrets if s in run.stdout + run.stderr]


# Checkpoints settled between the bucket and a local copy, both ways, and removed from both (runtime.start_over).
SETTLE = """
import json, pathlib, shutil
import tensorflow as tf
from common.core.gcs import Mirror
from common.training.epoch import CHECKPOINT_MARKER
from common.training.run import FoldJob

run, marker = "gs://bars-bucket/run", CHECKPOINT_MARKER
epochs = lambda data: json.loads(data)["epochs_done"]

def checkpoint(out, epochs_done):
    folder = pathlib.Path(out) / "work" / "fold0"
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    (folder / "checkpoints" / "weights.npz").write_text(f"weights after epoch {epochs_done}")
    (folder / marker).write_text(json.dumps({"epochs_done": epochs_done}))
    return folder

def bucket(name):
    path = f"{run}/work/fold0/checkpoints/{name}"
    return tf.io.gfile.GFile(path).read() if tf.io.gfile.exists(path) else None

here = checkpoint("here", 1)
Mirror(run, pathlib.Path("here")).push(here, marker)   # the bucket at epoch 1
checkpoint("here", 2)                                   # killed after saving epoch 2, before its push
Mirror(run, pathlib.Path("here")).settle(here, marker, epochs)
print("AHEAD", bucket("weights.npz"), "|", bucket("progress.json"))
there = checkpoint("there", 3)                          # another machine went on to epoch 3
Mirror(run, pathlib.Path("there")).push(there, marker)
Mirror(run, pathlib.Path("here")).settle(here, marker, epochs)
print("BEHIND", (here / "checkpoints" / "weights.npz").read_text())
job = FoldJob(0, "records", here, pathlib.Path("here/export/fold0"), Mirror(run, pathlib.Path("here")), here)
job.start_over()
left = [f for _, _, files in tf.io.gfile.walk(f"{run}/work/fold0") for f in files]
print("START_OVER", here.exists(), left)
"""


def test_checkpoints_settle_toward_the_side_ahead_and_start_over_removes_both(tmp_path):
    """A local checkpoint ahead of the bucket's (a push that never started) is pushed before training goes on; a
    bucket ahead of the local copy is taken; runtime.start_over removes the fold's checkpoint from both."""
    run = run_with_gcs(
        ["bash", "-c", f'cd {tmp_path} && "$PYTHON" -c "$SETTLE"'],
        tmp_path / "gcs",
        ["bars-bucket"],
        {"PYTHON": sys.executable, "SETTLE": SETTLE},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert (
        "[gcs] gs://bars-bucket/run/work/fold0 is behind the local copy (1 against 2): the complete local copy "
        "here/work/fold0 is pushed, its checkpoints/progress.json last"
    ) in run.stdout
    assert 'AHEAD weights after epoch 2 | {"epochs_done": 2}' in run.stdout
    assert "[gcs] gs://bars-bucket/run/work/fold0: taken from the bucket into here/work/fold0" in run.stdout
    assert "BEHIND weights after epoch 3" in run.stdout
    assert "[train] fold 0: runtime.start_over=true: its export and checkpoints removed" in run.stdout
    assert "START_OVER False []" in run.stdout  # nothing left here, no object left in the bucket
