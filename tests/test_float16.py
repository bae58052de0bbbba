"""The float16 signature never costs the export: it is kept only where, computed as tensor cores compute it (float16
storage, float32 accumulation), it holds its tolerance; one that misses is left out with the reason, the float32
export written and verified as ever. The inference kernel compares the float16 signature with the float32 one on its
first test batch and falls back to float32 where they differ.

The model here computes in float16 everywhere (its convolution and its head follow the policy) and has logits a few
units apart around 3000, where float16 keeps steps of 2: its float16 probabilities are far from the float32 ones
whatever the arithmetic, as a head trained to large logits (or a regression of large values) would make them.
"""

import dataclasses
import json

from common.export.card import ModelCard
from common.export.census import traced_census
from common.export.float16 import tensor_core_outputs
from common.export.writer import ExportContents, export_models, host_reference, write_export
from common.tasks.types import TASKS

import numpy as np
import pytest
import tensorflow as tf

from tpu2gpu.demo_data import CLASS_NAMES

from builders import run_inference_kernels, says, set_args

pytestmark = pytest.mark.e2e  # a fresh-process check of each export, and the inference kernel

SIZE = 16


def sharp_model(policy: str, offset: float) -> tf.keras.Model:
    """uint8 [N, 16, 16, 3] -> 10 class probabilities from logits a few units apart around `offset` (fixed weights:
    every build the same model)."""
    tf.keras.mixed_precision.set_global_policy(policy)
    try:
        images = tf.keras.Input((SIZE, SIZE, 3), dtype=tf.uint8, name="image")
        x = tf.keras.layers.Rescaling(1.0 / 255.0, dtype="float32", name="to_unit_range")(images)
        x = tf.keras.layers.Conv2D(8, 3, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1), name="conv")(x)
        x = tf.keras.layers.GlobalAveragePooling2D(name="pool")(x)
        x = tf.keras.layers.Dropout(0.0, name="head_dropout")(x)
        x = tf.keras.layers.Dense(
            len(CLASS_NAMES), name="head_logits", kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2)
        )(x)
        outputs = tf.keras.layers.Activation("softmax", dtype="float32", name="predictions")(x)
        model = tf.keras.Model(images, outputs)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    kernel, bias = model.get_layer("head_logits").get_weights()
    model.get_layer("head_logits").set_weights([kernel * 10.0, bias + offset])
    return model


def images(seed: int, n: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SIZE, SIZE, 3), dtype=np.uint8)


def card() -> ModelCard:
    return ModelCard.create(TASKS["multiclass"], list(CLASS_NAMES), SIZE)


def test_the_tensor_core_emulation_accumulates_in_float32_and_rounds_what_float16_stores():
    """Its products on float16 operands equal float32 products of the same (float16) values, rounded once: far
    closer to float32 than a float16 accumulation of the same sum, and every compute op of its trace is float32."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        dense = tf.keras.Sequential(
            [tf.keras.Input((4096,)), tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")]
        )
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    x = np.full((1, 4096), 1.0 + 2.0**-10, np.float32)  # representable in float16; the sum is 4100 exactly
    emulated = tensor_core_outputs(dense, x)
    assert emulated.dtype == np.float32 and emulated[0, 0] == 4100.0  # float16 holds 4100 (steps of 4 there)
    # Summed in float16 instead, each step past 2048 rounds the running total: 4096, not 4100.
    total = np.float16(0)
    for value in x[0].astype(np.float16):
        total = np.float16(total + value)
    assert total == 4096.0


def test_a_float16_signature_that_misses_its_tolerance_is_left_out_and_the_float32_export_kept(tmp_path, capsys):
    verify = images(0)
    sharp = lambda policy: sharp_model(policy, 3000.0)  # noqa: E731
    assert traced_census(sharp("mixed_float16"), SIZE) == {"Conv2D": {"float16": 1}, "MatMul": {"float16": 1}}
    export = tmp_path / "export" / "fold0"
    written = export_models(export, sharp, ExportContents(card(), verify), export_float16=True)
    log = capsys.readouterr().out
    check = written.precision["float16_check"]
    assert check["arithmetic"] == "float16 storage, float32 accumulation, as tensor cores compute"
    assert check["tolerance"] == 1e-2 and check["images"] == 8 and check["max_abs_diff"] > 0.1, check
    note = written.precision["float16_signature"]
    says(
        note,
        "not exported",
        "verify images",
        f"{check['max_abs_diff']:.1e}",
        "float32 outputs",
        "float16 storage, float32 accumulation",
        "tolerance 1e-02",
    )
    assert f"[train] float16 signature {note}" in log
    saved = json.loads((export / "model_card.json").read_text())
    assert saved["complete"] is True and saved["precisions"] == {"float32": "serving_default"}
    assert saved["precision"]["float16_signature"] == note
    assert saved["verification"]["max_abs_diff"]["float32"] < 1e-4
    assert [p.name for p in export.parent.iterdir()] == ["fold0"]

    # A model whose float16 holds: the signature is kept, its check's figure and the CPU's own recorded.
    mild = lambda policy: sharp_model(policy, 0.0)  # noqa: E731
    kept = export_models(tmp_path / "mild", mild, ExportContents(card(), verify), export_float16=True)
    assert kept.precisions == {"float32": "serving_default", "float16": "serving_float16"}
    assert kept.precision["float16_check"]["max_abs_diff"] < 1e-2
    assert kept.precision["float16_signature"].startswith("exported")
    says(kept.precision["float16_signature"], "100%", "float16")
    assert kept.verification["max_abs_diff"]["float16"] < 1e-2  # this CPU's float16 kernels, recorded


def test_the_inference_kernel_falls_back_to_float32_where_the_float16_signature_differs_on_its_first_batch(
    demo_dir, tmp_path
):
    """An export whose float16 signature was written anyway (as an older export's, or one whose verify images were
    kinder than the test set): the kernel asked for float16 compares it on the first test batch, says so in one line
    and predicts in float32, and its submission is the float32 one's."""
    sharp16, sharp32, verify = sharp_model("mixed_float16", 3000.0), sharp_model("float32", 3000.0), images(0)
    contents = ExportContents(
        dataclasses.replace(card(), precision={"float16_signature": "written by the test"}),
        verify,
        expected=host_reference(sharp32, verify),
    )
    assert np.abs(tensor_core_outputs(sharp16, verify) - contents.expected).max() > 0.1
    export = tmp_path / "export" / "fold0"
    write_export(export, sharp32, contents, float16_model=sharp16)

    def argv(precision: str, out: str) -> list[str]:
        settings = [
            f"infer.exports=[{export.parent}]",
            f"runtime.competition_dir={demo_dir}",
            f"runtime.output_dir={tmp_path / out}",
            f"infer.precision={precision}",
        ]
        return set_args(*settings)

    run = run_inference_kernels([argv("float16", "half"), argv("float32", "full")])
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("[infer] float16 signature"))
    says(line, str(export), "differs by", "128 test image(s)", "tolerance 1e-02", "every export predicts in float32")
    assert float(line.split("differs by ")[1].split()[0]) > 0.1
    half, full = ((tmp_path / out / "submission.csv").read_text() for out in ("half", "full"))
    assert half == full and len(half.splitlines()) == 361


@pytest.mark.slow
def test_the_training_kernel_whose_float16_signature_misses_exits_0_with_a_verified_float32_export(
    demo_records, tmp_path, monkeypatch, capsys
):
    """Slow (33 s on 2 cores: EfficientNet-B0 traced and trained a step): the kernel's side of
    test_a_float16_signature_that_misses_its_tolerance_is_left_out_and_the_float32_export_kept, which checks the same
    export in the default run (and the real-weights probes of tests/test_real_weights.py meet either outcome through
    the kernel). tf_keras, the efficientnet package's B0 (its layers follow the policy); a float16 copy that misses
    its tolerance (held at 0 here: any difference misses) costs the signature alone, exit 0."""
    from train_tpu.train import main as train_main

    monkeypatch.setattr("common.export.writer.FLOAT16_TOLERANCE", 0.0)
    settings = [
        f"runtime.tfrecords={demo_records[0]}",
        "model.backbone=efficientnet",
        "model.efficientnet_weights=none",
        "data.image_size=32",
        "train.fold=0",
        "train.epochs=1",
        "train.steps_per_epoch=1",
        "train.batch_size_per_replica=8",
        f"runtime.output_dir={tmp_path}",
    ]
    assert train_main(set_args(*settings)) == 0
    log = capsys.readouterr().out
    card = json.loads((tmp_path / "export" / "fold0" / "model_card.json").read_text())
    check = card["precision"]["float16_check"]
    assert card["complete"] is True and card["precisions"] == {"float32": "serving_default"}
    assert check["max_abs_diff"] > 0 and check["tolerance"] == 0.0
    note = card["precision"]["float16_signature"]
    says(
        note, "not exported", f"{check['max_abs_diff']:.1e}", "float32 outputs", "float16 storage, float32 accumulation"
    )
    assert f"[train] float16 signature {note}" in log
    assert "[train] fold 0: export verified and complete" in log
