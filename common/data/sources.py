"""Where a kernel's data comes from. Two kinds of source answer the same two questions: which TFRecords the training
kernel trains on, and which test batches the inference kernel predicts.

    source = open_source(cfg)                         # runtime.tfrecords, else runtime.competition_dir
    tfrecord_dir = source.training_records(scratch)   # the training kernel
    batches = source.test_batches(card, template, cfg.infer)   # the inference kernel: {'image', 'id'} batches

- CompetitionSource: a competition folder (CSV + images, or class folders: common/data/samples.py). Training
  converts it once into the scratch folder through the same samples the conversion reads; inference reads its test
  images through them too.
- RecordSource: TFRecords (a `tpu2gpu tfrecords` folder with its manifest, or files matched by data.train_files /
  data.test_files), local, attached on Kaggle, or gs://.

A new kind of data is a class with these two methods and a line in open_source (or, for images with labels in
another layout, a SampleSource that CompetitionSource's conversion reads).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from common.core.config import Config, DataConfig
from common.core.errors import DataError, UserError
from common.core.paths import resolve_data_path
from common.data.samples import IMAGE_SUFFIXES, CompetitionFolder


class Source(Protocol):
    """What the kernels ask of their data."""

    def training_records(self, scratch: Path) -> str:
        """The folder (or gs:// URL) of the TFRecords to train on."""
        ...

    def test_batches(self, card, template, infer_cfg):
        """tf.data batches of {'image', 'id'} at the card's image size, every template id at most once: what
        TensorFlow cannot read or decode is left out (common/inference/unread.py reads it another way)."""
        ...

    def unread_test_images(self, ids: list[str], card) -> list[TestImage]:
        """The images of ids (those test_batches left out) as bytes, or why there are none."""
        ...


@dataclass(frozen=True)
class TestImage:
    """A test image the pipeline left out, as its source finds it: its bytes, or None and why there are none."""

    id: str
    where: str  # its file, or the records it should be in
    data: bytes | None
    problem: str = ""


def open_source(cfg: Config) -> Source:
    """runtime.tfrecords when set, else runtime.competition_dir: the one place that chooses."""
    from common.core.platform import detect_platform

    if cfg.runtime.tfrecords:
        root = resolve_data_path(
            cfg.runtime.tfrecords, needs_gcs=detect_platform().needs_gcs, private=cfg.runtime.private_dataset
        )
        return RecordSource(root, cfg.data)
    if cfg.runtime.competition_dir:
        return CompetitionSource(CompetitionFolder(Path(resolve_data_path(cfg.runtime.competition_dir)), cfg.data))
    raise UserError("set runtime.tfrecords (TFRecords) or runtime.competition_dir (CSV + images) to the data")


@dataclass(frozen=True)
class CompetitionSource:
    folder: CompetitionFolder

    def training_records(self, scratch: Path) -> str:
        """Converted once into scratch/tfrecords (on Kaggle /kaggle/temp: gigabytes of records must not become kernel
        output); a resumed run reuses its earlier conversion."""
        from common.data.conversion import convert_competition
        from common.data.records import has_manifest

        records = scratch / "tfrecords"
        if not has_manifest(records):
            convert_competition(self.folder, records, self.folder.data_cfg, overwrite=True)
        return str(records)

    def test_batches(self, card, template, infer_cfg):
        from common.data.pipeline import make_image_file_dataset

        found = [s for s in self.folder.test_samples(template.ids) if s.path is not None]  # a missing one: unread
        if infer_cfg.check_images != "off":
            unlike = check_test_images([s.path for s in found], card, strict=infer_cfg.check_images == "strict")
            if unlike:
                print(
                    f"[infer] warning: {sum(unlike.values())} of {len(found)} test images differ from the training "
                    f"images ({', '.join(f'{n} x {kind}' for kind, n in unlike.most_common(5))}); the pipeline "
                    "resizes and converts them to RGB. infer.check_images=strict refuses them",
                    flush=True,
                )
        if not found:  # every image is missing: common/inference/unread.py names them
            import tensorflow as tf

            size = card.image_size
            return tf.data.Dataset.from_tensor_slices(
                {"image": tf.zeros([0, size, size, 3], tf.uint8), "id": tf.constant([], tf.string)}
            ).batch(infer_cfg.batch_size)
        return make_image_file_dataset(
            [s.path for s in found], [s.id for s in found], card.image_size, infer_cfg.batch_size
        )

    def unread_test_images(self, ids: list[str], card) -> list[TestImage]:
        folder = self.folder.root / self.folder.data_cfg.test_images
        images = []
        for sample in self.folder.test_samples(ids):
            if sample.path is None:
                images.append(
                    TestImage(
                        sample.id, str(folder), None, f"no image {sample.id}[{'|'.join(IMAGE_SUFFIXES)}] in {folder}"
                    )
                )
                continue
            try:
                images.append(TestImage(sample.id, str(sample.path), sample.path.read_bytes()))
            except OSError as err:
                images.append(TestImage(sample.id, str(sample.path), None, f"cannot be read ({err})"))
        return images


@dataclass(frozen=True)
class RecordSource:
    root: str
    data_cfg: DataConfig

    def training_records(self, scratch: Path) -> str:
        return self.root

    def test_files(self) -> list[str]:
        """The test split of a tpu2gpu manifest (its shards checked against it), else the files data.test_files
        matches."""
        from common.data.records import check_shards, glob_files, has_manifest, read_manifest, shard_paths

        if not has_manifest(self.root):
            return glob_files(self.root, self.data_cfg.test_files)
        manifest = read_manifest(self.root)
        check_shards(manifest, self.root, ["test"])
        return shard_paths(manifest, self.root, ["test"])

    def test_batches(self, card, template, infer_cfg):
        from common.data.pipeline import make_eval_dataset, read_ids_and_labels
        from common.data.records import RecordSchema

        files = self.test_files()
        schema = RecordSchema(**card.record_schema)
        check_record_ids(read_ids_and_labels(files, schema, labeled=False)[0], template.ids, self.data_cfg.test_csv)
        return make_eval_dataset(
            files, schema, card.image_size, infer_cfg.batch_size, labeled=False, skip_undecodable=True
        )

    def unread_test_images(self, ids: list[str], card) -> list[TestImage]:
        """The image bytes of ids, read from the records once more without decoding (a damaged record is skipped)."""
        from common.data.pipeline import parse_record
        from common.data.records import RecordSchema

        import tensorflow as tf

        wanted, found, schema = set(ids), {}, RecordSchema(**card.record_schema)
        for file in self.test_files():
            records = tf.data.TFRecordDataset([file]).map(lambda r: parse_record(r, schema, labeled=False))
            for record in records.ignore_errors().as_numpy_iterator():
                if record["id"].decode() in wanted:
                    found[record["id"].decode()] = (file, record["image"])
        return [
            TestImage(i, found[i][0], found[i][1])
            if i in found
            else TestImage(i, self.root, None, "not in the test records, or its record is damaged")
            for i in ids
        ]


def check_test_images(paths: list[Path], card, strict: bool = False) -> Counter:
    """Test images unlike the training images (card source_images: colour modes, and the size when they all had
    one), and unreadable ones, counted by kind and returned; or (strict) refused, every one named at once. Reads
    headers only. The pipeline resizes and converts every image, and reads or names an unreadable one
    (common/inference/unread.py): in a code competition the hidden test set is only seen at scoring, where one odd
    image must not fail the submission, hence counting by default."""
    from PIL import Image

    expected = card.source_images or {}
    modes, sizes = set(expected.get("modes") or []), expected.get("sizes")
    unlike: Counter = Counter()
    offending = []
    for path in paths:
        try:
            with Image.open(path) as img:
                size, mode = f"{img.width}x{img.height}", img.mode
        except Exception as err:  # noqa: BLE001  Pillow raises many kinds on foreign bytes
            unlike["unreadable by Pillow"] += 1
            offending.append(f"{path}: unreadable ({type(err).__name__}: {err})")
            continue
        if (modes and mode not in modes) or (sizes and size not in sizes):
            unlike[f"{size} {mode}"] += 1
            offending.append(f"{path}: {size} {mode}")
    if strict and offending:
        raise DataError(
            f"{len(offending)} test image(s) are unlike the training images, which were "
            f"{'/'.join(sizes or ['any size'])} {'/'.join(sorted(modes)) or 'any mode'} (model_card.json "
            "source_images), or unreadable:\n"
            + "\n".join(f"  {line}" for line in offending[:30])
            + (f"\n  ... and {len(offending) - 30} more" if len(offending) > 30 else "")
            + "\nFix: give test images prepared like the training images, or set infer.check_images=warn to let the "
            "pipeline resize and convert them (and read or name the unreadable ones)"
        )
    return unlike


def check_record_ids(ids_in_records: list[str], template_ids: list[str], csv_name: str) -> None:
    """No test id twice in the test records, and at least one template id among them (else data.id_feature is
    wrong). A template id missing from them is predicted with the fallback and named (common/inference/unread.py):
    a conversion with data.on_bad_image=skip leaves bad test images out."""
    counts = Counter(ids_in_records)
    if template_ids and not any(i in counts for i in template_ids):
        raise DataError(
            f"none of the {len(template_ids)} test ids of {csv_name} is in the test records (e.g. "
            f"'{template_ids[0]}'; the records hold e.g. {list(counts)[:3]}). Fix: attach the test "
            "TFRecords of this competition, or check data.id_feature and data.id_column"
        )
    repeated = [i for i, n in counts.items() if n > 1]
    if repeated:
        raise DataError(f"test id '{repeated[0]}' appears {counts[repeated[0]]} times in the test records")
