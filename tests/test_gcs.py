"""gs:// for real: TensorFlow's own GCS file system against a fake bucket in a network namespace of its own
(tests/fake_gcs.py; root only, skipped with the reason elsewhere)."""

import json
import sys
import textwrap
from pathlib import Path

import pytest
from fake_gcs import run_with_gcs, unavailable

from builders import write_competition

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "root")]


def test_records_converted_into_a_bucket_train_a_fold_and_a_cut_upload_is_refused(tmp_path, tiny_backbone):
    """`tpu2gpu tfrecords --out gs://...` converts, then uploads with manifest.json last; `verify-records --full` and
    the training kernel read the bucket; without its manifest (an upload cut short) the folder is refused by name."""
    competition = write_competition(tmp_path / "comp", ["a", "b"] * 20, size=16, n_test=4)
    train = ["runtime.tfrecords=gs://bars-bucket/tfr", f"model.hub_handle={tiny_backbone}", "data.image_size=16",
             "train.epochs=1", "train.steps_per_epoch=2", "train.batch_size_per_replica=8",
             f"runtime.output_dir={tmp_path / 'out'}"]
    code = textwrap.dedent(f"""
        import json
        from tpu2gpu.cli import main as cli
        from train_tpu.train import main as train
        from common.core.config import load_config
        from common.core.errors import DataError
        from common.data.records import record_set
        import tensorflow as tf

        url = "gs://bars-bucket/tfr"
        convert = ["tfrecords", "--competition", {str(competition)!r}, "--out", url, "--set", "data.folds=2"]
        print("CONVERT", cli(convert), "AGAIN", cli(convert))
        print("LISTING", json.dumps(sorted(tf.io.gfile.listdir(url))))
        print("VERIFY", cli(["verify-records", "--records", url, "--full"]))
        print("TRAIN", train([a for s in {train!r} for a in ("--set", s)]))
        tf.io.gfile.remove(url + "/manifest.json")  # the shards without their marker: an upload cut short
        try:
            record_set(url, load_config(None, []).data, 0)
        except DataError as err:
            print("REFUSED", err)
        """)
    run = run_with_gcs([sys.executable, "-c", code], tmp_path / "gcs", ["bars-bucket"])
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    assert "CONVERT 0 AGAIN 2" in out  # a second conversion into the same folder needs --overwrite
    assert "tpu2gpu tfrecords: error: gs://bars-bucket/tfr already exists. Fix: pass --overwrite" in run.stderr
    listing = json.loads(out.split("LISTING ")[1].splitlines()[0])
    assert listing == ["fold0-000-n20.tfrec", "fold1-000-n20.tfrec", "manifest.json", "test-000-n4.tfrec"]
    assert "VERIFY 0" in out and "3 shards of gs://bars-bucket/tfr (fold0, fold1, test): present and of the size" in out
    assert "TRAIN 0" in out
    card = json.loads((tmp_path / "out" / "export" / "fold0" / "model_card.json").read_text())
    assert card["complete"] and card["config"]["runtime"]["tfrecords"] == "gs://bars-bucket/tfr"
    assert ("REFUSED gs://bars-bucket/tfr has no manifest.json, so data.class_names must list the classes in label "
            "order. Fix: --set data.class_names=[...], or convert the data with `tpu2gpu tfrecords`") in out
    assert not Path("gs:").exists()
