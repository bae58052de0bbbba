"""Where a kernel's data comes from. Two kinds of source answer the same two questions: which TFRecords the training
kernel trains on, and which test batches the inference kernel predicts.

    source = open_source(cfg)                         # runtime.tfrecords, else runtime.competition_dir
    tfrecord_dir = source.training_records(scratch)   # the training kernel
    batches = source.test_batches(card, template, cfg.infer)   # the inference kernel: {'image', 'id'} batches

- CompetitionSource: a competition folder (CSV + images, common/data/samples.py). Training converts it once into the
  scratch folder through the same samples the conversion reads; inference reads its test images through them too.
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

from common.core.errors import DataError, UserError
from common.core.paths import resolve_data_path
from common.data.samples import CompetitionFolder


class Source(Protocol):
    """What the kernels ask of their data."""

    def training_records(self, scratch: Path) -> str:
        """The folder (or gs:// URL) of the TFRecords to train on."""
        ...

    def test_batches(self, card, template, infer_cfg):
        """tf.data batches of {'image', 'id'} at the card's image size, every template id exactly once."""
        ...


def open_source(cfg) -> Source:
    """runtime.tfrecords when set, else runtime.competition_dir: the one place that chooses."""
    from common.core.platform import detect_platform

    if cfg.runtime.tfrecords:
        root = resolve_data_path(cfg.runtime.tfrecords, needs_gcs=detect_platform().needs_gcs,
                                 private=cfg.runtime.private_dataset)
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

        paths = self.folder.test_images(template.ids, self.folder.data_cfg.test_csv)
        if infer_cfg.check_images != "off":
            unlike = check_test_images(paths, card, strict=infer_cfg.check_images == "strict")
            if unlike:
                print(f"[infer] warning: {sum(unlike.values())} of {len(paths)} test images differ from the training "
                      f"images ({', '.join(f'{n} x {kind}' for kind, n in unlike.most_common(5))}); the pipeline "
                      "resizes and converts them to RGB. infer.check_images=strict refuses them", flush=True)
        return make_image_file_dataset(paths, template.ids, card.image_size, infer_cfg.batch_size)


@dataclass(frozen=True)
class RecordSource:
    root: str
    data_cfg: object

    def training_records(self, scratch: Path) -> str:
        return self.root

    def test_batches(self, card, template, infer_cfg):
        from common.data.pipeline import make_eval_dataset, read_ids_and_labels
        from common.data.records import RecordSchema, glob_files, has_manifest, read_manifest, shard_paths

        files = (shard_paths(read_manifest(self.root), self.root, ["test"]) if has_manifest(self.root)
                 else glob_files(self.root, self.data_cfg.test_files))
        schema = RecordSchema(**card.record_schema)
        check_record_ids(read_ids_and_labels(files, schema, labeled=False)[0], template.ids, self.data_cfg.test_csv)
        return make_eval_dataset(files, schema, card.image_size, infer_cfg.batch_size, labeled=False)


def check_test_images(paths: list[Path], card, strict: bool = False) -> Counter:
    """Test images unlike the training images (card source_images: colour modes, and the size when they all had
    one): counted by kind and returned, or (strict) the first refused with its name. Reads headers only. The pipeline
    resizes and converts every image anyway; in a code competition the hidden test set is only seen at scoring,
    where one odd image must not fail the submission, hence counting by default."""
    from PIL import Image

    expected = card.source_images or {}
    modes, sizes = set(expected.get("modes") or []), expected.get("sizes")
    unlike: Counter = Counter()
    for path in paths:
        with Image.open(path) as img:
            size, mode = f"{img.width}x{img.height}", img.mode
        if (modes and mode not in modes) or (sizes and size not in sizes):
            if strict:
                raise DataError(
                    f"test image {path} is {size} {mode}, but the model was trained on "
                    f"{'/'.join(sizes or ['any size'])} {'/'.join(sorted(modes))} images (model_card.json "
                    "source_images). Fix: give test images prepared like the training images, or set "
                    "infer.check_images=warn to let the pipeline resize and convert them to RGB anyway")
            unlike[f"{size} {mode}"] += 1
    return unlike


def check_record_ids(ids_in_records: list[str], template_ids: list[str], csv_name: str) -> None:
    """Every template id in the test records, and none twice."""
    counts = Counter(ids_in_records)
    missing = [i for i in template_ids if i not in counts]
    if missing:
        raise DataError(f"{len(missing)} test id(s) of {csv_name} are missing from the test records, e.g. "
                        f"'{missing[0]}'. Fix: attach the complete test TFRecords (a conversion with "
                        "data.on_bad_image=skip leaves bad test images out: its bad_images.csv lists them), or check "
                        "data.id_feature")
    repeated = [i for i, n in counts.items() if n > 1]
    if repeated:
        raise DataError(f"test id '{repeated[0]}' appears {counts[repeated[0]]} times in the test records")
