"""Training one fold: both loops, checkpoints each epoch with resume, the competition metric each epoch, the
best epoch's weights, the time budget, out-of-fold predictions.

    result = train_fold(cfg, strategy, records, work_dir=scratch / "work" / "fold0", deadline=deadline)

Each epoch ends with the task's competition metric (train.metric, scikit-learn) on the validation fold, logged as
val_<metric>; with train.keep=best the weights of the best epoch so far are kept (best/), and those are exported,
whether training ran to the end, stopped early (train.early_stopping) or was cut by the time budget. With train.ema
the weights scored and exported are the optimiser's moving average.
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

from common.budget import cut_record
from common.config import config_to_dict
from common.data import make_eval_dataset, make_train_dataset, read_ids_and_labels
from common.errors import ConfigError
from common.export import FLOAT16_MIN_SHARE, float16_share, read_card, traced_census, write_export
from common.metrics import classification_scores, plot_confusion, plot_history, plot_predicted_vs_true, plot_roc
from common.model import build_model, compile_model, learning_rate_schedule, precision_by_part
from common.strategy import global_batch_size, scaled_learning_rate
from common.tasks import (
    Task,
    choose_thresholds,
    class_weights,
    competition_metric,
    get_task,
    is_better,
    keras_metrics,
    label_text,
    loss_function,
    metric_report,
    metric_score,
    output_names,
    parse_label_text,
    target_scaling,
    training_target,
)
from common.tfrecords import RecordSchema, RecordSet

import numpy as np
import tensorflow as tf

PROGRESS_NAME = "progress.json"
BEST_NAME = "best.json"


@dataclass
class FoldResult:
    model: tf.keras.Model  # holding the exported weights (the best epoch's with train.keep=best)
    history_csv: Path
    epochs_done: int
    stopped_by_budget: bool  # the time budget cut the schedule
    best_epoch: int  # 1-based epoch whose weights the model holds
    metric: str
    scaling: dict | None = None  # regression target standardisation
    class_weights: list[float] | None = None
    learning_rates: list[tuple[float, float]] | None = None  # (epoch, rate) along the schedule, for the plot
    val_ids: list[str] = field(default_factory=list)
    val_labels: np.ndarray | None = None
    val_predictions: np.ndarray | None = None  # in value space: probabilities, or de-standardised values
    epoch_seconds: list[float] = field(default_factory=list)  # each epoch run in this session, with its score


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
    """Stops training when one more epoch (as long as the longest so far) would end past the deadline, which is the
    budget's end minus the time kept for the export (common/budget.py). Records each epoch's seconds."""

    def __init__(self, deadline: float, planned_epochs: int):
        super().__init__()
        self.deadline = deadline  # time.monotonic() value
        self.planned_epochs = planned_epochs
        self.seconds: list[float] = []
        self.stopped = False

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        now = time.monotonic()
        self.seconds.append(now - self.started)
        longest = max(self.seconds)
        # After the last planned epoch, or once early stopping ended the fold, the budget has cut nothing.
        if now + longest > self.deadline and epoch + 1 < self.planned_epochs and not self.model.stop_training:
            print(f"[train] time budget: {self.deadline - now:.0f} s left before the export, an epoch takes "
                  f"{longest:.0f} s: stopping after epoch {epoch + 1} (the budget cuts this fold)", flush=True)
            self.model.stop_training = True
            self.stopped = True


class EpochScore(tf.keras.callbacks.Callback):
    """The competition metric on the validation fold after each epoch (logged as val_<metric>, with val_loss); the
    best epoch's weights kept in directory (train.keep=best); early stopping after `patience` epochs without a
    better value. With EMA, the averaged weights are the ones scored and kept. State survives a resume (best.json)."""

    def __init__(self, model: tf.keras.Model, predict_val, to_values, val_labels: np.ndarray,
                 val_targets: np.ndarray, task: Task, metric: str, directory: Path, keep_best: bool, patience: int,
                 loss):
        super().__init__()
        self.scored_model, self.predict_val, self.to_values = model, predict_val, to_values
        self.task, self.metric = task, metric
        self.val_labels, self.val_targets, self.loss = val_labels, val_targets, loss
        self.directory, self.keep_best, self.patience = Path(directory), keep_best, patience
        self.weights = tf.train.Checkpoint(model=model)
        self.options = tf.train.CheckpointOptions(experimental_io_device="/job:localhost")
        state = self.directory / BEST_NAME
        self.best = json.loads(state.read_text()) if state.is_file() else {"epoch": 0, "value": None}

    def _averaged(self):
        """(swap in, swap back) for the optimiser's moving average, or None without EMA."""
        optimizer = self.scored_model.optimizer
        if not getattr(optimizer, "use_ema", False):
            return None
        variables = self.scored_model.trainable_variables
        current = [v.numpy() for v in variables]

        def swap_in():
            optimizer._overwrite_model_variables_with_average_value(variables)  # tf_keras' own EMA swap

        def swap_back():
            for variable, value in zip(variables, current, strict=True):
                variable.assign(value)

        return swap_in, swap_back

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        swap = self._averaged()
        if swap:
            swap[0]()
        try:
            raw = self.predict_val()
            try:
                value = metric_score(self.metric, self.task, self.val_labels, self.to_values(raw))
            except ValueError as err:  # e.g. AUC on a validation fold that holds one class: no score, no best
                print(f"[train] epoch {epoch + 1}: val_{self.metric} cannot be computed ({err})", flush=True)
                value = float("nan")
            logs["val_loss"] = float(tf.reduce_mean(self.loss(self.val_targets, raw)))
            logs[f"val_{self.metric}"] = value
            if is_better(self.metric, value, self.best["value"]):
                self.best = {"epoch": epoch + 1, "value": value}
                if self.keep_best:
                    self.weights.write(str(self.directory / "best" / "weights"), options=self.options)
                    np.save(self.directory / "best" / "predictions.npy", raw)  # what the restored weights must give
                (self.directory / BEST_NAME).write_text(json.dumps(self.best))
        finally:
            if swap:
                swap[1]()
        best = "none yet" if self.best["value"] is None else f"{self.best['value']:.4f} at epoch {self.best['epoch']}"
        print(f"[train] epoch {epoch + 1}: val_{self.metric} {value:.4f} (best {best})", flush=True)
        if self.patience and epoch + 1 - self.best["epoch"] >= self.patience:
            print(f"[train] early stopping: no better val_{self.metric} for {self.patience} epochs", flush=True)
            self.model.stop_training = True

    def restore_best(self) -> tuple[int, np.ndarray | None]:
        """Put the best epoch's weights back into the model: (that epoch, the validation outputs it gave then), or
        (0, None) when none is kept."""
        if not self.keep_best or not self.best["epoch"]:
            return 0, None
        status = self.weights.read(str(self.directory / "best" / "weights"), options=self.options)
        status.assert_existing_objects_matched()
        return self.best["epoch"], np.load(self.directory / "best" / "predictions.npy")


# ------------------------------------------------------------------------------------------------------ custom loop
class CustomLoop:
    """A hand-written training step: strategy.run per replica, several steps per tf.function call (tf.range), loss
    averaged over the global batch with tf.nn.compute_average_loss, so the update equals the single-device one."""

    def __init__(self, strategy: tf.distribute.Strategy, model: tf.keras.Model, task: Task, label_smoothing: float,
                 global_batch: int, class_weights=None):
        self.strategy = strategy
        self.model = model
        self.global_batch = global_batch
        self.per_example_loss = loss_function(task, label_smoothing, class_weights)
        with strategy.scope():
            self.loss = tf.keras.metrics.Mean(name="loss")
            self.running = keras_metrics(task)[0]

    def _step(self, images, targets):
        optimizer = self.model.optimizer
        with tf.GradientTape() as tape:
            outputs = self.model(images, training=True)
            per_example = self.per_example_loss(targets, outputs)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=self.global_batch)
            if self.model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
            scaled = optimizer.get_scaled_loss(loss) if hasattr(optimizer, "get_scaled_loss") else loss
        grads = tape.gradient(scaled, self.model.trainable_variables)
        if hasattr(optimizer, "get_unscaled_gradients"):  # mixed_float16: LossScaleOptimizer
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        self.loss.update_state(per_example)
        self.running.update_state(targets, outputs)

    @tf.function
    def train_steps(self, iterator, steps):
        for _ in tf.range(steps):  # a graph loop: one host round trip for `steps` steps
            images, targets = next(iterator)
            self.strategy.run(self._step, args=(images, targets))

    def fit(self, train_dataset, epochs: int, initial_epoch: int, steps_per_epoch: int, steps_per_execution: int,
            callbacks) -> None:
        """The epoch loop of Keras fit, driving the same callbacks (checkpoint, score, time budget, CSV history)."""
        hooks = tf.keras.callbacks.CallbackList(callbacks, model=self.model)
        iterator = iter(train_dataset)
        hooks.on_train_begin()
        for epoch in range(initial_epoch, epochs):
            hooks.on_epoch_begin(epoch)
            self.loss.reset_state()
            self.running.reset_state()
            done = 0
            while done < steps_per_epoch:
                chunk = min(steps_per_execution, steps_per_epoch - done)
                self.train_steps(iterator, tf.constant(chunk))
                done += chunk
            logs = {"loss": float(self.loss.result()), self.running.name: float(self.running.result())}
            hooks.on_epoch_end(epoch, logs)
            print(f"epoch {epoch + 1}/{epochs}: " + ", ".join(f"{k}={v:.4f}" for k, v in logs.items()), flush=True)
            if self.model.stop_training:
                break
        if getattr(self.model.optimizer, "use_ema", False):  # as fit does: the averaged weights stay
            self.model.optimizer.finalize_variable_values(self.model.trainable_variables)
        hooks.on_train_end()


# ------------------------------------------------------------------------------------------------------- prediction
def predict_files(model: tf.keras.Model, files, schema: RecordSchema, image_size: int, batch_size: int,
                  count: int) -> np.ndarray:
    """Model outputs for the `count` records of `files`, in order. Batches are padded to a full batch and the padding
    dropped after: static shapes for TPUs, and no record lost to drop_remainder."""
    dataset = make_eval_dataset(files, schema, image_size, batch_size, labeled=False)

    def pad(batch):
        images = batch["image"]
        missing = batch_size - tf.shape(images)[0]
        images = tf.pad(images, [[0, missing], [0, 0], [0, 0], [0, 0]])
        return tf.ensure_shape(images, [batch_size, image_size, image_size, 3])

    return model.predict(dataset.map(pad), steps=-(-count // batch_size), verbose=0)[:count]


def sync_replica_statistics(model: tf.keras.Model, strategy: tf.distribute.Strategy) -> None:
    """Give every replica the same batch-norm statistics: their mean, which is what the weights read outside the
    replicas (get_weights, the export) hold. Each replica updates its own moving mean and variance (SyncOnRead
    variables), so without this a replica predicts its share of the validation set with statistics the exported
    model does not have (measured on 2 logical CPUs: up to 0.03 apart in probability)."""
    if strategy.num_replicas_in_sync == 1:
        return
    with strategy.scope():
        for variable in model.non_trainable_variables:
            if getattr(variable, "synchronization", None) == tf.VariableSynchronization.ON_READ:
                variable.assign(variable.read_value())


# ---------------------------------------------------------------------------------------------------------- one fold
def train_fold(cfg, strategy: tf.distribute.Strategy, records: RecordSet, work_dir: Path, deadline: float,
               hub_handle: str | None = None) -> FoldResult:
    """Build, (resume,) train and predict the validation records of one fold. Checkpoints live in work_dir."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    task = get_task(cfg.data.task)
    metric = competition_metric(task, cfg.train.metric)
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
    print(f"[train] {task.name}, {records.train_count} training / {records.val_count} validation records, "
          f"{num_classes} classes; global batch {batch} ({replicas} replicas), {steps_per_epoch} steps/epoch, peak lr "
          f"{peak_lr:.2e}; metric {metric}, keeping the {cfg.train.keep} epoch", flush=True)

    train_labels = read_ids_and_labels(records.train_files, records.schema, True)[1] \
        if task.name == "regression" or cfg.train.class_weight != "none" else None  # no image is decoded
    scaling = target_scaling(task, train_labels) if task.name == "regression" else None
    weights = class_weights(task, cfg.train.class_weight, train_labels, num_classes) \
        if cfg.train.class_weight != "none" else None
    if weights:
        print("[train] class weights (balanced): " + ", ".join(
            f"{name} {w:.3f}" for name, w in zip(records.class_names, weights, strict=True)), flush=True)

    def to_target(labels):
        return training_target(task, labels, num_classes, scaling)

    train_data = strategy.distribute_datasets_from_function(
        lambda ctx: make_train_dataset(records.train_files, cfg.data, batch, to_target, records.schema,
                                       input_context=ctx, seed=cfg.train.seed))
    with strategy.scope():
        model = build_model(cfg.model, task.outputs(num_classes), cfg.data.image_size, hub_handle=hub_handle,
                            activation=task.activation)
        compile_model(model, cfg.train, task, schedule, weights)
        model.optimizer.build(model.trainable_variables)  # slots exist before restore: nothing is deferred
        checkpoint = EpochCheckpoint(model, work_dir / "checkpoints")
        initial_epoch = checkpoint.restore()
    parts = precision_by_part(model)
    print(f"[train] precision: backbone {parts['backbone']}, head {parts['head']} (policy "
          f"{tf.keras.mixed_precision.global_policy().name}"
          + ("; a TF Hub backbone keeps its SavedModel's dtypes" if cfg.model.backbone == "hub" else "") + ")",
          flush=True)
    if initial_epoch:
        print(f"[train] resuming from the checkpoint after epoch {initial_epoch}", flush=True)

    val_ids, val_labels = read_ids_and_labels(records.val_files, records.schema, True)
    if len(val_ids) != records.val_count:
        raise ConfigError(f"expected {records.val_count} validation records in {len(records.val_files)} files, read "
                          f"{len(val_ids)}: the manifest and the files disagree; convert the data again")

    def predict_val() -> np.ndarray:
        sync_replica_statistics(model, strategy)
        return predict_files(model, records.val_files, records.schema, cfg.data.image_size, batch, records.val_count)

    score = EpochScore(model, predict_val, lambda raw: to_values(raw, scaling), val_labels,
                       to_target(tf.constant(val_labels)).numpy(), task, metric, work_dir, cfg.train.keep == "best",
                       cfg.train.early_stopping, loss_function(task, cfg.train.label_smoothing))
    history_csv = work_dir / "history.csv"
    budget = TimeBudget(deadline, cfg.train.epochs)
    callbacks = [score, checkpoint, budget, tf.keras.callbacks.CSVLogger(str(history_csv), append=initial_epoch > 0)]
    if initial_epoch < cfg.train.epochs:
        if cfg.train.loop == "fit":
            model.fit(train_data, epochs=cfg.train.epochs, initial_epoch=initial_epoch,
                      steps_per_epoch=steps_per_epoch, callbacks=callbacks, verbose=2)
        else:
            CustomLoop(strategy, model, task, cfg.train.label_smoothing, batch, weights).fit(
                train_data, cfg.train.epochs, initial_epoch, steps_per_epoch, cfg.train.steps_per_execution,
                callbacks)
    epochs_done = int(checkpoint.epoch.numpy())
    best_epoch, best_outputs = score.restore_best()
    outputs = predict_val()
    if best_outputs is not None:
        # The restored weights must give what the best epoch gave (float reduction order aside).
        drift = float(np.max(np.abs(outputs - best_outputs)))
        if drift > 1e-3 * max(1.0, float(np.max(np.abs(best_outputs)))):
            raise RuntimeError(f"the restored weights of epoch {best_epoch} predict up to {drift:.2e} away from what "
                               "that epoch predicted: the best-epoch checkpoint did not capture the model")
        print(f"[train] exporting the weights of epoch {best_epoch} (val_{metric} {score.best['value']:.4f}; "
              f"restored, max difference {drift:.1e})", flush=True)
    elif cfg.train.keep == "best":
        print(f"[train] no epoch gave a val_{metric}: exporting the last epoch's weights", flush=True)
    predictions = to_values(outputs, scaling)
    best_epoch = best_epoch or epochs_done
    rates = [(step / steps_per_epoch, float(schedule(step))) for step in range(0, total_steps + 1,
                                                                              max(1, total_steps // 200))]
    return FoldResult(model, history_csv, epochs_done, budget.stopped, best_epoch, metric, scaling, weights, rates,
                      val_ids, val_labels, predictions, budget.seconds)


def to_values(outputs: np.ndarray, scaling: dict | None) -> np.ndarray:
    """Model outputs in the task's value space: regression outputs are standardised during training."""
    return outputs * scaling["std"] + scaling["mean"] if scaling else outputs


# ------------------------------------------------------------------------------------------------------------ export
def inference_copy(model: tf.keras.Model, cfg, outputs: int, hub_handle: str | None,
                   policy: str = "float32") -> tf.keras.Model:
    """The same architecture built under `policy` (float32: what a T4, which has no bfloat16, runs; mixed_float16:
    for tensor cores), outside any strategy scope, holding the trained weights. Mixed-precision variables are float32
    already, so the weights copy as they are."""
    trained_policy = tf.keras.mixed_precision.global_policy().name
    tf.keras.mixed_precision.set_global_policy(policy)
    try:
        copy = build_model(cfg.model, outputs, cfg.data.image_size, hub_handle=hub_handle,
                           activation=get_task(cfg.data.task).activation)
    finally:
        tf.keras.mixed_precision.set_global_policy(trained_policy)
    copy.set_weights(model.get_weights())
    return copy


def float16_copy(model: tf.keras.Model, cfg, outputs: int, hub_handle: str | None, card: dict):
    """The mixed_float16 copy for the serving_float16 signature, if its graph really computes in float16 (op census):
    a TF Hub backbone stays float32, and a signature that only rounds the head would double the export for nothing.
    The reason either way goes into the card."""
    copy = inference_copy(model, cfg, outputs, hub_handle, "mixed_float16")
    share = float16_share(traced_census(copy, cfg.data.image_size))
    real = share >= FLOAT16_MIN_SHARE
    card["precision"]["float16_signature"] = (
        f"exported: its graph runs {share:.0%} of the compute ops in float16" if real else
        f"not exported: its graph would run {share:.0%} of the compute ops in float16 (the backbone computes in "
        f"{precision_by_part(copy)['backbone']}). On a tensor-core GPU, infer.precision=amp lets TensorFlow's "
        "automatic mixed precision rewrite the float32 graph")
    print(f"[train] float16 signature {card['precision']['float16_signature']}", flush=True)
    return copy if real else None


def write_oof(path: Path, task: Task, class_names, ids, labels, predictions) -> None:
    """id, label (as the CSVs write it), then one column per model output (p_<class>, p_1, p_value)."""
    with Path(path).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label", *(f"p_{n}" for n in output_names(task, class_names))])
        for i, label, p in zip(ids, labels, predictions, strict=True):
            writer.writerow([i, label_text(task, label, class_names), *(f"{v:.6f}" for v in p)])


def read_oof(path: Path, task: Task, class_names) -> tuple[list[str], list, list[list[float]]]:
    columns = [f"p_{n}" for n in output_names(task, class_names)]
    ids, labels, predictions = [], [], []
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            ids.append(row["id"])
            labels.append(parse_label_text(task, row["label"], class_names))
            predictions.append([float(row[c]) for c in columns])
    return ids, labels, predictions


def _fold_outputs(work: Path, task: Task, result: FoldResult, records: RecordSet, confusion) -> dict[str, Path]:
    """oof.csv and the plots (history with the learning-rate schedule; the confusion matrix for single-label tasks,
    the ROC curve for binary, predicted against true for regression), to travel inside the export."""
    write_oof(work / "oof.csv", task, records.class_names, result.val_ids, result.val_labels, result.val_predictions)
    plot_history(result.history_csv, work / "history.png", result.learning_rates)
    if confusion is not None:
        plot_confusion(confusion, records.class_names, work / "confusion.png")
    if task.name == "binary" and len(set(np.asarray(result.val_labels).tolist())) == 2:
        plot_roc(result.val_labels, result.val_predictions, work / "roc.png")
    if task.name == "regression":
        plot_predicted_vs_true(result.val_labels, result.val_predictions, work / "predicted_vs_true.png")
    names = ("history.csv", "history.png", "confusion.png", "roc.png", "predicted_vs_true.png", "oof.csv")
    return {name: work / name for name in names}


def _golden_batch(records: RecordSet, image_size: int, n: int = 4) -> np.ndarray:
    """A few validation images: the export must reproduce its predictions for them wherever it is loaded."""
    dataset = make_eval_dataset(records.val_files, records.schema, image_size, n, labeled=False)
    return next(iter(dataset))["image"].numpy()


def _class_scores(task: Task, labels, predictions, class_names) -> dict | None:
    """Per-class report and confusion matrix for single-label tasks (binary as two classes at 0.5)."""
    if task.name == "multiclass":
        return classification_scores(labels, predictions, class_names)
    if task.name == "binary":
        return classification_scores(labels, np.concatenate([1 - predictions, predictions], axis=1), class_names)
    return None


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def export_fold(cfg, result: FoldResult, records: RecordSet, fold: int, export_dir: Path, hub_handle: str | None,
                trained_policy: str) -> dict:
    """Score the fold, then write its verified export (float32, plus float16 if configured). Returns the card."""
    task = get_task(cfg.data.task)
    labels, predictions = result.val_labels, result.val_predictions
    thresholds = choose_thresholds(task, labels, predictions)  # on this model's own out-of-fold predictions
    report = metric_report(task, labels, predictions, thresholds)
    classes = _class_scores(task, labels, predictions, records.class_names)
    print(f"[train] fold {fold}: validation {result.metric} {_shown(report[result.metric])} (epoch "
          f"{result.best_epoch} of {result.epochs_done}); " + ", ".join(
              f"{k} {_shown(v)}" for k, v in report.items() if k != result.metric), flush=True)
    size, outputs = cfg.data.image_size, task.outputs(len(records.class_names))
    card = {
        "fold": fold, "task": task.name, "class_names": records.class_names, "label_type": records.label_type,
        "image_size": size, "record_schema": asdict(records.schema), "source_images": records.source_images,
        "input": {"signature": "serving_default", "name": "images", "dtype": "uint8", "shape": [None, size, size, 3],
                  "channels": "RGB", "range": [0, 255]},
        "output": {"name": "predictions", "kind": task.kind, "dtype": "float32", "shape": [None, outputs],
                   "names": output_names(task, records.class_names)},
        "metric": {"name": result.metric, "value": report[result.metric]},
        "thresholds": thresholds,  # multilabel: per label, chosen on this fold's validation predictions
        "target_scaling": result.scaling,  # regression: undone inside the export, which predicts the value
        "class_weights": result.class_weights,
        "precision": {"trained": {"policy": trained_policy, **precision_by_part(result.model)}},
        # A fold the budget cut exports its best epoch (train.keep=best); inference weighs it by infer.cut_folds.
        "time_budget": cut_record(result.stopped_by_budget, result.epochs_done, cfg.train.epochs, result.best_epoch,
                                  cfg.train.time_budget_hours),
        "metrics": {**report, "count": int(len(labels)), "epochs": result.epochs_done, "best_epoch": result.best_epoch,
                    "keep": cfg.train.keep, "ema": cfg.train.ema,
                    **({"per_class": classes["per_class"], "confusion_matrix": classes["confusion_matrix"]}
                       if classes else {})},
        "config": config_to_dict(cfg),
    }
    card["precision"]["float16_signature"] = "not exported: train.export_float16=false"
    float16 = float16_copy(result.model, cfg, outputs, hub_handle, card) if cfg.train.export_float16 else None
    extra = _fold_outputs(Path(result.history_csv).parent, task, result, records,
                          classes["confusion_matrix"] if classes else None)
    card = write_export(export_dir, inference_copy(result.model, cfg, outputs, hub_handle), card,
                        _golden_batch(records, size), extra, float16_model=float16, output_scaling=result.scaling)
    print(f"[train] fold {fold}: export verified and complete in {export_dir}", flush=True)
    return card


def out_of_fold_scores(export_root: Path, folds) -> dict | None:
    """Scores of every exported fold's validation predictions together (the out-of-fold estimate)."""
    ids, labels, predictions, card = [], [], [], None
    for fold in folds:
        card = read_card(export_root / fold)
        task = get_task(card.get("task", "multiclass"))
        fold_ids, fold_labels, fold_predictions = read_oof(export_root / fold / "oof.csv", task, card["class_names"])
        ids += fold_ids
        labels += fold_labels
        predictions += fold_predictions
    if not ids:
        return None
    labels, predictions = np.array(labels), np.array(predictions)
    thresholds = choose_thresholds(task, labels, predictions)
    report = metric_report(task, labels, predictions, thresholds)
    classes = _class_scores(task, labels, predictions, card["class_names"])
    metric = card["metric"]["name"]
    print(f"[train] out-of-fold over {len(folds)} fold(s), {len(ids)} records: {metric} {_shown(report[metric])}",
          flush=True)
    return {"folds": list(folds), "unique_ids": len(set(ids)), "count": len(ids), "metric": metric,
            "thresholds": thresholds, **report, **({"per_class": classes["per_class"],
                                                     "confusion_matrix": classes["confusion_matrix"]}
                                                    if classes else {})}
