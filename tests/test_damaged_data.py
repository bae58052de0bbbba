"""Damaged data named before the TPU time is spent: shards checked against their manifest, a corrupt record found
while training named with its file (and the rerun resuming), foreign records' damage named by the scan, every bad
CSV row at once, and a disk too small said before anything is written."""

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from common.core.atomic import staged_dir
from common.core.config import load_config
from common.core.errors import DataError, UserError
from common.data.conversion import convert_competition
from common.data.records import RecordSchema, scan_records
from common.export.card import read_card
from common.launch.kernel import guarded

import pytest

from infer_gpu.infer import main as infer_main
from train_tpu.train import main as train_main

from builders import kill_after_epochs, read_csv, says, set_args, write_competition, write_csv

REPO = Path(__file__).resolve().parents[1]
FIX = (
    "Fix: upload the dataset again (an upload or a copy cut short leaves a shard short or damaged), or write the "
    "records again (`tpu2gpu tfrecords`) and attach them"
)


def records_copy(demo_records, tmp_path: Path) -> tuple[Path, dict]:
    records = shutil.copytree(demo_records[0], tmp_path / "records")
    return records, json.loads((records / "manifest.json").read_text())


def first_shard(manifest: dict, split: str) -> str:
    return manifest["splits"][split]["shards"][0]["file"]


def truncate(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return len(data), len(data) // 2


@pytest.mark.e2e
def test_a_truncated_and_a_missing_shard_stop_the_kernel_before_a_model_is_built(
    train_argv, demo_records, tmp_path, capsys
):
    records, manifest = records_copy(demo_records, tmp_path)
    short, missing = records / first_shard(manifest, "fold1"), records / first_shard(manifest, "fold2")
    recorded, found = truncate(short)
    missing_bytes = missing.stat().st_size
    missing.unlink()
    assert guarded("train_tpu", train_main, train_argv(f"runtime.tfrecords={records}")) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("train_tpu: error: ")
    says(
        captured.err,
        f"2 TFRecord shard(s) of {records}",
        "manifest.json",
        f"{short}: {found} bytes",
        str(recorded),
        f"{missing}: missing ({missing_bytes} bytes expected)",
        FIX,
    )
    assert "[train] precision" not in captured.out  # printed once the model is built
    assert not (tmp_path / "out" / "work" / "fold0" / "checkpoints").exists()


@pytest.mark.e2e
def test_a_corrupt_record_ends_the_fold_naming_its_shard_and_the_repaired_run_resumes(
    train_argv, demo_records, tmp_path, capsys
):
    records, manifest = records_copy(demo_records, tmp_path)
    argv = train_argv(f"runtime.tfrecords={records}", "train.epochs=4")
    progress = tmp_path / "out" / "work" / "fold0" / "checkpoints" / "progress.json"
    kept = kill_after_epochs([sys.executable, "-m", "train_tpu.train", *argv], progress, 1)
    assert 1 <= kept < 4

    damaged = records / first_shard(manifest, "fold1")  # same size, 16 bytes flipped in the middle
    original = damaged.read_bytes()
    middle = len(original) // 2
    damaged.write_bytes(
        original[:middle] + bytes(b ^ 0xFF for b in original[middle : middle + 16]) + original[middle + 16 :]
    )
    assert guarded("train_tpu", train_main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("train_tpu: error: ")
    says(err, "fold 0", str(damaged), "corrupted record at byte", FIX, f"epoch {kept}", "the same command resumes")
    assert "Traceback" not in err and json.loads(progress.read_text())["epochs_done"] == kept

    damaged.write_bytes(original)  # the shard restored: the same command resumes, at the next epoch
    assert guarded("train_tpu", train_main, argv) == 0
    out = capsys.readouterr().out
    assert f"[train] resuming from the checkpoint after epoch {kept}" in out
    assert f"Epoch {kept + 1}/4" in out and f"Epoch {kept}/4" not in out
    export = tmp_path / "out" / "export" / "fold0"
    history = [row["epoch"] for row in read_csv(export / "history.csv")]
    assert history == [str(epoch) for epoch in range(4)]  # every epoch once, none repeated, none lost
    assert read_card(export).metrics["epochs"] == 4


@pytest.mark.e2e
def test_the_inference_kernel_names_a_truncated_test_shard(trained_export, demo_records, demo_dir, tmp_path):
    records, manifest = records_copy(demo_records, tmp_path)
    shard = records / first_shard(manifest, "test")
    recorded, found = truncate(shard)
    with pytest.raises(DataError) as err:
        infer_main(
            set_args(
                f"infer.exports=[{trained_export}]",
                f"runtime.competition_dir={demo_dir}",
                f"runtime.tfrecords={records}",
                f"runtime.output_dir={tmp_path / 'out'}",
            )
        )
    says(
        str(err.value),
        f"1 TFRecord shard(s) of {records}",
        "manifest.json",
        f"{shard}: {found} bytes",
        str(recorded),
        FIX,
    )
    assert not (tmp_path / "out").exists()


def test_the_scan_of_foreign_records_names_a_damaged_file(demo_records, tmp_path):
    records, manifest = records_copy(demo_records, tmp_path)
    whole, short = records / first_shard(manifest, "fold0"), records / first_shard(manifest, "fold1")
    truncate(short)
    with pytest.raises(DataError) as err:
        scan_records([whole, short], RecordSchema())
    says(str(err.value), "1 TFRecord file(s)", f"{short}: truncated record at byte", FIX)
    assert not (records / ".tpu2gpu-scan.json").exists()  # nothing cached from a failed scan


def test_every_bad_train_csv_row_is_named_at_once_before_any_image_is_read(tmp_path):
    comp = write_competition(tmp_path / "comp", ["a", "b"] * 6)
    rows = read_csv(comp / "train.csv")
    rows[3]["label"] = rows[8]["label"] = ""  # lines 5 and 10
    rows[6]["id"], rows[11]["id"] = rows[1]["id"], rows[2]["id"]  # lines 8 and 13 repeat lines 3 and 4
    write_csv(comp / "train.csv", ["id", "label"], [(r["id"], r["label"]) for r in rows])
    for image in (comp / "train").iterdir():
        image.write_bytes(b"")  # were any image read, the error would name it
    with pytest.raises(DataError) as err:
        convert_competition(comp, tmp_path / "out", load_config(None, ["data.folds=2"]).data)
    says(
        str(err.value),
        "train.csv",
        "4 bad row(s)",
        "2 x empty label in column 'label': line 5 (id 'img003'), line 10 (id 'img008')",
        "2 x duplicated id: line 8 (id 'img001', first on line 3), line 13 (id 'img002', first on line 4)",
        "Fix:",
        "train.csv",
    )
    assert not (tmp_path / "out").exists()


@contextlib.contextmanager
def tmpfs(disk: Path, size: str):
    """A tmpfs of `size` at `disk` (root only: mounted here, unmounted after), holding one file of the user's."""
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here ({mount.stderr.strip()}): run as root")
    (disk / "kept.txt").write_text("the folder's other files stay")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.fixture
def tiny_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


def test_a_conversion_onto_a_full_disk_is_refused_before_writing_with_both_figures(demo_dir, tiny_disk):
    with pytest.raises(UserError) as err:
        convert_competition(demo_dir, tiny_disk / "records", load_config(None, []).data)
    needed = str(err.value).split("need about ")[1].split(",")[0]
    assert float(needed.split()[0]) > 1.0 and needed.endswith(" MB")
    says(str(err.value), "1797 images", needed, str(tiny_disk), "1.0 MB free", "nothing was written", "Fix:")
    assert [p.name for p in tiny_disk.iterdir()] == ["kept.txt"]


def test_a_write_that_runs_out_of_space_is_one_line_and_leaves_nothing(tiny_disk):
    with pytest.raises(UserError) as err, staged_dir(tiny_disk / "export") as tmp:
        (tmp / "big.bin").write_bytes(b"\0" * 2_000_000)
    says(
        str(err.value),
        str(tiny_disk),
        "out of space",
        "export",
        "free",
        "nothing of it was kept",
        "Fix: free space there, or write to a folder on a larger disk",
    )
    assert "\n" not in str(err.value)
    assert [p.name for p in tiny_disk.iterdir()] == ["kept.txt"]


@pytest.mark.e2e
def test_the_full_check_reads_every_record_before_training_and_the_command_does_it_before_an_upload(
    train_argv, demo_records, tmp_path, capsys
):
    records, manifest = records_copy(demo_records, tmp_path)
    from tpu2gpu.cli import main as cli_main

    assert cli_main(["verify-records", "--records", str(records), "--full"]) == 0
    says(
        capsys.readouterr().out,
        f"6 shards of {records}",
        "fold0, fold1, fold2, fold3, fold4, test",
        "the size the manifest recorded",
        "every record read back whole",
    )
    damaged = records / first_shard(manifest, "fold3")  # same size: only reading its records finds it
    data = damaged.read_bytes()
    damaged.write_bytes(data[:1000] + bytes(b ^ 0xFF for b in data[1000:1016]) + data[1016:])
    assert cli_main(["verify-records", "--records", str(records)]) == 0  # the size check alone passes it
    assert cli_main(["verify-records", "--records", str(records), "--full"]) == 2
    says(
        capsys.readouterr().err,
        f"1 TFRecord shard(s) of {records}",
        "damaged record",
        "verify-records --full",
        f"{damaged}: corrupted record at byte",
    )
    assert guarded("train_tpu", train_main, train_argv(f"runtime.tfrecords={records}", "data.verify_records=full")) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("train_tpu: error: ")
    says(
        captured.err,
        f"1 TFRecord shard(s) of {records}",
        "damaged record",
        "data.verify_records=full",
        f"{damaged}: corrupted record at byte",
    )
    assert "[train] precision" not in captured.out  # before any model is built


@pytest.mark.e2e
def test_a_checkpoint_that_runs_out_of_space_is_one_line_and_the_last_one_stays(train_argv, tmp_path, capsys):
    with tmpfs(tmp_path / "disk", "300k") as disk:  # the tiny model's first checkpoint fits, its second does not
        assert guarded("train_tpu", train_main, train_argv(f"runtime.output_dir={disk}")) == 2
        err = capsys.readouterr().err
        checkpoints = disk / "work" / "fold0" / "checkpoints"
        assert err.startswith("train_tpu: error: ") and err.count("\n") == 1
        says(
            err,
            str(disk / "work" / "fold0"),
            "out of space",
            "fold 0",
            "free",
            "checkpoint after epoch 1",
            "Fix: free space there, or set runtime.scratch_dir",
        )
        assert json.loads((checkpoints / "progress.json").read_text())["epochs_done"] == 1
        assert not list(checkpoints.glob("*_temp"))  # the half-written one is gone
