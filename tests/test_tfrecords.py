import json
import math
from pathlib import Path

from common.core.config import Config, load_config
from common.core.errors import DataError
from common.data.conversion import MB
from common.data.records import (
    RecordSchema,
    record_set,
    schema_from_config,
    serialize_example,
    shard_paths,
    split_files,
)

import pytest

from tpu2gpu.cli import main
from tpu2gpu.demo_data import CLASS_NAMES

from builders import image_bytes, read_csv, read_records, says, set_args, write_competition


def test_demo_round_trip(demo_dir, demo_records):
    out, manifest = demo_records
    train_rows = read_csv(demo_dir / "train.csv")
    assert manifest["class_names"] == sorted(CLASS_NAMES) and manifest["label_type"] == "str"
    assert manifest["split"] == {"kind": "kfold", "folds": 5, "seed": 42, "grouped": False}
    folds = [f"fold{k}" for k in range(5)]
    assert list(manifest["splits"]) == [*folds, "test"]
    assert sum(manifest["splits"][f]["count"] for f in folds) == len(train_rows) == 1437

    records = read_records(shard_paths(manifest, out, folds))
    assert len(records) == len(train_rows)
    expected = {row["id"]: manifest["class_names"].index(row["label"]) for row in train_rows}
    assert {r["id"]: int(r["label"]) for r in records} == expected  # every id once, with its own label

    # Stratified: each class is spread over the 5 folds within one sample of even.
    for class_index in range(10):
        per_fold = [manifest["splits"][f]["label_counts"][str(class_index)] for f in folds]
        assert max(per_fold) - min(per_fold) <= 1
    # Shards: counts in names, manifest and files agree; sizes are the files' own.
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            assert shard["file"].endswith(f"-n{shard['count']}.tfrec")
            assert len(read_records([out / shard["file"]], labeled=False)) == shard["count"]
            assert shard["bytes"] == (out / shard["file"]).stat().st_size

    # Test records: no labels, in sample_submission.csv order.
    test_ids = [r["id"] for r in read_records(shard_paths(manifest, out, ["test"]), labeled=False)]
    assert test_ids == [row["id"] for row in read_csv(demo_dir / "sample_submission.csv")]
    assert json.loads((out / "manifest.json").read_text()) == manifest

    train_files, val_files = split_files(manifest, str(out), fold=2)
    assert [Path(f).name.split("-")[0] for f in val_files] == ["fold2"]
    assert sorted(Path(f).name.split("-")[0] for f in train_files) == ["fold0", "fold1", "fold3", "fold4"]


def test_shards_are_sized_to_the_target(demo_dir, tmp_path):
    from common.data.conversion import convert_competition

    cfg = load_config(None, ["data.shard_target_mb=0.08"])
    manifest = convert_competition(demo_dir, tmp_path / "small", cfg.data)
    shards = [s for split in manifest["splits"].values() for s in split["shards"]]
    fold0_ids = {r["id"] for r in read_records(shard_paths(manifest, tmp_path / "small", ["fold0"]))}
    fold0_bytes = sum((demo_dir / "train" / f"{i}.png").stat().st_size for i in fold0_ids)
    assert len(manifest["splits"]["fold0"]["shards"]) == math.ceil(fold0_bytes / (0.08 * MB)) == 4
    sizes = [s["bytes"] / MB for s in shards]
    assert all(0.04 <= size <= 0.1 for size in sizes), sizes
    assert sum(s["count"] for s in shards) == 1437 + 360


def test_holdout_split_integer_labels_and_resize(tmp_path):
    labels = [i % 3 for i in range(30)]
    comp = write_competition(tmp_path / "comp", labels, size=20, fmt="PNG")
    cfg = load_config(None, ["data.folds=0", "data.val_fraction=0.2", "data.convert_size=12", "data.reencode=jpeg"])
    from common.data.conversion import convert_competition

    manifest = convert_competition(comp, tmp_path / "rec", cfg.data)
    assert manifest["class_names"] == ["0", "1", "2"] and manifest["label_type"] == "int"
    assert manifest["split"]["kind"] == "holdout"
    assert manifest["splits"]["train"]["count"] == 24 and manifest["splits"]["valid"]["count"] == 6
    assert manifest["splits"]["valid"]["label_counts"] == {"0": 2, "1": 2, "2": 2}
    assert manifest["image_size"] == 12 and manifest["image_formats"] == ["jpeg"]
    records = read_records(shard_paths(manifest, tmp_path / "rec", ["train", "valid"]))
    import tensorflow as tf

    assert tf.io.decode_jpeg(records[0]["image"]).shape == (12, 12, 3)
    assert {r["id"]: int(r["label"]) for r in records} == {f"img{i:03d}": i % 3 for i in range(30)}


def _no_output_left(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


def _convert_fails(comp: Path, out: Path, *overrides: str) -> str:
    from common.data.conversion import convert_competition

    with pytest.raises(DataError) as err:
        convert_competition(comp, out, load_config(None, overrides).data)
    return str(err.value)


def _break_three_images(comp: Path) -> None:
    """train.csv lines 4, 6 and 9: a missing, a truncated (corrupt) and a zero-byte image; and one bad test image."""
    (comp / "train" / "img002.jpg").unlink()
    good = (comp / "train" / "img004.jpg").read_bytes()
    (comp / "train" / "img004.jpg").write_bytes(good[: len(good) // 3])  # truncated mid-scan: only a full decode fails
    (comp / "train" / "img007.jpg").write_bytes(b"")
    (comp / "test" / "t001.jpg").write_bytes(b"GIF89a not really")


def test_every_bad_image_is_named_in_one_pass(tmp_path):
    comp = write_competition(tmp_path / "comp", ["a", "b"] * 6)
    _break_three_images(comp)
    message = _convert_fails(comp, tmp_path / "out", "data.folds=2")
    says(message, "4 bad image(s)", "3 train, 1 test", "nothing was written")
    says(message, "train.csv line 4 (id 'img002')", "img002[.jpg|.jpeg|.png]", "train/")
    says(
        message, "train.csv line 6 (id 'img004')", str(comp / "train" / "img004.jpg"), "not a readable image", "OSError"
    )
    says(message, "train.csv line 9 (id 'img007')", str(comp / "train" / "img007.jpg"), "empty (0 bytes)")
    assert "sample_submission.csv line 5 (id 't001')" in message  # written in reverse order
    assert "--set data.on_bad_image=skip" in message
    assert _no_output_left(tmp_path / "out")


@pytest.mark.e2e
def test_skip_converts_the_rest_and_lists_the_bad_images(tmp_path, capsys):
    comp = write_competition(tmp_path / "comp", ["a", "b"] * 6)
    _break_three_images(comp)
    out = tmp_path / "out"
    code = main(
        [
            "tfrecords",
            "--competition",
            str(comp),
            "--out",
            str(out),
            *set_args("data.folds=2", "data.on_bad_image=skip"),
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    says(captured.out, "4 bad image(s)", "data.on_bad_image=skip", str(out / "bad_images.csv"))
    assert "[tfrecords] skipping 4 bad image(s)" in captured.err
    assert all(f"(id '{i}')" in captured.err for i in ("img002", "img004", "img007", "t001"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"] == {"count": 4, "file": "bad_images.csv", "by_split": {"train": 3, "test": 1}}
    assert manifest["splits"]["fold0"]["count"] + manifest["splits"]["fold1"]["count"] == 9
    ids = {r["id"] for r in read_records(shard_paths(manifest, out, ["fold0", "fold1"]))}
    assert ids == {f"img{i:03d}" for i in range(12)} - {"img002", "img004", "img007"}
    assert [r["id"] for r in read_records(shard_paths(manifest, out, ["test"]), labeled=False)] == [
        "t004",
        "t003",
        "t002",
        "t000",
    ]
    listed = read_csv(out / "bad_images.csv")
    assert [(row["split"], row["source"], row["id"]) for row in listed] == [
        ("train", "train.csv line 4", "img002"),
        ("train", "train.csv line 6", "img004"),
        ("train", "train.csv line 9", "img007"),
        ("test", "sample_submission.csv line 5", "t001"),
    ]
    assert listed[2]["problem"] == f"{comp / 'train' / 'img007.jpg'} is empty (0 bytes)"
    # The training kernel copies the list into its output, beside the exports, and reports the count.
    from train_tpu.train import skipped_images

    assert skipped_images(str(out), tmp_path / "export") == manifest["skipped"]
    assert read_csv(tmp_path / "export" / "bad_images.csv") == listed


def test_an_image_of_another_format_is_stored_only_when_reencoded(tmp_path):
    from PIL import Image

    comp = write_competition(tmp_path / "comp", ["a", "b"] * 6)
    Image.new("RGB", (16, 16), "red").save(comp / "train" / "img005.jpg", format="WEBP")  # a .jpg that is WebP
    message = _convert_fails(comp, tmp_path / "out", "data.folds=2")
    assert "train.csv line 7 (id 'img005')" in message and "is a WEBP image" in message
    assert "--set data.reencode=jpeg" in message
    from common.data.conversion import convert_competition

    manifest = convert_competition(
        comp, tmp_path / "out", load_config(None, ["data.folds=2", "data.reencode=jpeg"]).data
    )
    assert manifest["image_formats"] == ["jpeg"] and manifest["skipped"]["count"] == 0


def test_missing_label_column_names_the_columns(tmp_path):
    comp = write_competition(tmp_path / "comp", ["a", "b"] * 6)
    message = _convert_fails(comp, tmp_path / "out", "data.label_column=species")
    says(message, "train.csv", "'species'", "id, label", "--set data.label_column=")
    assert _no_output_left(tmp_path / "out")


def test_empty_images_folder(tmp_path):
    comp = write_competition(tmp_path / "comp", ["a", "b"] * 6)
    for image in (comp / "train").iterdir():
        image.unlink()
    message = _convert_fails(comp, tmp_path / "out")
    says(message, str(comp / "train"), "no .jpg/.jpeg/.png images")
    assert _no_output_left(tmp_path / "out")


def test_a_failed_rerun_keeps_the_previous_complete_output(tmp_path):
    from common.data.conversion import convert_competition

    comp = write_competition(tmp_path / "comp", ["a", "b"] * 6)
    out = tmp_path / "out"
    first = convert_competition(comp, out, load_config(None, ["data.folds=2"]).data)
    with pytest.raises(DataError, match="already exists.*--overwrite"):
        convert_competition(comp, out, Config().data)
    (comp / "train" / "img003.jpg").write_bytes(b"not an image")
    with pytest.raises(DataError, match="img003.jpg is not a readable image"):
        convert_competition(comp, out, load_config(None, ["data.folds=2"]).data, overwrite=True)
    assert json.loads((out / "manifest.json").read_text()) == first
    assert not list(tmp_path.glob(".out.*"))


def test_too_few_samples_for_the_folds(tmp_path):
    comp = write_competition(tmp_path / "comp", ["a"] * 8 + ["b"] * 2)
    message = _convert_fails(comp, tmp_path / "out", "data.folds=5")
    says(message, "data.folds=5", "rarest class", "2 samples")


@pytest.mark.e2e
def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys):
    comp = write_competition(tmp_path / "comp", ["a", "b"] * 6)
    code = main(["tfrecords", "--competition", str(comp), "--out", str(tmp_path / "o"), "--set", "data.fold=2"])
    assert code == 2
    err = capsys.readouterr().err
    says(err, "tpu2gpu tfrecords: error: ", "'data.fold'", "'folds'")
    assert "Traceback" not in err

    assert main(["tfrecords", "--competition", str(comp), "--out", str(tmp_path / "o"), "--set", "data.folds=2"]) == 0
    assert (tmp_path / "o" / "manifest.json").is_file()


def test_a_test_id_listed_twice_is_refused(tmp_path):
    comp = write_competition(tmp_path / "comp", ["a", "b"] * 6)
    with (comp / "sample_submission.csv").open("a") as f:
        f.write("t002,a\n")  # t002 is also on line 4
    message = _convert_fails(comp, tmp_path / "out", "data.folds=2")
    says(message, "sample_submission.csv line 7", "'t002'", "sample_submission.csv line 4")
    assert _no_output_left(tmp_path / "out")


def test_label_columns_and_empty_labels_are_for_tasks_whose_label_is_a_set(tmp_path):
    comp = write_competition(tmp_path / "comp", ["a", "", "b"] * 4)  # line 3: no label on
    message = _convert_fails(comp, tmp_path / "out", "data.label_columns=[a, b]")
    says(message, "data.label_columns", "data.task=multilabel", "multiclass", "Fix: data.label_column")
    says(
        _convert_fails(comp, tmp_path / "out", "data.folds=2"),
        "train.csv",
        "4 bad row(s)",
        "4 x empty label in column 'label': line 3 (id 'img001'), line 6 (id 'img004'), line 9 (id 'img007'), "
        "line 12 (id 'img010')",
        "Fix:",
        "train.csv",
    )
    from common.data.conversion import convert_competition

    cfg = load_config(None, ["data.task=multilabel", "data.folds=2"])
    manifest = convert_competition(comp, tmp_path / "out", cfg.data)  # an empty set of labels is a label
    assert manifest["class_names"] == ["a", "b"] and manifest["schema"]["label_size"] == 2
    assert sum(manifest["splits"][f]["count"] for f in ("fold0", "fold1")) == 12


def test_too_few_samples_per_target_bin_for_the_folds(tmp_path):
    comp = write_competition(tmp_path / "comp", [0.5, 1.5, 2.5, 3.5])
    message = _convert_fails(comp, tmp_path / "out", "data.task=regression", "data.folds=5")
    says(message, "data.folds=5", "rarest bin", "4 samples", "Fix: --set data.folds=4")


@pytest.mark.parametrize(
    "task, dtype, size",
    [("multiclass", "int64", 0), ("binary", "int64", 0), ("multilabel", "int64", 3), ("regression", "float32", 0)],
)
def test_the_record_schema_stores_the_task_s_label(task, dtype, size):
    schema = schema_from_config(load_config(None, [f"data.task={task}", "data.class_names=[a, b, c]"]).data)
    assert (schema.label_dtype, schema.label_size) == (dtype, size)


def test_records_without_a_manifest_need_class_names_unless_labels_are_values(tmp_path):
    import tensorflow as tf

    schema = RecordSchema(label_dtype="float32")
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        with tf.io.TFRecordWriter(str(tmp_path / split / f"{split}.tfrec")) as writer:
            for i in range(3):
                writer.write(serialize_example(image_bytes(i), f"{split}{i}", 0.5 * i, schema))
    records = record_set(str(tmp_path), load_config(None, ["data.task=regression"]).data, 0)
    assert (records.train_count, records.val_count, records.label_type, records.class_names) == (3, 3, "float", [])
    with pytest.raises(DataError, match="has no manifest.json, so data.class_names must list the classes"):
        record_set(str(tmp_path), load_config(None, ["data.task=multiclass"]).data, 0)
