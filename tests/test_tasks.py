"""Every task type end to end through the entry points, on competitions made from scikit-learn's digits in the shapes
real competitions have: conversion (tpu2gpu tfrecords) -> training kernel -> inference kernel (TensorFlow only) ->
submission.csv in the template's columns and order, scored against the held-out answers.

    binary      SIIM-ISIC Melanoma: image_name,patient_id,target (0/1), a probability per row, scored by ROC AUC
    multilabel  Plant Pathology 2021: image,labels ("even loop big"), space-separated labels, samples-F1
    regression  PetFinder Pawpularity: Id,Pawpularity (a number), the value, RMSE
"""

import csv
import json
import shutil
from pathlib import Path

from common.core.config import load_config
from common.core.errors import ConfigError, DataError
from common.data.conversion import convert_competition
from common.tasks.types import TASKS

import numpy as np
import pytest

from infer_gpu.infer import main as infer_main
from train_tpu.train import main as train_main

from builders import SHAPES, read_csv, set_args, task_competition, write_csv
from inexact_float32 import tpu_float32

REPO = Path(__file__).resolve().parents[1]


# Epochs four times as long as the data's 18 steps, with the warm-up kept at 18 steps: the same schedule over the same
# steps as four times the epochs, with a quarter of the validation passes and checkpoints between them.
LONG_EPOCHS = ("train.steps_per_epoch=72", "train.warmup_epochs=0.25")


def run_task(tmp_path: Path, demo_dir: Path, tiny_backbone: Path, task: str, *extra: str, device_above=1e-4):
    competition, answers = task_competition(demo_dir, tmp_path / "competition", task)
    id_col, target_col = SHAPES[task][:2]
    settings = [
        f"data.task={task}",
        f"data.id_column={id_col}",
        f"data.label_column={target_col}",
        "data.image_size=16",
        "data.flip_left_right=false",
        f"model.hub_handle={tiny_backbone}",
        "train.fold=0",
        "train.batch_size_per_replica=32",
        "train.learning_rate=0.2",
        "train.steps_per_execution=8",
        "train.export_float16=false",
        *extra,
    ]
    flags = set_args(*settings)
    from tpu2gpu.cli import main as cli_main

    assert cli_main(["tfrecords", "--competition", str(competition), "--out", str(tmp_path / "records"), *flags]) == 0
    with tpu_float32():  # TensorFlow's float32 as an accelerator's, TF32 on: the head's MatMul rounds its operands
        assert (
            train_main(
                [
                    *flags,
                    *set_args(f"runtime.tfrecords={tmp_path / 'records'}", f"runtime.output_dir={tmp_path / 'train'}"),
                ]
            )
            == 0
        )
    card = json.loads((tmp_path / "train" / "export" / "fold0" / "model_card.json").read_text())
    # The export is checked against the trained model at exact float32 on the host; the accelerator's float32 (the
    # default placement, TF32 on) is recorded beside it, as far from it as the rounding makes it.
    verification = card["verification"]
    print(f"{task}: device {verification['device_max_abs_diff']:.1e}, export {verification['max_abs_diff']}")
    assert verification["max_abs_diff"]["float32"] < 1e-4 and verification["device_max_abs_diff"] > device_above, (
        verification
    )
    assert verification["device"] == "/job:localhost/replica:0/task:0/device:CPU:0 with TF32 on", verification
    # The inference kernel with no training config: the card says what the task is. (In this process: the export
    # loads with TensorFlow alone in the training's own check, and the kernel runs with TensorFlow alone on every task
    # type in test_torch_tasks.py.)
    assert (
        infer_main(
            set_args(
                f"infer.exports=[{tmp_path / 'train' / 'export'}]",
                f"runtime.competition_dir={competition}",
                f"data.id_column={id_col}",
                f"runtime.output_dir={tmp_path / 'infer'}",
            )
        )
        == 0
    )
    with (tmp_path / "infer" / "submission.csv").open(newline="") as f:
        header = next(csv.reader(f))
    submission = read_csv(tmp_path / "infer" / "submission.csv")
    assert header == [id_col, target_col]
    assert [r[id_col] for r in submission] == [a["id"] for a in answers]  # the template's order
    return [r[target_col] for r in submission], answers, card


@pytest.mark.e2e
def test_binary_submission_is_a_probability_per_row_with_patients_kept_whole(tmp_path, demo_dir, tiny_backbone):
    from sklearn.metrics import roc_auc_score

    # One sigmoid output over the tiny backbone's 8 features: the rounding moves it less than the other tasks' outputs
    # (multilabel 1.7e-3, regression 6.2e-4), and by how much depends on how confident the model ends: 1.3e-5 to
    # 1.6e-4 in three runs of the same test. Batches in a fixed order make it one figure, 3.2e-5 (twice).
    values, answers, card = run_task(
        tmp_path,
        demo_dir,
        tiny_backbone,
        "binary",
        "data.group_column=patient_id",
        "data.deterministic=true",
        # Twelve epochs of the data's own length: the run the figure above was measured on (the long epochs' run ends
        # more confident, and its rounding moved the outputs 7e-6 to 2e-5, by the host's threads).
        "train.epochs=12",
        device_above=1e-5,
    )
    probabilities = np.array([float(v) for v in values])
    assert probabilities.min() >= 0 and probabilities.max() <= 1
    # Probabilities, not 0/1 decisions (two values). A float32 sigmoid is exactly 1.0 beyond a logit of about 16.6, so
    # a confident model's outputs tie there (323 distinct of 360 seen, trained at the emulated TPU precision).
    assert len(set(values)) > 0.75 * len(values)
    auc = roc_auc_score([int(a["target"]) for a in answers], probabilities)
    print(f"binary: ROC AUC {auc:.4f} on {len(answers)} held-out images")
    assert auc >= 0.9, auc
    assert card["task"] == "binary" and card["metric"]["name"] == "roc_auc" and card["output"]["shape"] == [None, 1]
    assert (tmp_path / "train" / "export" / "fold0" / "roc.png").is_file()
    manifest = json.loads((tmp_path / "records" / "manifest.json").read_text())
    assert manifest["split"]["grouped"] is True
    fold_of = {}  # every patient's images in one fold
    from builders import read_records

    for name in manifest["splits"]:
        if name.startswith("fold"):
            files = [tmp_path / "records" / s["file"] for s in manifest["splits"][name]["shards"]]
            for record in read_records(files, labeled=False):
                fold_of[record["id"]] = name
    patients = {}
    for row in read_csv(tmp_path / "competition" / "train.csv"):
        patients.setdefault(row["patient_id"], set()).add(fold_of[row["image_name"]])
    assert all(len(folds) == 1 for folds in patients.values())


@pytest.mark.e2e
def test_multilabel_submission_is_known_labels_over_fold_thresholds(tmp_path, demo_dir, tiny_backbone):
    from sklearn.metrics import f1_score
    from sklearn.preprocessing import MultiLabelBinarizer

    values, answers, card = run_task(tmp_path, demo_dir, tiny_backbone, "multilabel", *LONG_EPOCHS, "train.epochs=3")
    names = ["big", "even", "loop", "odd"]
    assert card["class_names"] == names and len(card["thresholds"]) == 4
    assert all(v and set(v.split()) <= set(names) for v in values)
    binarizer = MultiLabelBinarizer(classes=names)
    truth = binarizer.fit_transform([a["target"].split() for a in answers])
    predicted = binarizer.transform([v.split() for v in values])
    samples_f1 = f1_score(truth, predicted, average="samples")
    print(f"multilabel: samples-F1 {samples_f1:.4f}, thresholds {card['thresholds']}")
    assert samples_f1 >= 0.8, samples_f1


@pytest.mark.e2e
def test_regression_submission_is_the_value_with_the_scaling_in_the_export(tmp_path, demo_dir, tiny_backbone):
    values, answers, card = run_task(tmp_path, demo_dir, tiny_backbone, "regression", *LONG_EPOCHS, "train.epochs=5")
    predicted = np.array([float(v) for v in values])
    truth = np.array([float(a["target"]) for a in answers])
    rmse = float(np.sqrt(np.mean((predicted - truth) ** 2)))
    print(f"regression: RMSE {rmse:.2f} (target std {truth.std():.2f})")
    assert rmse <= 0.6 * truth.std(), (rmse, truth.std())
    scaling = card["target_scaling"]
    assert 35 < scaling["mean"] < 55 and 25 < scaling["std"] < 33  # digits 0..9 x 10, standardised for training
    assert card["metric"]["name"] == "rmse" and card["output"]["kind"] == "values"
    assert (tmp_path / "train" / "export" / "fold0" / "predicted_vs_true.png").is_file()


def ordinal_task():
    """A fifth task type, defined here alone (docs/design.md, contract 8): ordinal regression. K ordered grades are
    predicted by K - 1 sigmoid outputs P(grade > k), trained on cumulative targets with binary cross-entropy; the grade
    is the number of outputs over 0.5, scored by quadratic weighted kappa. Everything else is multiclass's."""
    import dataclasses

    from common.tasks import parts
    from common.tasks.types import MULTICLASS

    def cumulative(labels, num_classes, scaling):  # grade 3 of 10 -> [1, 1, 1, 0, 0, 0, 0, 0, 0]
        tf = parts.tensorflow()
        return tf.cast(tf.cast(labels, tf.int32)[:, None] > tf.range(num_classes - 1)[None, :], tf.float32)

    def grade(predictions, thresholds=None):
        return (np.asarray(predictions) > 0.5).sum(axis=1)

    return dataclasses.replace(
        MULTICLASS,
        name="ordinal",
        activation="sigmoid",
        outputs=lambda num_classes: num_classes - 1,
        scorers={"qwk": parts.on_decisions(grade, parts.QWK), "accuracy": parts.on_decisions(grade, parts.ACCURACY)},
        target=cumulative,
        loss=parts.cross_entropy("binary_crossentropy", parts.by_target),
        running_metric=parts.running("BinaryAccuracy", "accuracy"),
        decide=grade,
        submission_value=lambda p, names, thresholds=None: names[int(grade(p[None, :])[0])],
        output_names=lambda names: [f"over_{n}" for n in names[:-1]],
        describe_target=lambda target, names, scaling: f"grade {float(target.sum()):.2f}",
        weighted_classes=None,
        class_scores=parts.nothing,
    )


@pytest.mark.e2e
def test_a_fifth_task_defined_in_a_test_alone_trains_and_predicts_end_to_end(
    tmp_path, demo_dir, tiny_backbone, monkeypatch
):
    from common.tasks.types import TASKS as tasks

    monkeypatch.setitem(tasks, "ordinal", ordinal_task())  # the one line that adds it: no other module changes
    competition, answers = task_competition(demo_dir, tmp_path / "competition", "ordinal")
    settings = [
        "data.task=ordinal",
        "data.label_column=grade",
        "data.image_size=16",
        "data.flip_left_right=false",
        f"model.hub_handle={tiny_backbone}",
        "train.fold=0",
        *LONG_EPOCHS,
        "train.epochs=3",
        "train.metric=qwk",
        "train.batch_size_per_replica=32",
        "train.learning_rate=0.2",
        "train.steps_per_execution=8",
        "train.export_float16=false",
        "runtime.strategy=default",
    ]  # one replica, whatever ran before
    flags = set_args(*settings)
    from tpu2gpu.cli import main as cli_main

    assert cli_main(["tfrecords", "--competition", str(competition), "--out", str(tmp_path / "records"), *flags]) == 0
    assert (
        train_main(
            [
                *flags,
                *set_args(f"runtime.tfrecords={tmp_path / 'records'}", f"runtime.output_dir={tmp_path / 'train'}"),
            ]
        )
        == 0
    )
    assert (
        infer_main(
            set_args(
                f"infer.exports=[{tmp_path / 'train' / 'export'}]",
                f"runtime.competition_dir={competition}",
                f"runtime.output_dir={tmp_path / 'infer'}",
            )
        )
        == 0
    )
    card = json.loads((tmp_path / "train" / "export" / "fold0" / "model_card.json").read_text())
    assert (
        card["task"] == "ordinal" and card["output"]["shape"] == [None, 9] and card["class_names"] == list("0123456789")
    )
    submission = read_csv(tmp_path / "infer" / "submission.csv")
    assert [r["id"] for r in submission] == [a["id"] for a in answers]
    from sklearn.metrics import cohen_kappa_score

    qwk = cohen_kappa_score(
        [int(a["target"]) for a in answers], [int(r["grade"]) for r in submission], weights="quadratic"
    )
    print(f"ordinal: QWK {qwk:.4f} on {len(answers)} held-out images (validation {card['metric']['value']:.4f})")
    assert qwk >= 0.8, qwk


# ---------------------------------------------------------------------------------------------- task rules and metrics
def test_metric_must_fit_the_task():
    assert TASKS["binary"].competition_metric("") == "roc_auc"
    assert TASKS["multiclass"].competition_metric("qwk") == "qwk"
    with pytest.raises(
        ConfigError,
        match=r"train.metric='rmse' does not fit data.task=multilabel; for multilabel "
        r"choose one of \['samples_f1'",
    ):
        TASKS["multilabel"].competition_metric("rmse")
    with pytest.raises(ConfigError, match="train.metric='auc' is not a metric"):
        TASKS["binary"].competition_metric("auc")


@pytest.mark.parametrize(
    ("task", "values", "message"),
    [
        ("binary", ["0", "1", "2"], r"train.csv line 4: label '2' is not 0 or 1"),
        ("regression", ["1.5", "cat"], r"train.csv line 3: label 'cat' is not a number"),
        (
            "multilabel",
            ["even", "odd big", "even rust"],
            r"train.csv line 4: label\(s\) \['rust'\] are not in "
            r"data.class_names \['big', 'even', 'odd'\]",
        ),
    ],
)
def test_labels_of_the_wrong_kind_are_named(task, values, message):
    """Wrong kinds for the task; a label outside data.class_names is named too (multilabel lists included)."""
    sources = [f"train.csv line {i + 2}" for i in range(len(values))]
    with pytest.raises(DataError, match=message):
        TASKS[task].encode(values, sources, ["big", "even", "odd"] if task == "multilabel" else [])


def test_metrics_are_scikit_learns_on_known_numbers():
    binary = TASKS["binary"]
    labels, p = np.array([0, 0, 1, 1]), np.array([[0.1], [0.6], [0.4], [0.9]])
    assert binary.score("roc_auc", labels, p) == pytest.approx(0.75)
    assert binary.score("accuracy", labels, p) == pytest.approx(0.5)
    regression = TASKS["regression"]
    assert regression.score("rmse", np.array([1.0, 3.0]), np.array([[2.0], [3.0]])) == pytest.approx(np.sqrt(0.5))
    # Rounded to [0, 1, 3, 3]: one step off on one of four; by hand 1 - (1/9) / (4/3) = 11/12.
    assert regression.score("qwk", np.array([0, 1, 2, 3]), np.array([[0.2], [1.4], [2.6], [3.1]])) == pytest.approx(
        11 / 12
    )
    multilabel = TASKS["multilabel"]
    truth = np.array([[1, 0], [0, 1], [1, 1]])
    scores = np.array([[0.7, 0.2], [0.3, 0.35], [0.6, 0.4]])
    # Label 0 is perfect for thresholds in (0.3, 0.6], label 1 in (0.2, 0.35]: the middle grid point of each.
    assert multilabel.choose_thresholds(truth, scores) == [0.5, 0.3]
    assert multilabel.score("samples_f1", truth, scores, [0.5, 0.3]) == pytest.approx(1.0)
    # At 0.5: row 0 right; row 1 has no label over it, so gets its likeliest (right); row 2 finds one of two.
    assert multilabel.score("samples_f1", truth, scores) == pytest.approx((1 + 1 + 2 / 3) / 3)


def test_multilabel_from_one_column_per_class_and_an_unknown_template_label(tmp_path, demo_dir):
    competition, _ = task_competition(demo_dir, tmp_path / "competition", "multilabel")
    rows = read_csv(competition / "train.csv")
    names = ["big", "even", "loop", "odd"]
    write_csv(
        competition / "train.csv",
        ["image", *names],
        [[r["image"], *(int(n in r["labels"].split()) for n in names)] for r in rows],
    )
    cfg = load_config(None, ["data.task=multilabel", "data.id_column=image", f"data.label_columns=[{','.join(names)}]"])
    manifest = convert_competition(competition, tmp_path / "records", cfg.data)
    assert manifest["class_names"] == names and manifest["schema"]["label_size"] == 4
    counts = {n: 0 for n in names}
    for row in rows:
        for label in row["labels"].split():
            counts[label] += 1
    totals = [sum(s["label_counts"][str(k)] for n, s in manifest["splits"].items() if n != "test") for k in range(4)]
    assert totals == [counts[n] for n in names]
    from common.inference.submission import check_template_classes, read_template

    write_csv(competition / "sample_submission.csv", ["image", "labels"], [["digit_0001", "even rust"]])
    with pytest.raises(DataError, match=r"uses labels \['rust'\] in column 'labels' that the model does not know"):
        check_template_classes(
            read_template(competition / "sample_submission.csv", "image"),
            TASKS["multilabel"],
            names,
            "sample_submission.csv",
        )


def test_regression_folds_are_stratified_by_target_bins(tmp_path, demo_dir):
    competition, _ = task_competition(demo_dir, tmp_path / "competition", "regression")
    cfg = load_config(None, ["data.task=regression", "data.id_column=Id", "data.label_column=Pawpularity"])
    manifest = convert_competition(competition, tmp_path / "records", cfg.data)
    means = [manifest["splits"][f"fold{k}"]["label_stats"]["mean"] for k in range(5)]
    assert max(means) - min(means) < 2.0  # each fold holds every range of the target (overall std about 29)
    shutil.rmtree(tmp_path / "records")


def test_balanced_class_weights_scale_each_examples_loss():
    import tensorflow as tf

    binary = TASKS["binary"]
    weights = binary.class_weights("balanced", [0, 0, 0, 1], 2)
    assert weights == pytest.approx([4 / (2 * 3), 4 / (2 * 1)])  # n / (classes x count)
    loss = binary.loss(0.0, [0.5, 2.0])
    targets, outputs = tf.constant([[1.0], [0.0], [0.5]]), tf.constant([[0.8], [0.8], [0.8]])
    expected = [2.0 * -np.log(0.8), 0.5 * -np.log(0.2), 1.25 * -(0.5 * np.log(0.8) + 0.5 * np.log(0.2))]
    np.testing.assert_allclose(loss(targets, outputs).numpy(), expected, rtol=1e-5)  # soft targets mix the weights
    from common.tasks.parts import keras_ops  # the same loss written once, run as Keras 3 ops (keras_jax: JAX)

    on_jax = binary.loss(0.0, [0.5, 2.0], ops=keras_ops())(targets.numpy(), outputs.numpy())
    np.testing.assert_allclose(np.asarray(on_jax), expected, rtol=1e-5)
    multiclass = TASKS["multiclass"]
    assert multiclass.class_weights("balanced", [0, 1, 1, 2, 2, 2], 4) == pytest.approx([2.0, 1.0, 2 / 3, 0.0])
    weighted = multiclass.loss(0.0, [1.0, 3.0, 1.0])(tf.constant([[0.0, 1.0, 0.0]]), tf.constant([[0.2, 0.5, 0.3]]))
    assert float(weighted[0]) == pytest.approx(3.0 * -np.log(0.5), rel=1e-5)
    with pytest.raises(ConfigError, match="train.class_weight='balanced' is for multiclass and binary tasks"):
        TASKS["regression"].class_weights("balanced", [1.0, 2.0], 0)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_each_tasks_loss_is_the_same_in_the_three_routes_array_libraries(task):
    """One loss, written once against Ops, run as TensorFlow (tf_keras), Keras 3 (JAX: keras_jax) and torch
    (torch_xla's torch_ops, here on the CPU: torch without torch_xla imports after TensorFlow): soft targets as MixUp
    makes them, label smoothing, class weights, and outputs at 0 and 1 where the clipping decides."""
    torch = pytest.importorskip("torch")
    from common.tasks.parts import keras_ops, torch_ops

    rng = np.random.default_rng(0)
    width = {"multiclass": 4, "binary": 1, "multilabel": 3, "regression": 1}[task]
    targets = (
        rng.dirichlet(np.ones(width), 6).astype(np.float32)
        if task == "multiclass"
        else rng.uniform(size=(6, width)).astype(np.float32)
    )
    outputs = rng.dirichlet(np.ones(width), 6) if task == "multiclass" else rng.uniform(size=(6, width))
    outputs[0] = 0.0 if task != "multiclass" else np.eye(width)[0]  # log(0) without the clipping
    outputs = outputs.astype(np.float32)
    weights = [0.5, 2.0, 1.0, 3.0][: max(width, 2)] if task in ("multiclass", "binary") else None
    smoothing = 0.0 if task == "regression" else 0.1
    losses = [TASKS[task].loss(smoothing, weights, ops=ops) for ops in (None, keras_ops(), torch_ops("cpu"))]
    on_tensorflow = losses[0](targets, outputs).numpy()
    on_keras = np.asarray(losses[1](targets, outputs))
    on_torch = losses[2](torch.from_numpy(targets), torch.from_numpy(outputs)).numpy()
    assert on_tensorflow.shape == (6,) and np.isfinite(on_tensorflow).all()
    np.testing.assert_allclose(on_torch, on_keras, rtol=1e-5, atol=1e-6)  # torch_ops follows Keras 3's clipping
    # tf_keras' binary cross-entropy takes log(p + 1e-7) after clipping where Keras 3 takes log(p): the routes differ
    # where an output is saturated (row 0: 0.6 nats of 14 for binary), nowhere else.
    np.testing.assert_allclose(on_keras[1:], on_tensorflow[1:], rtol=1e-5, atol=1e-6)
