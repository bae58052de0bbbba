"""Training one fold: both loops, checkpoints each epoch with resume, the time budget, out-of-fold predictions.

    result = train_fold(cfg, strategy, records, fold=0, work_dir=out / "fold0", deadline=deadline)

Resume: each epoch ends with a checkpoint (model, optimiser, epoch) written through the host. A run that is killed
and started again with the same output folder restores the newest checkpoint and continues with the next epoch.
Time budget: before an epoch would end past the deadline, training stops, so the fold still gets exported.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.config import config_to_dict
from common.data import images_and_labels, make_eval_dataset, make_train_dataset, read_ids_and_labels
from common.errors import ConfigError
from common.export import read_card, write_export
from common.metrics import classification_scores, plot_confusion, plot_history
from common.model import build_model, classification_loss, compile_model, learning_rate_schedule
from common.strategy import global_batch_size, scaled_learning_rate
from common.tfrecords import RecordSchema, RecordSet

import numpy as np
import tensorflow as tf

PROGRESS_NAME = "progress.json"


@dataclass
class FoldResult:
    model: tf.keras.Model
    history_csv: Path
    epochs_done: int
    stopped_by_budget: bool
    val_ids: list[str] = field(default_factory=list)
    val_labels: np.ndarray | None = None
    val_probs: np.ndarray | None = None


# -------------------------------------------------------------------------------------------------------- callbacks
class EpochCheckpoint(tf.keras.callbacks.Callback):
    """Model + optimiser + finished-epoch count, saved through the host at each epoch end; restore() resumes."""

    def __init__(self, model: tf.keras.Model, directory: Path, keep: int = 2):
        super().__init__()
        self.directory = Path(directory)
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epochs_done")
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, epochs_done=self.epoch)
        self.manager = tf.train.CheckpointManager(checkpoint, str(self.directory), max_to_keep=keep)
        self.options = tf.train.CheckpointOptions(experimental_io_device="/job:localhost")

    def restore(self) -> int:
        """Epochs already done (0 when there is no checkpoint)."""
        if self.manager.latest_checkpoint is None:
            return 0
        self.manager.checkpoint.restore(self.manager.latest_checkpoint, options=self.options).assert_consumed()
        return int(self.epoch.numpy())

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.assign(epoch + 1)
        self.manager.save(options=self.options)
        # Written after the checkpoint: whoever reads it (a human, a test) finds that checkpoint complete.
        progress = self.directory / PROGRESS_NAME
        progress.with_suffix(".tmp").write_text(json.dumps({"epochs_done": epoch + 1}))
        progress.with_suffix(".tmp").replace(progress)


class TimeBudget(tf.keras.callbacks.Callback):
    """Stops training when one more epoch (as long as the longest so far) would end past the deadline."""

    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = deadline  # time.monotonic() value
        self.longest = 0.0
        self.stopped = False

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        now = time.monotonic()
        self.longest = max(self.longest, now - self.started)
        if now + self.longest > self.deadline:
            print(f"[train] time budget: {self.deadline - now:.0f} s left, an epoch takes {self.longest:.0f} s: "
                  f"stopping after epoch {epoch + 1} to leave time for the export", flush=True)
            self.model.stop_training = True
            self.stopped = True


# ------------------------------------------------------------------------------------------------------ custom loop
class CustomLoop:
    """A hand-written training step: strategy.run per replica, several steps per tf.function call (tf.range), loss
    averaged over the global batch with tf.nn.compute_average_loss, so the update equals the single-device one."""

    def __init__(self, strategy: tf.distribute.Strategy, model: tf.keras.Model, num_classes: int,
                 label_smoothing: float, global_batch: int):
        self.strategy = strategy
        self.model = model
        self.global_batch = global_batch
        self.per_example_loss = classification_loss(num_classes, label_smoothing)
        with strategy.scope():
            self.loss = tf.keras.metrics.Mean(name="loss")
            self.accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="accuracy")

    def _step(self, images, labels):
        optimizer = self.model.optimizer
        with tf.GradientTape() as tape:
            probs = self.model(images, training=True)
            per_example = self.per_example_loss(labels, probs)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=self.global_batch)
            if self.model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
            scaled = optimizer.get_scaled_loss(loss) if hasattr(optimizer, "get_scaled_loss") else loss
        grads = tape.gradient(scaled, self.model.trainable_variables)
        if hasattr(optimizer, "get_unscaled_gradients"):  # mixed_float16: LossScaleOptimizer
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        self.loss.update_state(per_example)
        self.accuracy.update_state(labels, probs)

    @tf.function
    def train_steps(self, iterator, steps):
        for _ in tf.range(steps):  # a graph loop: one host round trip for `steps` steps
            images, labels = next(iterator)
            self.strategy.run(self._step, args=(images, labels))

    def fit(self, train_dataset, validation_data, validation_steps: int, epochs: int, initial_epoch: int,
            steps_per_epoch: int, steps_per_execution: int, callbacks) -> None:
        """The epoch loop of Keras fit, driving the same callbacks (checkpoint, time budget, CSV history)."""
        hooks = tf.keras.callbacks.CallbackList(callbacks, model=self.model)
        iterator = iter(train_dataset)
        hooks.on_train_begin()
        for epoch in range(initial_epoch, epochs):
            hooks.on_epoch_begin(epoch)
            self.loss.reset_state()
            self.accuracy.reset_state()
            done = 0
            while done < steps_per_epoch:
                chunk = min(steps_per_execution, steps_per_epoch - done)
                self.train_steps(iterator, tf.constant(chunk))
                done += chunk
            logs = {"loss": float(self.loss.result()), "accuracy": float(self.accuracy.result())}
            val = self.model.evaluate(validation_data, steps=validation_steps, verbose=0, return_dict=True)
            logs.update({f"val_{k}": float(v) for k, v in val.items()})
            print(f"epoch {epoch + 1}/{epochs}: " + ", ".join(f"{k}={v:.4f}" for k, v in logs.items()), flush=True)
            hooks.on_epoch_end(epoch, logs)
            if self.model.stop_training:
                break
        hooks.on_train_end()


# ------------------------------------------------------------------------------------------------------- prediction
def predict_records(model: tf.keras.Model, files, schema: RecordSchema, image_size: int, batch_size: int,
                    count: int, labeled: bool) -> tuple[list[str], np.ndarray | None, np.ndarray]:
    """(ids, labels, probabilities) for every record of `files`, in order. Batches are padded to a full batch and the
    padding dropped after: static shapes for TPUs, and no record lost to drop_remainder."""
    dataset = make_eval_dataset(files, schema, image_size, batch_size, labeled=labeled)
    ids, labels = read_ids_and_labels(files, schema, labeled)

    def pad(batch):
        images = batch["image"]
        missing = batch_size - tf.shape(images)[0]
        images = tf.pad(images, [[0, missing], [0, 0], [0, 0], [0, 0]])
        return tf.ensure_shape(images, [batch_size, image_size, image_size, 3])

    if len(ids) != count:
        raise ConfigError(f"expected {count} records in {len(files)} files, read {len(ids)}: the manifest and the "
                          "files disagree; convert the data again")
    probs = model.predict(dataset.map(pad), steps=-(-count // batch_size), verbose=0)[:count]
    return ids, labels, probs


# ---------------------------------------------------------------------------------------------------------- one fold
def train_fold(cfg, strategy: tf.distribute.Strategy, records: RecordSet, work_dir: Path, deadline: float,
               hub_handle: str | None = None) -> FoldResult:
    """Build, (resume,) train and predict the validation records of one fold. Checkpoints live in work_dir."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    num_classes = len(records.class_names)
    if cfg.model.num_classes and cfg.model.num_classes != num_classes:
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} but the data has {num_classes} classes "
                          f"({', '.join(records.class_names[:5])}{', ...' if num_classes > 5 else ''}). Fix: --set "
                          f"model.num_classes={num_classes}, or 0 to take it from the data")
    replicas = strategy.num_replicas_in_sync
    batch = global_batch_size(cfg.train.batch_size_per_replica, replicas, cfg.train.batch_size)
    steps_per_epoch = cfg.train.steps_per_epoch or max(1, records.train_count // batch)
    total_steps = steps_per_epoch * cfg.train.epochs
    peak_lr = scaled_learning_rate(cfg.train.learning_rate, batch, cfg.train.lr_reference_batch)
    schedule = learning_rate_schedule(peak_lr, total_steps, int(cfg.train.warmup_epochs * steps_per_epoch))
    print(f"[train] {records.train_count} training / {records.val_count} validation records, {num_classes} classes; "
          f"global batch {batch} ({replicas} replicas), {steps_per_epoch} steps/epoch, peak lr {peak_lr:.2e}",
          flush=True)

    train_data = strategy.distribute_datasets_from_function(
        lambda ctx: make_train_dataset(records.train_files, cfg.data, batch, input_context=ctx, seed=cfg.train.seed))
    val_data = images_and_labels(make_eval_dataset(records.val_files, records.schema, cfg.data.image_size, batch,
                                                   labeled=True))
    with strategy.scope():
        model = build_model(cfg.model, num_classes, cfg.data.image_size, hub_handle=hub_handle)
        compile_model(model, cfg.train, num_classes, schedule)
        model.optimizer.build(model.trainable_variables)  # slots exist before restore: nothing is deferred
        checkpoint = EpochCheckpoint(model, work_dir / "checkpoints")
        initial_epoch = checkpoint.restore()
    if initial_epoch:
        print(f"[train] resuming from the checkpoint after epoch {initial_epoch}", flush=True)
    history_csv = work_dir / "history.csv"
    budget = TimeBudget(deadline)
    callbacks = [checkpoint, budget, tf.keras.callbacks.CSVLogger(str(history_csv), append=initial_epoch > 0)]
    if initial_epoch < cfg.train.epochs:
        if cfg.train.loop == "fit":
            model.fit(train_data, validation_data=val_data, epochs=cfg.train.epochs, initial_epoch=initial_epoch,
                      steps_per_epoch=steps_per_epoch, validation_steps=-(-records.val_count // batch),
                      callbacks=callbacks, verbose=2)
        else:
            CustomLoop(strategy, model, num_classes, cfg.train.label_smoothing, batch).fit(
                train_data, val_data, -(-records.val_count // batch), cfg.train.epochs, initial_epoch, steps_per_epoch,
                cfg.train.steps_per_execution, callbacks)
    epochs_done = int(checkpoint.epoch.numpy())
    ids, labels, probs = predict_records(model, records.val_files, records.schema, cfg.data.image_size, batch,
                                         records.val_count, labeled=True)
    return FoldResult(model, history_csv, epochs_done, budget.stopped, ids, labels, probs)


# ------------------------------------------------------------------------------------------------------------ export
def inference_copy(model: tf.keras.Model, cfg, num_classes: int, hub_handle: str | None,
                   policy: str = "float32") -> tf.keras.Model:
    """The same architecture built under `policy` (float32: what a T4, which has no bfloat16, runs; mixed_float16:
    for tensor cores), outside any strategy scope, holding the trained weights. Mixed-precision variables are float32
    already, so the weights copy as they are."""
    trained_policy = tf.keras.mixed_precision.global_policy().name
    tf.keras.mixed_precision.set_global_policy(policy)
    try:
        copy = build_model(cfg.model, num_classes, cfg.data.image_size, hub_handle=hub_handle)
    finally:
        tf.keras.mixed_precision.set_global_policy(trained_policy)
    copy.set_weights(model.get_weights())
    return copy


def _fold_outputs(work: Path, result: FoldResult, records: RecordSet, scores: dict) -> dict[str, Path]:
    """oof.csv, the history plot and the confusion matrix, to travel inside the export."""
    with (work / "oof.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label", *(f"p_{c}" for c in records.class_names)])
        for i, label, p in zip(result.val_ids, result.val_labels, result.val_probs, strict=True):
            writer.writerow([i, records.class_names[label], *(f"{v:.6f}" for v in p)])
    plot_history(result.history_csv, work / "history.png")
    plot_confusion(scores["confusion_matrix"], records.class_names, work / "confusion.png")
    return {name: work / name for name in ("history.csv", "history.png", "confusion.png", "oof.csv")}


def _golden_batch(records: RecordSet, image_size: int, n: int = 4) -> np.ndarray:
    """A few validation images: the export must reproduce its probabilities for them wherever it is loaded."""
    dataset = make_eval_dataset(records.val_files, records.schema, image_size, n, labeled=False)
    return next(iter(dataset))["image"].numpy()


def export_fold(cfg, result: FoldResult, records: RecordSet, fold: int, export_dir: Path, hub_handle: str | None,
                trained_policy: str) -> dict:
    """Score the fold, then write its verified export (float32, plus float16 if configured). Returns the card."""
    scores = classification_scores(result.val_labels, result.val_probs, records.class_names)
    print(f"[train] fold {fold}: validation macro-F1 {scores['macro_f1']:.4f}, accuracy {scores['accuracy']:.4f}"
          f" after {result.epochs_done} epochs", flush=True)
    size, n_classes = cfg.data.image_size, len(records.class_names)
    card = {
        "fold": fold, "class_names": records.class_names, "label_type": records.label_type, "image_size": size,
        "record_schema": asdict(records.schema), "source_images": records.source_images,
        "input": {"signature": "serving_default", "name": "images", "dtype": "uint8", "shape": [None, size, size, 3],
                  "channels": "RGB", "range": [0, 255]},
        "output": {"name": "probabilities", "dtype": "float32", "shape": [None, n_classes]},
        "trained_precision": trained_policy, "export_precision": "float32",
        "metrics": {"macro_f1": scores["macro_f1"], "accuracy": scores["accuracy"], "count": scores["count"],
                    "epochs": result.epochs_done, "stopped_by_time_budget": result.stopped_by_budget,
                    "per_class": scores["per_class"], "confusion_matrix": scores["confusion_matrix"]},
        "config": config_to_dict(cfg),
    }
    float16 = inference_copy(result.model, cfg, n_classes, hub_handle, "mixed_float16") if cfg.train.export_float16 \
        else None
    card = write_export(export_dir, inference_copy(result.model, cfg, n_classes, hub_handle), card,
                        _golden_batch(records, size), _fold_outputs(Path(result.history_csv).parent, result, records,
                                                                    scores), float16_model=float16)
    print(f"[train] fold {fold}: export verified and complete in {export_dir}", flush=True)
    return card


def out_of_fold_scores(export_root: Path, folds) -> dict | None:
    """Scores of every exported fold's validation predictions together (the out-of-fold estimate)."""
    ids, labels, probs, class_names = [], [], [], None
    for fold in folds:
        class_names = read_card(export_root / fold)["class_names"]
        with (export_root / fold / "oof.csv").open(newline="") as f:
            for row in csv.DictReader(f):
                ids.append(row["id"])
                labels.append(class_names.index(row["label"]))
                probs.append([float(row[f"p_{c}"]) for c in class_names])
    if not ids:
        return None
    scores = classification_scores(np.array(labels), np.array(probs), class_names)
    print(f"[train] out-of-fold over {len(folds)} fold(s), {len(ids)} records: macro-F1 {scores['macro_f1']:.4f}, "
          f"accuracy {scores['accuracy']:.4f}", flush=True)
    return {"folds": list(folds), "unique_ids": len(set(ids)), **scores}
