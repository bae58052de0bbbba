import json
import shutil
import subprocess
import sys
from pathlib import Path

from common.core.config import Config
from common.core.errors import DataError
from common.data.pipeline import make_image_file_dataset
from common.data.samples import CompetitionFolder
from common.export.card import ExportError, read_card
from common.export.loader import load_export
from common.inference.predict import ensemble_probabilities
from common.inference.submission import read_template

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from infer_gpu.infer import main as infer_main

from builders import read_csv, says, set_args, write_csv

pytestmark = pytest.mark.e2e  # the inference kernel, on the trained_export fixture's model

REPO = Path(__file__).resolve().parents[1]
# What the inference kernel must run without: Keras 2 and TF Hub (the GPU image may lack them) and pkg_resources (TF
# Hub's import of it; setuptools 82 removed it), scikit-learn (folds and metrics are training's), and every training
# module.
TRAINING_ONLY = (
    "tf_keras",
    "tensorflow_hub",
    "pkg_resources",
    "sklearn",
    "common.training",
    "common.data.conversion",
    "common.data.images",
    "train_tpu",
    "tpu2gpu",
)  # common.training: the package and all below it
BLOCK_TRAINING = f"import sys; sys.modules.update(dict.fromkeys({TRAINING_ONLY!r})); "


def test_trained_export_to_a_valid_submission_without_any_training_dependency(trained_export, demo_dir, tmp_path):
    out = tmp_path / "out"
    argv = set_args(
        f"infer.exports=[{trained_export}]",
        f"runtime.competition_dir={demo_dir}",
        f"runtime.output_dir={out}",
        "infer.tta=[identity, flip_up_down]",
        "infer.batch_size=50",
    )
    code = BLOCK_TRAINING + (
        "from common.core.errors import run_entry; from infer_gpu.infer import main; "
        f"run_entry('infer', main, {argv!r})"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "360 predictions, 1 export(s) x 2 view(s)" in run.stdout

    template = read_csv(demo_dir / "sample_submission.csv")
    submission = read_csv(out / "submission.csv")
    assert [r["id"] for r in submission] == [r["id"] for r in template]  # every test id once, in template order
    card = json.loads((trained_export / "fold0" / "model_card.json").read_text())
    assert {r["label"] for r in submission} <= set(card["class_names"])
    probabilities = read_csv(out / "probabilities.csv")
    sums = [sum(float(v) for k, v in row.items() if k != "id") for row in probabilities]
    np.testing.assert_allclose(sums, 1.0, atol=1e-4)
    # Each label is the argmax of its saved probabilities: written with float32's 9 digits, two classes print alike
    # only if they are equal (with six decimals, CI saw a near-tie print alike after two epochs at rate 0.05).
    chosen = np.array([float(row[r["label"]]) for row, r in zip(probabilities, submission, strict=True)])
    highest = np.array([max(float(row[c]) for c in card["class_names"]) for row in probabilities])
    np.testing.assert_array_equal(chosen, highest)
    assert not list(out.glob(".*partial*"))


def test_tta_and_ensemble_arithmetic(trained_export, demo_dir):
    card, predict = load_export(trained_export / "fold0")
    template = read_template(demo_dir / "sample_submission.csv", "id")
    paths = [s.path for s in CompetitionFolder(demo_dir, Config().data).test_samples(template.ids[:37])]
    batches = make_image_file_dataset(paths, template.ids[:37], card.image_size, 16)
    ids, single = ensemble_probabilities([predict], batches)
    assert ids == template.ids[:37] and single.shape == (37, 10)
    _, twice = ensemble_probabilities([predict, predict], batches)
    np.testing.assert_allclose(twice, single, atol=1e-6)  # an ensemble of one export twice is that export
    _, identity = ensemble_probabilities([predict], batches, tta=["identity"])
    np.testing.assert_allclose(identity, single, atol=1e-6)  # TTA with the identity view is no TTA
    _, flipped = ensemble_probabilities([predict], batches.map(lambda b: {**b, "image": tf.reverse(b["image"], [2])}))
    _, tta = ensemble_probabilities([predict], batches, tta=["identity", "flip_left_right"])
    np.testing.assert_allclose(tta, (single + flipped) / 2, atol=1e-6)  # views are averaged before the argmax
    assert not np.allclose(flipped, single)  # the flip is a different view, so the average means something
    _, mirrored = ensemble_probabilities([predict], batches, tta=["identity", "flip_left_right"], strategy=_mirrored())
    np.testing.assert_allclose(mirrored, tta, atol=1e-5)  # split over two replicas, same numbers, same order

    def flipped_predict(images):  # a second "export": the same model on the mirrored image
        return predict(tf.reverse(images, [2]))

    _, weighted = ensemble_probabilities([predict, flipped_predict], batches, weights=[1.0, 0.25])
    np.testing.assert_allclose(weighted, (single + 0.25 * flipped) / 1.25, atol=1e-6)  # a cut fold at weight 0.25


def _mirrored():
    from common.core.strategy import get_strategy

    return get_strategy("mirrored")


@pytest.fixture
def competition_copy(demo_dir, tmp_path):
    copy = tmp_path / "competition"
    shutil.copytree(demo_dir, copy)
    return copy


def _fails(tmp_path, error, match, *settings):
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        infer_main(set_args(*settings, f"runtime.output_dir={out}"))
    assert not out.exists() or not list(out.iterdir())  # no submission.csv, nothing half-written


def test_no_export_found(tmp_path, demo_dir):
    (tmp_path / "empty").mkdir()
    _fails(
        tmp_path,
        ExportError,
        r"no export \(a folder with model_card.json\) found under .*empty.*dataset_sources",
        f"infer.exports=[{tmp_path / 'empty'}]",
        f"runtime.competition_dir={demo_dir}",
    )


def test_export_not_marked_complete(tmp_path, trained_export, demo_dir):
    broken = tmp_path / "export" / "fold0"
    shutil.copytree(trained_export / "fold0", broken)
    card = json.loads((broken / "model_card.json").read_text())
    (broken / "model_card.json").write_text(json.dumps({**card, "complete": False}))
    _fails(
        tmp_path,
        ExportError,
        "is not marked complete",
        f"infer.exports=[{tmp_path / 'export'}]",
        f"runtime.competition_dir={demo_dir}",
    )


def test_classes_that_disagree_with_sample_submission(tmp_path, trained_export, competition_copy):
    rows = read_csv(competition_copy / "sample_submission.csv")
    write_csv(competition_copy / "sample_submission.csv", ["id", "label"], [(r["id"], "cat") for r in rows])
    _fails(
        tmp_path,
        DataError,
        r"uses labels \['cat'\] in column 'label' that the model does not know",
        f"infer.exports=[{trained_export}]",
        f"runtime.competition_dir={competition_copy}",
    )


@pytest.mark.parametrize(("size", "mode", "shown"), [(64, "RGB", "64x64 RGB"), (32, "L", "32x32 L")])
def test_test_images_unlike_the_training_images(tmp_path, trained_export, competition_copy, size, mode, shown, capsys):
    victim = sorted((competition_copy / "test").iterdir())[3]
    Image.new(mode, (size, size)).save(victim)
    _fails(
        tmp_path,
        DataError,
        rf"1 test image\(s\) are unlike the training images, which were 32x32 RGB .*\n  "
        rf".*{victim.name}: {shown}\n",
        f"infer.exports=[{trained_export}]",
        f"runtime.competition_dir={competition_copy}",
        "infer.check_images=strict",
    )
    # By default (a code competition's hidden test set): counted in a warning, and a valid submission.
    out = tmp_path / "out2"
    assert (
        infer_main(
            set_args(
                f"infer.exports=[{trained_export}]",
                f"runtime.competition_dir={competition_copy}",
                f"runtime.output_dir={out}",
            )
        )
        == 0
    )
    assert len(read_csv(out / "submission.csv")) == 360
    says(capsys.readouterr().out, "[infer] warning: 1 of 360 test images", f"1 x {shown}")


def test_a_test_id_missing_from_the_records(tmp_path, trained_export, competition_copy, demo_records):
    records_dir, _ = demo_records
    rows = [(r["id"], r["label"]) for r in read_csv(competition_copy / "sample_submission.csv")]
    write_csv(competition_copy / "sample_submission.csv", ["id", "label"], [*rows, ("digit_9999", rows[0][1])])
    _fails(
        tmp_path,
        DataError,
        r"1 of 361 test images cannot be read by TensorFlow or Pillow:\n  digit_9999 \(.*\): "
        "not in the test records",
        f"infer.exports=[{trained_export}]",
        f"runtime.competition_dir={competition_copy}",
        f"runtime.tfrecords={records_dir}",
        "infer.on_bad_image=error",
    )
    # From the complete records, the same ids as from the images.
    out = tmp_path / "from_records"
    write_csv(competition_copy / "sample_submission.csv", ["id", "label"], rows)
    assert (
        infer_main(
            set_args(
                f"infer.exports=[{trained_export}]",
                f"runtime.competition_dir={competition_copy}",
                f"runtime.tfrecords={records_dir}",
                f"runtime.output_dir={out}",
            )
        )
        == 0
    )
    assert [r["id"] for r in read_csv(out / "submission.csv")] == [r[0] for r in rows]


def test_the_inference_kernel_and_its_config_load_with_every_training_dependency_blocked():
    code = BLOCK_TRAINING + (
        "import infer_gpu.infer; from common.core.config import parse_kernel_args; "
        "cfg = parse_kernel_args('', ['--set', 'infer.tta=[flip_left_right]', '--set', 'infer.cut_folds=exclude', "
        "'--set', 'data.task=multilabel', '--set', 'train.epochs=3']); "
        "print(cfg.infer.tta, cfg.infer.cut_folds, cfg.data.task, cfg.train.epochs); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('common', 'sklearn', 'tf_keras', 'tensorflow_hub') "
        "and sys.modules[m] is not None))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    values, modules = run.stdout.strip().splitlines()[-2:]
    assert values == "('flip_left_right',) exclude multilabel 3"
    # The loader, not the writer; gs:// (exports in a bucket); nothing of the TPU launcher (common/launch): the config
    # takes no route from it, and guarded lives in common.core.errors.
    assert eval(modules) == [
        "common",
        "common.core",
        "common.core.atomic",
        "common.core.candidates",
        "common.core.config",
        "common.core.errors",
        "common.core.fields",
        "common.core.gcs",
        "common.core.paths",
        "common.core.platform",
        "common.core.process",
        "common.core.strategy",
        "common.data",
        "common.data.pipeline",
        "common.data.records",
        "common.data.samples",
        "common.data.sources",
        "common.data.teardown",
        "common.export",
        "common.export.card",
        "common.export.loader",
        "common.inference",
        "common.inference.blend",
        "common.inference.ensemble",
        "common.inference.predict",
        "common.inference.submission",
        "common.inference.time_plan",
        "common.inference.unread",
        "common.tasks",
        "common.tasks.parts",
        "common.tasks.types",
    ]


@pytest.mark.slow
def test_a_float16_signature_only_where_the_saved_graph_computes_in_float16(efficientnet_export, demo_dir, tmp_path):
    """Slow (about 3-4 minutes on 2 cores: EfficientNet-B0 trained, exported in float32 and float16 and checked in a
    fresh process), and the only check of a real float16 signature: opt in with -m slow. The TF Hub side (no float16
    signature, and why) is test_a_tf_hub_backbone_gets_no_float16_signature's."""
    from common.export.census import saved_census
    from common.inference.ensemble import inference_precision

    # The efficientnet package's backbone follows the policy: every convolution of serving_float16 is float16.
    export = efficientnet_export / "fold0"
    card, predict32 = load_export(export)
    assert card.precisions == {"float32": "serving_default", "float16": "serving_float16"}
    float16_ops = saved_census(export / "saved_model", "serving_float16")
    assert float16_ops == {
        "Conv2D": {"float16": 65},
        "DepthwiseConv2dNative": {"float16": 16},
        "MatMul": {"float16": 1},
    }
    assert saved_census(export / "saved_model", "serving_default") == {
        "Conv2D": {"float32": 65},
        "DepthwiseConv2dNative": {"float32": 16},
        "MatMul": {"float32": 1},
    }
    assert card.precision["signatures"]["serving_float16"] == {"float16_share": 1.0, "ops": float16_ops}
    check = card.precision["float16_check"]["max_abs_diff"]
    assert card.precision["float16_signature"].startswith("exported")
    says(card.precision["float16_signature"], "100%", "float16", f"{check:.1e}", "float32 outputs", "verify images")
    assert card.verification["max_abs_diff"]["float16"] < 1e-2
    _, predict16 = load_export(export, "float16")
    images = np.load(export / "verify_batch.npz")["images"]
    p32, p16 = predict32(images).numpy(), predict16(images).numpy()
    assert p16.dtype == np.float32 and 0 < np.abs(p16 - p32).max() < 1e-2  # float16 arithmetic, float32 output
    # The kernel on the float16 signature, over 24 of the test images (the path is the same for 360).
    small = tmp_path / "competition"
    small.mkdir()
    (small / "test").symlink_to(demo_dir / "test")
    write_csv(
        small / "sample_submission.csv",
        ["id", "label"],
        [[r["id"], r["label"]] for r in read_csv(demo_dir / "sample_submission.csv")[:24]],
    )
    assert (
        infer_main(
            set_args(
                f"infer.exports=[{efficientnet_export}]",
                f"runtime.competition_dir={small}",
                "infer.precision=float16",
                f"runtime.output_dir={tmp_path / 'out'}",
            )
        )
        == 0
    )
    assert len(read_csv(tmp_path / "out" / "submission.csv")) == 24
    assert inference_precision("auto", [card]) == "float32"  # no GPU here: float16 only pays on tensor cores


def test_a_tf_hub_backbone_gets_no_float16_signature(trained_export):
    """A TF Hub backbone keeps its SavedModel's float32: a float16 copy would round the head alone, so none is made,
    and asking the inference kernel for float16 names why."""
    from common.export.census import saved_census
    from common.inference.ensemble import inference_precision

    hub_card = read_card(trained_export / "fold0")
    assert hub_card.precisions == {"float32": "serving_default"}
    assert hub_card.precision["trained"] == {"policy": "float32", "backbone": "float32", "head": "float32"}
    says(hub_card.precision["float16_signature"], "not exported", "25%", "float16", "backbone", "float32")
    assert saved_census(trained_export / "fold0" / "saved_model", "serving_default") == {
        "Conv2D": {"float32": 3},
        "MatMul": {"float32": 1},
    }
    with pytest.raises(ExportError, match="not every export has a float16 signature \\(not exported: its graph"):
        inference_precision("float16", [hub_card])


def test_amp_runs_the_float32_signature_with_the_automatic_mixed_precision_rewrite_on(
    trained_export, demo_dir, tmp_path
):
    argv = set_args(
        f"infer.exports=[{trained_export}]",
        f"runtime.competition_dir={demo_dir}",
        f"runtime.output_dir={tmp_path}",
        "infer.precision=amp",
    )
    code = (
        "import sys, tensorflow as tf; from infer_gpu.infer import main; code = main(" + repr(argv) + "); "
        "print('amp option:', tf.config.optimizer.get_experimental_options().get('auto_mixed_precision')); "
        "sys.exit(code)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "float32 graphs, TensorFlow's automatic mixed precision rewrite on" in run.stdout
    assert "amp option: True" in run.stdout
    assert len(read_csv(tmp_path / "submission.csv")) == 360
