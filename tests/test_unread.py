"""The hidden test set never fails a submission: every test image is read as well as TensorFlow or Pillow can read it,
and one nothing can read is predicted with the fallback (the mean prediction of the readable test images) and named,
from a competition folder and from test TFRecords alike (common/inference/unread.py)."""

import io
import shutil
import subprocess
import sys
from pathlib import Path

from common.core.errors import DataError
from common.data.records import RecordSchema, serialize_example

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from infer_gpu.infer import main as infer_main

from builders import read_csv, says, set_args

pytestmark = pytest.mark.e2e  # the inference kernel on the trained_export fixture's model

REPO = Path(__file__).resolve().parents[1]
# TensorFlow alone, as on a GPU image that has nothing else of the training side.
BLOCKED = ("tf_keras", "tensorflow_hub", "jax", "keras", "pkg_resources", "sklearn", "common.training", "tpu2gpu")
HTML = b"<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body>502</body></html>\n"


def encoded(img: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **options)
    return out.getvalue()


def truncated_jpeg(clean: Image.Image) -> bytes:
    return encoded(clean.resize((256, 256), Image.NEAREST), "JPEG", quality=95)[:-300]


def animated_gif(clean: Image.Image) -> bytes:
    return encoded(clean, "GIF", save_all=True, append_images=[Image.new("RGB", clean.size, "white")], duration=100)


# Each made from a clean test image and written under its .png name; tolerance: the largest difference from the
# clean image's probabilities (0 where the pixels survive exactly; TensorFlow reads all but TIFF and truncated JPEG).
VARIANTS = {
    "16-bit PNG": (lambda c: encoded(Image.fromarray(np.array(c.convert("L"), np.uint16) * 257), "PNG"), 2e-6),
    "grey+alpha PNG": (lambda c: encoded(c.convert("LA"), "PNG"), 2e-6),
    "palette PNG": (lambda c: encoded(c.convert("P", palette=Image.ADAPTIVE, colors=256), "PNG"), 2e-6),
    "WebP bytes": (lambda c: encoded(c, "WEBP", lossless=True), 2e-6),
    "BMP bytes": (lambda c: encoded(c, "BMP"), 2e-6),
    "TIFF bytes": (lambda c: encoded(c, "TIFF"), 2e-6),
    "animated GIF": (animated_gif, 2e-6),
    "CMYK JPEG": (lambda c: encoded(c.convert("CMYK"), "JPEG", quality=100), 0.05),
    "truncated JPEG": (truncated_jpeg, 0.05),
    "6000x4000": (lambda c: encoded(c.resize((6000, 4000), Image.NEAREST), "PNG"), 0.05),
    "1x1": (lambda c: encoded(c.resize((1, 1)), "PNG"), None),  # decodes; nothing left of the digit to compare
}
UNREADABLE = {"empty file": b"", "HTML error page": HTML}


def probabilities(out: Path) -> dict[str, np.ndarray]:
    rows = read_csv(out / "probabilities.csv")
    return {r["id"]: np.array([float(v) for k, v in r.items() if k != "id"]) for r in rows}


@pytest.fixture(scope="module")
def clean_predictions(trained_export, demo_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    assert (
        infer_main(
            set_args(
                f"infer.exports=[{trained_export}]",
                f"runtime.competition_dir={demo_dir}",
                f"runtime.output_dir={out}",
                "runtime.tfrecords=",
            )
        )
        == 0
    )
    return probabilities(out)


def test_every_odd_test_image_is_read_and_the_unreadable_ones_get_the_fallback(
    trained_export, demo_dir, tmp_path, clean_predictions
):
    competition = shutil.copytree(demo_dir, tmp_path / "competition")
    images = sorted((competition / "test").iterdir())
    made = {}
    for path, (kind, (make, _)) in zip(images, VARIANTS.items(), strict=False):
        path.write_bytes(make(Image.open(path).convert("RGB")))
        made[kind] = path.stem
    for path, (kind, data) in zip(images[len(VARIANTS) :], UNREADABLE.items(), strict=False):
        path.write_bytes(data)
        made[kind] = path.stem
    template = [r["id"] for r in read_csv(competition / "sample_submission.csv")]
    settings = [f"infer.exports=[{trained_export}]", f"runtime.competition_dir={competition}", "runtime.tfrecords="]

    # The kernel with TensorFlow alone, the image check on (warn, the default).
    out = tmp_path / "warn"
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({BLOCKED!r})); from infer_gpu.infer import main; "
        "from common.core.errors import run_entry; "
        f"run_entry('infer', main, {set_args(*settings, f'runtime.output_dir={out}')!r})"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert [r["id"] for r in read_csv(out / "submission.csv")] == template  # every row, in the template's order
    got = probabilities(out)
    for kind, (_, tolerance) in VARIANTS.items():
        if tolerance is not None:
            np.testing.assert_allclose(
                got[made[kind]], clean_predictions[made[kind]], rtol=0, atol=tolerance, err_msg=kind
            )
    readable = [got[i] for i in template if i not in (made["empty file"], made["HTML error page"])]
    for kind in UNREADABLE:  # the fallback: the mean prediction of the readable test images
        np.testing.assert_allclose(got[made[kind]], np.mean(readable, axis=0), rtol=0, atol=1e-5, err_msg=kind)
    says(run.stdout, "[infer] 2 test image(s)", "read with Pillow", f"{made['TIFF bytes']}, {made['truncated JPEG']}")
    says(
        run.stdout,
        "[infer] warning: 2 test image(s)",
        "TensorFlow or Pillow",
        f"{made['empty file']}, {made['HTML error page']}",
        "358 readable",
        "infer.on_bad_image=fallback",
        "bad_test_images.csv",
    )
    assert "2 x unreadable by Pillow" in run.stdout  # the header check counts them instead of raising
    bad = read_csv(out / "bad_test_images.csv")
    assert [(r["id"], Path(r["path"]).name) for r in bad] == [
        (made["empty file"], f"{made['empty file']}.png"),
        (made["HTML error page"], f"{made['HTML error page']}.png"),
    ]
    assert bad[0]["problem"] == "empty (0 bytes)"
    assert bad[1]["problem"].startswith("TensorFlow: ") and "Pillow: UnidentifiedImageError" in bad[1]["problem"]

    # The image check off: the same submission.
    off = tmp_path / "off"
    assert infer_main(set_args(*settings, f"runtime.output_dir={off}", "infer.check_images=off")) == 0
    assert (off / "submission.csv").read_text() == (out / "submission.csv").read_text()
    # strict: every unreadable and unlike image named at once; on_bad_image=error: both unreadable ones at once.
    with pytest.raises(DataError) as strict:
        infer_main(set_args(*settings, f"runtime.output_dir={tmp_path / 'strict'}", "infer.check_images=strict"))
    says(str(strict.value), "10 test image(s)", "32x32 RGB")
    assert all(made[k] in str(strict.value) for k in ("empty file", "HTML error page", "1x1", "6000x4000"))
    with pytest.raises(DataError) as error:
        infer_main(set_args(*settings, f"runtime.output_dir={tmp_path / 'error'}", "infer.on_bad_image=error"))
    says(
        str(error.value),
        "2 of 360 test images",
        "TensorFlow or Pillow",
        f"{made['empty file']} ({images[len(VARIANTS)]}): empty (0 bytes)",
        made["HTML error page"],
    )
    assert not (tmp_path / "strict").exists() and not (tmp_path / "error").exists()  # nothing half-written


def test_a_damaged_test_record_and_a_missing_test_file_get_the_fallback(
    trained_export, demo_dir, tmp_path, clean_predictions
):
    competition = shutil.copytree(demo_dir, tmp_path / "competition")
    template = [r["id"] for r in read_csv(competition / "sample_submission.csv")]
    damaged, absent = template[7], template[11]
    (tmp_path / "records" / "test").mkdir(parents=True)
    with tf.io.TFRecordWriter(str(tmp_path / "records" / "test" / "test-000.tfrec")) as writer:
        for sample_id in template:
            if sample_id != absent:
                data = HTML if sample_id == damaged else (competition / "test" / f"{sample_id}.png").read_bytes()
                writer.write(serialize_example(data, sample_id, None, RecordSchema()))
    settings = [f"infer.exports=[{trained_export}]", f"runtime.competition_dir={competition}"]

    out = tmp_path / "from_records"
    assert (
        infer_main(set_args(*settings, f"runtime.tfrecords={tmp_path / 'records'}", f"runtime.output_dir={out}")) == 0
    )
    got = probabilities(out)
    assert [r["id"] for r in read_csv(out / "submission.csv")] == template
    fallback = np.mean([got[i] for i in template if i not in (damaged, absent)], axis=0)
    np.testing.assert_allclose([got[damaged], got[absent]], [fallback, fallback], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[template[0]], clean_predictions[template[0]], rtol=0, atol=2e-6)
    bad = read_csv(out / "bad_test_images.csv")
    assert [(r["id"], r["problem"].split(":")[0]) for r in bad] == [
        (damaged, "TensorFlow"),
        (absent, "not in the test records, or its record is damaged"),
    ]

    (competition / "test" / f"{absent}.png").unlink()  # a listed test image missing from the folder
    out = tmp_path / "from_folder"
    assert infer_main(set_args(*settings, "runtime.tfrecords=", f"runtime.output_dir={out}")) == 0
    assert [r["id"] for r in read_csv(out / "submission.csv")] == template
    assert [r["problem"] for r in read_csv(out / "bad_test_images.csv")] == [
        f"no image {absent}[.jpg|.jpeg|.png] in {competition / 'test'}"
    ]
    with pytest.raises(DataError, match=rf"1 of 360 test images cannot be read by TensorFlow or Pillow:\n  {absent} "):
        infer_main(
            set_args(
                *settings, "runtime.tfrecords=", f"runtime.output_dir={tmp_path / 'e'}", "infer.on_bad_image=error"
            )
        )
