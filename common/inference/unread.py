"""The test images the pipeline could not decode: read with Pillow where it can, the rest named and given the fallback
prediction, so that one odd image in a hidden test set never fails a submission.

    ids, predictions, bad = predict_unread(card, source, template, (ids, predictions), cfg.infer, predict)
    write_bad_test_images(out / BAD_TEST_IMAGES, bad)

The test pipeline leaves out what TensorFlow refuses (common/data/pipeline.py, at no cost while every image decodes);
the ids it did not return are read here: Pillow opens every format it knows and a truncated file as far as it goes,
converts to RGB as the conversion does (common/data/images.py), and the PNG it writes goes through the same
decode_image as every other image. What nothing can read (an empty file, an HTML error page, a missing file or
record) gets the mean prediction of the readable test images (docs/training.md, "Unreadable test images").
infer.on_bad_image=error stops instead, with every such image named at once.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from common.core.errors import DataError
from common.data.pipeline import decode_image
from common.data.sources import TestImage

import numpy as np
import tensorflow as tf

BAD_TEST_IMAGES = "bad_test_images.csv"


@dataclass(frozen=True)
class BadTestImage:
    id: str
    where: str
    problem: str


def tensorflow_problem(data: bytes) -> str:
    """What TensorFlow says of these bytes (the pipeline's decode, run once more where it failed)."""
    try:
        tf.io.decode_image(data, channels=3, expand_animations=False)
    except (tf.errors.OpError, ValueError) as err:
        return str(getattr(err, "message", err)).strip().splitlines()[0]
    return "decodes here alone (the record around it may be damaged)"


def pillow_png(data: bytes) -> bytes:
    """The image Pillow reads from `data` (a truncated file as far as it goes), in RGB as the conversion makes it,
    as PNG bytes (lossless: decode_image then sizes it as it sizes the rest)."""
    from PIL import Image, ImageFile

    truncated, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, True
    try:
        with Image.open(io.BytesIO(data)) as img:
            out = io.BytesIO()
            img.convert("RGB").save(out, format="PNG")
            return out.getvalue()
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = truncated


def read_with_pillow(images: list[TestImage]) -> tuple[list[tuple[str, bytes]], list[BadTestImage]]:
    """(id, PNG bytes) of each image Pillow reads, and the rest with what failed."""
    read, bad = [], []
    for image in images:
        if image.data is None:
            bad.append(BadTestImage(image.id, image.where, image.problem))
            continue
        if not image.data:
            bad.append(BadTestImage(image.id, image.where, "empty (0 bytes)"))
            continue
        try:
            read.append((image.id, pillow_png(image.data)))
        except Exception as err:  # noqa: BLE001  Pillow raises many kinds on foreign bytes; each is only a reason here
            bad.append(
                BadTestImage(
                    image.id,
                    image.where,
                    f"TensorFlow: {tensorflow_problem(image.data)}; Pillow: {type(err).__name__}: {err}",
                )
            )
    return read, bad


def bad_images_message(bad: list[BadTestImage], shown: int = 30) -> str:
    lines = [f"  {b.id} ({b.where}): {b.problem}" for b in bad[:shown]]
    return "\n".join(lines + ([f"  ... and {len(bad) - shown} more"] if len(bad) > shown else []))


def image_bytes_batches(images: list[bytes], ids: list[str], image_size: int, batch_size: int) -> tf.data.Dataset:
    """The test pipeline's batches from encoded images in memory: decode_image sizes them as it sizes the rest."""
    dataset = tf.data.Dataset.from_tensor_slices(
        {"bytes": tf.constant(list(images), tf.string), "id": tf.constant(list(ids), tf.string)}
    )
    return dataset.map(lambda item: {"image": decode_image(item["bytes"], image_size), "id": item["id"]}).batch(
        batch_size
    )


def predict_unread(
    card, source, template, predicted: tuple[list[str], np.ndarray], infer_cfg, predict
) -> tuple[list[str], np.ndarray, list[BadTestImage]]:
    """The template ids the test pipeline did not return (predicted: its ids and predictions), predicted from what
    Pillow reads, the rest given the mean prediction of the readable test images (or, infer.on_bad_image=error, one
    error naming every one). predict(batches_for) is the ensemble's (common/inference/predict.py: ensemble_predict,
    with the units the time plan has left)."""
    ids, predictions = predicted
    returned = set(ids)
    left_out = [i for i in template.ids if i not in returned]
    if not left_out:
        return ids, predictions, []
    read, bad = read_with_pillow(source.unread_test_images(left_out, card))
    if bad and (infer_cfg.on_bad_image == "error" or len(bad) == len(template.ids)):
        nothing = len(bad) == len(template.ids)
        raise DataError(
            f"{len(bad)} of {len(template.ids)} test images cannot be read by TensorFlow or Pillow"
            + (" (all of them: nothing to predict from)" if nothing else "")
            + ":\n"
            + bad_images_message(bad)
            + "\nFix: replace them"
            + (
                ""
                if nothing
                else ", or infer.on_bad_image=fallback to predict them with the mean "
                "prediction of the readable test images"
            )
        )
    if read:
        print(
            f"[infer] {len(read)} test image(s) TensorFlow could not decode were read with Pillow: "
            f"{', '.join(i for i, _ in read[:5])}" + (" ..." if len(read) > 5 else ""),
            flush=True,
        )
        more_ids, more = predict(
            lambda card: image_bytes_batches(
                [b for _, b in read], [i for i, _ in read], card.image_size, infer_cfg.batch_size
            )
        )
        predictions = np.concatenate([predictions, more]) if ids else more
        ids = ids + more_ids
    if bad:
        fallback = predictions.mean(axis=0)
        print(
            f"[infer] warning: {len(bad)} test image(s) cannot be read by TensorFlow or Pillow, e.g. "
            f"{', '.join(b.id for b in bad[:5])}: each predicted as the mean of the {len(ids)} readable test "
            f"images (infer.on_bad_image=fallback); listed in {BAD_TEST_IMAGES}",
            flush=True,
        )
        ids = ids + [b.id for b in bad]
        predictions = np.concatenate([predictions, np.tile(fallback, (len(bad), 1))])
    return ids, predictions, bad


def write_bad_test_images(path: Path, bad: list[BadTestImage]) -> None:
    """bad_test_images.csv (id, path, problem) where some test image could not be read; an earlier run's is removed
    where none was, so the file always speaks of this run."""
    path = Path(path)
    if not bad:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "path", "problem"])
        writer.writerows([b.id, b.where, b.problem] for b in bad)
