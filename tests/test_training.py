import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from common.core.config import load_config
from common.core.errors import ConfigError, StrategyError
from common.core.strategy import get_strategy
from common.export.card import CARD_NAME, ExportError, ModelCard, read_card
from common.export.loader import load_export
from common.export.writer import ExportContents, write_export
from common.tasks.types import TASKS
from common.training.backends.tf_keras.backend import TFBackend
from common.training.backends.tf_keras.model import build_model
from common.training.backends.tf_keras.step import CustomLoop
from common.training.epoch import PROGRESS_NAME

import numpy as np
import pytest
import tensorflow as tf

from train_tpu.train import main as train_main

from builders import kill_after_epochs, says, set_args

REPO = Path(__file__).resolve().parents[1]


def test_custom_loop_step_on_two_replicas_equals_the_single_device_step(plain_backbone):
    cfg = load_config(None, [f"model.hub_handle={plain_backbone}", "model.dropout=0"])
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (8, 16, 16, 3), dtype=np.uint8)
    labels = np.array([0, 1, 2, 3, 0, 1, 2, 3], dtype=np.int32)
    tf.keras.utils.set_random_seed(0)
    initial = build_model(cfg.model, 4, 16).get_weights()

    def one_step(strategy):
        with strategy.scope():
            model = build_model(cfg.model, 4, 16)
            model.set_weights(initial)
            model.compile(optimizer=tf.keras.optimizers.SGD(0.5))
            model.optimizer.build(model.trainable_variables)
        loop = CustomLoop(strategy, model, TASKS["multiclass"], label_smoothing=0.1, global_batch=8)
        batch = tf.data.Dataset.from_tensor_slices((images, tf.one_hot(labels, 4))).batch(8)
        batches = strategy.experimental_distribute_dataset(batch)
        loop.train_steps(iter(batches), tf.constant(1))
        return model.get_weights(), float(loop.loss.result())

    mirrored = get_strategy("mirrored")
    assert mirrored.num_replicas_in_sync == 2  # each replica sees 4 of the 8 examples
    weights_2, loss_2 = one_step(mirrored)
    weights_1, loss_1 = one_step(get_strategy("default"))
    # Like with like: both on this CPU in float32 (its logical devices), only the split over replicas differs.
    assert loss_2 == pytest.approx(loss_1, rel=1e-5), "loss: 2 replicas against 1, both float32 on the CPU"
    moved = [np.abs(w1 - w0).max() for w1, w0 in zip(weights_1, initial, strict=True)]
    assert min(moved) > 1e-4  # the step changed every variable ...
    for w2, w1 in zip(weights_2, weights_1, strict=True):
        np.testing.assert_allclose(
            w2,
            w1,
            atol=1e-5,  # ... identically on one device and on two replicas
            err_msg="weights after one step: 2 replicas against 1, both float32 on the CPU",
        )


@pytest.mark.e2e
def test_train_export_reload_in_a_fresh_process(train_argv, tmp_path, monkeypatch):
    # As on a Kaggle TPU after the stack negotiation (common/launch/negotiation.py): the stack that answered is
    # recorded.
    stack = {"stack": "tensorflow-tpu 2.20.0 + libtpu 0.0.17 (PJRT)", "runtime": "pjrt", "pins": {"libtpu": "0.0.17"}}
    monkeypatch.setenv("TPU2GPU_TPU_STACK", json.dumps(stack))
    # Keras fit's training iterator is let go on a thread of its own after fit: its teardown can hold the main
    # thread seconds (common/data/teardown.py).
    import threading
    import weakref

    from common.training.backends.tf_keras import iterators

    dropped_on, let_go = [], iterators.let_go

    def watched(holder):
        for held in holder:
            weakref.finalize(held, lambda: dropped_on.append(threading.current_thread().name))
        held = None  # the holder's reference the last
        let_go(holder)

    monkeypatch.setattr(iterators, "let_go", watched)
    assert train_main(train_argv()) == 0
    deadline = time.monotonic() + 90
    while len(dropped_on) < 2 and time.monotonic() < deadline:  # fit's iterator, then validation's (release)
        time.sleep(0.01)
    assert dropped_on == ["tpu2gpu-let-go"] * 2, dropped_on
    export = tmp_path / "out" / "export" / "fold0"
    card = read_card(export)
    assert card.complete and card.verification["max_abs_diff"]["float32"] < 1e-4
    assert card.class_names == sorted(card.class_names) and len(card.class_names) == 10
    assert card.input["dtype"] == "uint8" and card.input["shape"] == [None, 16, 16, 3]
    assert card.config["data"]["image_size"] == 16 and card.metrics["count"] == 288
    assert card.task == "multiclass" and card.metric["name"] == "macro_f1" and card.metrics["epochs"] == 2
    # The card's score is the one scikit-learn gives on the exported oof.csv (the fold's validation predictions).
    from common.training.finish import read_oof

    _, oof_labels, oof_predictions = read_oof(export / "oof.csv", TASKS["multiclass"], card.class_names)
    assert card.metric["value"] == pytest.approx(
        TASKS["multiclass"].score("macro_f1", oof_labels, oof_predictions), abs=1e-6
    )
    assert {"history.csv", "history.png", "confusion.png", "oof.csv", "verify_batch.npz"} <= {
        p.name for p in export.iterdir()
    }
    assert not (tmp_path / "out" / "work" / "fold0" / "checkpoints").exists()  # removed once exported
    report = json.loads((tmp_path / "out" / "export" / "training_report.json").read_text())
    assert report["folds"]["fold0"]["macro_f1"] == card.metrics["macro_f1"]
    assert card.runtime == report["runtime"] == {"framework": "tf_keras", "steps_per_execution": 2, "tpu_stack": stack}

    # The export's own check (common/export/check_child.py) reloaded it in a new process with TensorFlow alone (no
    # tf_keras, TF Hub, Keras 3 or JAX) and reproduced the probabilities recorded at export time: a process of the
    # test's own would repeat it.
    from common.core.children import CPU_ONLY_ENV

    assert card.verification["environment"] == CPU_ONLY_ENV  # as the check's own process reported it
    assert card.verification["max_abs_diff"]["float32"] < 1e-4
    batch = np.load(export / "verify_batch.npz")
    assert batch["predictions"].shape == (4, 10)
    np.testing.assert_allclose(batch["predictions"].sum(axis=1), 1.0, atol=1e-5)


@pytest.mark.e2e
def test_bfloat16_training_exports_a_float32_signature_and_says_which_part_ran_in_what(train_argv, tmp_path, capsys):
    from common.export.census import saved_census

    assert train_main(train_argv("train.precision=mixed_bfloat16", "train.epochs=1")) == 0
    assert tf.keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    tf.keras.mixed_precision.set_global_policy("float32")  # leave the process as other tests expect it
    log = capsys.readouterr().out
    # The tiny backbone is a TF Hub SavedModel, as the demo's is: its dtypes are fixed, the policy reaches the head.
    assert (
        "[train] precision: backbone float32, head bfloat16 (policy mixed_bfloat16; a TF Hub backbone keeps its "
        "SavedModel's dtypes)"
    ) in log
    assert "[train] float16 signature not exported: its graph would run 25% of the compute ops in float16" in log
    export = tmp_path / "out" / "export" / "fold0"
    card = read_card(export)
    assert card.precision["trained"] == {"policy": "mixed_bfloat16", "backbone": "float32", "head": "bfloat16"}
    assert card.precisions == {"float32": "serving_default"}
    assert saved_census(export / "saved_model", "serving_default") == {
        "Conv2D": {"float32": 3},
        "MatMul": {"float32": 1},
    }
    # The serving signature, loaded here (the export loads with TensorFlow alone in its own check): uint8 in, float32
    # out, float32 variables, and no bfloat16 anywhere in the serving graph, nested functions included.
    loaded = tf.saved_model.load(str(export / "saved_model"))  # held: its signature refers to its variables
    signature = loaded.signatures["serving_default"]
    outputs = signature(images=tf.zeros([3, 16, 16, 3], tf.uint8))["predictions"]
    assert signature.structured_input_signature[1]["images"].dtype == tf.uint8
    assert (outputs.dtype, tuple(outputs.shape)) == (tf.float32, (3, 10))
    assert {v.dtype for v in signature.variables} == {tf.float32}
    assert "DT_BFLOAT16" not in str(signature.graph.as_graph_def())


@pytest.mark.slow
@pytest.mark.e2e
def test_a_killed_run_resumes_at_the_next_epoch(train_argv, tmp_path):
    """Slow: redundant with test_damaged_data.py's test_a_corrupt_record_ends_the_fold_naming_its_shard_and_the_
    repaired_run_resumes, whose run ends after its checkpoint (on a corrupt shard) and checks the same resume (the next
    epoch, history.csv's every epoch once, the card's epochs), and with the GCS journey's SIGKILLed runs, in a bucket
    and locally, resumed by the same command."""
    argv = [sys.executable, "-m", "train_tpu.train", *train_argv("train.epochs=6", "train.steps_per_epoch=6")]
    progress = tmp_path / "out" / "work" / "fold0" / "checkpoints" / PROGRESS_NAME
    killed_after = kill_after_epochs(argv, progress, 2)  # killed, not asked to stop
    assert 2 <= killed_after < 6
    assert not (tmp_path / "out" / "export" / "fold0").exists()

    again = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming from the checkpoint after epoch {killed_after}" in again.stdout
    assert f"Epoch {killed_after + 1}/6" in again.stdout and f"Epoch {killed_after}/6" not in again.stdout
    history = np.genfromtxt(tmp_path / "out" / "export" / "fold0" / "history.csv", delimiter=",", names=True)
    assert history["epoch"].tolist() == list(range(6))  # every epoch once, none repeated, none lost
    assert read_card(tmp_path / "out" / "export" / "fold0").metrics["epochs"] == 6


def test_fold_estimates_come_from_the_last_fold_scaled_to_the_schedule():
    from common.training.budget import FoldTiming, estimate_fold_seconds, export_reserve_seconds, should_start

    timing = FoldTiming(setup=40.0, epochs=[95.0, 61.0, 60.0], export=50.0)  # first epoch compiles; cut after 3
    assert estimate_fold_seconds(timing, 10, unmeasured_minutes=0) == 40 + 95 + 9 * 60.5 + 50
    assert estimate_fold_seconds(None, 10, unmeasured_minutes=30) == 1800
    assert estimate_fold_seconds(timing, 4, unmeasured_minutes=0) == 40 + 95 + 3 * 60.5 + 50  # resumed at epoch 6
    assert estimate_fold_seconds(timing, 0, unmeasured_minutes=0) == 90  # resumed after its last epoch: setup, export
    assert export_reserve_seconds(timing, 5) == 50 and export_reserve_seconds(None, 5) == 300
    assert should_start(1, 730.0, 729.5) == (True, "")
    start, why = should_start(2, 600.0, 729.5)
    assert not start
    says(why, "time budget", "10.0 min left", "fold 2", "12.2 min", "train.fold_minutes", "fold 2 not started")


def test_the_default_budget_is_the_training_accelerators_session_less_the_exports_margin():
    from common.training.budget import budget_hours

    assert budget_hours(0, "TpuV5E8") == 8.25  # a TPU session ends at 9 h
    assert budget_hours(0, "NvidiaTeslaT4") == 11.25  # a GPU session at 12 h
    assert budget_hours(2.5, "NvidiaTeslaT4") == 2.5  # a budget that is set stands


def test_the_budget_cuts_only_an_epoch_that_has_a_next_one():
    from common.training.budget import cut_message, cuts_after

    now = 1000.0  # time.monotonic() seconds; 2 epochs planned, the longest so far took 60 s
    assert cuts_after(1, 2, now, 60.0, deadline=now + 59)  # one more epoch would end past the deadline
    assert not cuts_after(2, 2, now, 60.0, deadline=now + 59)  # after the last planned epoch nothing is cut
    assert not cuts_after(1, 2, now, 60.0, deadline=now + 60)  # it ends exactly at the deadline: it fits
    says(cut_message(1, 59.4, 60.2), "time budget", "59 s left", "60 s", "stopping after epoch 1")


@pytest.mark.e2e
def test_the_time_budget_cuts_a_fold_starts_no_fold_it_cannot_finish_and_inference_weighs_the_cut(
    train_argv, demo_dir, tmp_path, capsys
):
    from infer_gpu.infer import main as infer_main

    # 30 min: fold 0 starts (nothing measured yet, train.fold_minutes=0) and the budget cuts it after its first epoch,
    # since the export's 60 min (train.export_minutes) are kept back, whatever the host's speed. Minutes are left for
    # fold 1, but it would need 10000 epochs at fold 0's pace: it is not started, nor are the folds after it.
    assert (
        train_main(
            train_argv(
                "train.fold=-1",
                "train.epochs=10000",
                "train.steps_per_epoch=8",
                "train.time_budget_hours=0.5",
                "train.export_minutes=60",
            )
        )
        == 0
    )
    log = capsys.readouterr().out
    export = tmp_path / "out" / "export"
    card = read_card(export / "fold0")
    assert card.time_budget == {
        "cut": True,
        "epochs_trained": 1,
        "epochs_planned": 10000,
        "exported_epoch": 1,
        "budget_hours": 0.5,
    }
    assert "stopping after epoch 1 (the budget cuts this fold)" in log
    planned = re.search(r"time budget: ([\d.]+) min left, fold 1 needs about ([\d.]+) min", log)
    left, needed = float(planned.group(1)), float(planned.group(2))
    assert 0 < left < 30 < needed and "fold 1 not started" in log and "=== fold 1 ===" not in log
    assert [p.name for p in export.iterdir() if p.is_dir()] == ["fold0"]
    report = json.loads((export / "training_report.json").read_text())
    assert list(report["folds"]) == ["fold0"] and report["not_started"] == [1, 2, 3, 4]

    def infer(*settings):
        return infer_main(
            set_args(
                f"infer.exports=[{export}]",
                f"runtime.competition_dir={demo_dir}",
                f"runtime.output_dir={tmp_path / 'infer'}",
                *settings,
            )
        )

    assert infer() == 0
    log = capsys.readouterr().out
    assert (
        f"[infer] {export / 'fold0'}: the training time budget cut this fold after 1 of 10000 epochs (exported: "
        "epoch 1); infer.cut_folds=weight: weight 0.00"
    ) in log
    assert len((tmp_path / "infer" / "submission.csv").read_text().splitlines()) == 361
    with pytest.raises(ExportError, match="the training time budget cut every export, and infer.cut_folds=exclude"):
        infer("infer.cut_folds=exclude")
    assert infer("infer.cut_folds=include") == 0
    assert "infer.cut_folds=include: weight 1.00" in capsys.readouterr().out


@pytest.mark.e2e
def test_an_interrupted_export_never_looks_complete(tiny_backbone, tmp_path, monkeypatch):
    cfg = load_config(None, [f"model.hub_handle={tiny_backbone}"])
    model = build_model(cfg.model, 3, 16)
    images = np.zeros((2, 16, 16, 3), np.uint8)
    card = ModelCard.create(TASKS["multiclass"], ["a", "b", "c"], 16)
    export = tmp_path / "export" / "fold0"
    first = write_export(export, model, ExportContents(card, images))
    assert first.complete

    def crash(folder):
        raise KeyboardInterrupt  # e.g. the session ends while checking

    monkeypatch.setattr("common.export.writer.verify_in_fresh_process", crash)
    with pytest.raises(KeyboardInterrupt):
        write_export(export, model, ExportContents(dataclasses.replace(card, fold=1), images))
    assert read_card(export) == first  # the earlier complete export is untouched
    assert [p.name for p in export.parent.iterdir()] == ["fold0"]  # no half-written folder left beside it
    with pytest.raises(KeyboardInterrupt):
        write_export(tmp_path / "export" / "fold1", model, ExportContents(card, images))
    assert not (tmp_path / "export" / "fold1").exists()

    # A folder whose card is not marked complete (a crash between saving and checking) is refused.
    partial = tmp_path / "export" / "fold2"
    partial.mkdir()
    (partial / CARD_NAME).write_text(dataclasses.replace(first, complete=False).to_json())
    with pytest.raises(ExportError, match="not marked complete"):
        load_export(partial)


@pytest.mark.e2e
def test_bad_inputs_name_the_value_and_the_fix(train_argv):
    with pytest.raises(ConfigError, match=r"model.num_classes=5 but the data has 10 classes .* model.num_classes=10"):
        train_main(train_argv("model.num_classes=5"))
    with pytest.raises(StrategyError, match=r"train.batch_size=33 does not divide over 2 replicas.*batch_size=32"):
        train_main(train_argv("train.batch_size=33", "runtime.cpu_devices=2"))
    with pytest.raises(ConfigError, match="model.hub_handle='/missing/model' could not be loaded"):
        train_main(train_argv("model.hub_handle=/missing/model"))


@pytest.mark.e2e
def test_all_folds_in_turn_give_out_of_fold_scores(tmp_path, tiny_backbone):
    from common.data.conversion import convert_competition

    from builders import write_competition

    labels = ["cat", "dog", "emu"] * 12
    comp = write_competition(tmp_path / "comp", labels, size=16)
    convert_competition(comp, tmp_path / "rec", load_config(None, ["data.folds=2"]).data)
    argv = [
        f"runtime.tfrecords={tmp_path / 'rec'}",
        f"model.hub_handle={tiny_backbone}",
        "data.image_size=16",
        "train.fold=-1",
        "train.epochs=1",
        "train.steps_per_epoch=2",
        "train.batch_size_per_replica=4",
        f"runtime.output_dir={tmp_path / 'out'}",
    ]
    assert train_main(set_args(*argv)) == 0
    report = json.loads((tmp_path / "out" / "export" / "training_report.json").read_text())
    assert sorted(report["folds"]) == ["fold0", "fold1"]
    oof = report["out_of_fold"]
    assert oof["count"] == oof["unique_ids"] == 36  # every training image predicted exactly once, by its own fold
    assert np.array(oof["confusion_matrix"]).sum() == 36
    assert set(oof["per_class"]) >= {"cat", "dog", "emu", "macro avg"}
    for fold in range(2):
        assert read_card(tmp_path / "out" / "export" / f"fold{fold}").fold == fold


@pytest.mark.e2e
def test_the_best_epoch_is_exported_not_the_last(tmp_path, tiny_backbone):
    """Images whose colour gives the class, and a validation split labelled with the classes rotated: the better the
    model learns, the worse the validation log loss, so the first epoch is the best. The export must hold its
    weights, not the last epoch's."""
    import io

    from common.data.records import RecordSchema, serialize_example
    from common.training.finish import read_oof

    from PIL import Image

    colours = [(220, 30, 30), (30, 220, 30), (30, 30, 220)]
    rng = np.random.default_rng(0)
    for split, count, shift in (("train", 24, 0), ("val", 12, 1)):
        (tmp_path / "rec" / split).mkdir(parents=True)
        with tf.io.TFRecordWriter(str(tmp_path / "rec" / split / "records.tfrec")) as writer:
            for i in range(count):
                pixels = np.clip(np.array(colours[i % 3]) + rng.normal(0, 20, (16, 16, 3)), 0, 255).astype(np.uint8)
                png = io.BytesIO()
                Image.fromarray(pixels).save(png, format="PNG")
                writer.write(serialize_example(png.getvalue(), f"{split}{i}", (i + shift) % 3, RecordSchema()))
    argv = [
        f"runtime.tfrecords={tmp_path / 'rec'}",
        "data.class_names=[cat,dog,emu]",
        "data.train_files=train/*.tfrec",
        "data.val_files=val/*.tfrec",
        f"model.hub_handle={tiny_backbone}",
        "data.image_size=16",
        "train.fold=0",
        "train.epochs=4",
        "train.steps_per_epoch=6",
        "train.batch_size_per_replica=4",
        "train.learning_rate=0.1",
        "train.warmup_epochs=0",
        "train.metric=log_loss",
        "model.dropout=0",
        "train.early_stopping=2",
        f"runtime.output_dir={tmp_path / 'out'}",
    ]
    assert train_main(set_args(*argv)) == 0
    export = tmp_path / "out" / "export" / "fold0"
    card = read_card(export)
    history = np.genfromtxt(export / "history.csv", delimiter=",", names=True)
    best = card.metrics["best_epoch"]
    assert best == int(np.argmin(history["val_log_loss"])) + 1 and best < 4, history["val_log_loss"]
    assert card.metrics["epochs"] == best + 2 == len(history)  # early stopping: 2 epochs without a better one
    assert history["val_log_loss"][-1] > history["val_log_loss"][best - 1]  # the last epoch is worse
    # The exported predictions are the best epoch's: its score, and the outputs saved when it was scored.
    assert card.metric["value"] == pytest.approx(history["val_log_loss"][best - 1], abs=1e-5)
    _, _, predictions = read_oof(export / "oof.csv", TASKS["multiclass"], card.class_names)
    saved = np.load(tmp_path / "out" / "work" / "fold0" / "best" / "predictions.npy")
    np.testing.assert_allclose(predictions, saved, atol=1e-6)


@pytest.mark.e2e
def test_ema_exports_the_optimisers_averaged_weights(demo_records, tiny_backbone, tmp_path):
    from common.data.records import record_set
    from common.training.fold import train_fold

    records_dir, _ = demo_records
    cfg = load_config(
        None,
        [
            f"model.hub_handle={tiny_backbone}",
            "data.image_size=16",
            "train.epochs=2",
            "train.steps_per_epoch=5",
            "train.batch_size_per_replica=16",
            "train.ema=0.9",
            "train.keep=last",
            "train.learning_rate=0.1",
        ],
    )
    strategy = get_strategy("default")
    backend = TFBackend(cfg, strategy, str(tiny_backbone))
    train_fold(
        cfg, backend, record_set(str(records_dir), cfg.data, 0), tmp_path / "work", deadline=time.monotonic() + 600
    )
    optimizer = backend.model.optimizer
    assert optimizer.use_ema and optimizer.ema_momentum == pytest.approx(0.9)
    averages = [v.numpy() for v in optimizer._model_variables_moving_average]
    weights = [v.numpy() for v in backend.model.trainable_variables]
    assert len(averages) == len(weights) > 0
    for average, weight in zip(averages, weights, strict=True):
        np.testing.assert_array_equal(weight, average)  # fit swapped the averages in; they are what gets exported
    copy = backend.serving_model("float32")
    for exported, average in zip(copy.trainable_variables, averages, strict=True):
        np.testing.assert_array_equal(exported.numpy(), average)
