import threading
import time
import weakref

from common.core.config import load_config
from common.core.errors import ConfigError
from common.core.strategy import get_strategy
from common.data.pipeline import InputShare, make_train_dataset
from common.data.records import split_files
from common.tasks.types import TASKS
from common.training.backends.tf_keras.model import build_model, compile_model

import numpy as np
import pytest
import tensorflow as tf


def _batches(demo_records, image_size, batch=32, n=1):
    out, manifest = demo_records
    train_files, _ = split_files(manifest, str(out), fold=0)
    data_cfg = load_config(None, [f"data.image_size={image_size}", "data.augment=false"]).data
    one_hot = lambda labels: TASKS["multiclass"].target(labels, 10, None)  # noqa: E731
    return list(make_train_dataset(train_files, data_cfg, InputShare(batch), one_hot, seed=0).take(n))


@pytest.mark.e2e
def test_hub_backbone_fine_tunes_and_the_loss_falls(demo_records, tiny_backbone):
    cfg = load_config(None, [f"model.hub_handle={tiny_backbone}", "model.dropout=0", "train.steps_per_execution=1"])
    tf.keras.utils.set_random_seed(0)
    model = build_model(cfg.model, 10, 16)
    backbone = model.get_layer("backbone")
    assert type(backbone).__module__.startswith("tensorflow_hub")  # the hub.KerasLayer path, as on Kaggle
    assert backbone.trainable and len(backbone.trainable_weights) == 9  # 3 conv kernels + BN scales and offsets
    assert model.input.dtype == tf.uint8 and model.output.dtype == tf.float32
    compile_model(model, cfg.train, TASKS["multiclass"], 1e-2)
    images, labels = _batches(demo_records, 16)[0]
    before = [w.numpy().copy() for w in backbone.trainable_weights]
    losses = [model.train_on_batch(images, labels)[0] for _ in range(30)]
    assert losses[-1] < 0.6 * losses[0], losses  # memorises one batch (measured: 2.30 -> 0.97)
    assert all(not np.allclose(b, a.numpy()) for b, a in zip(before, backbone.trainable_weights, strict=True))


@pytest.mark.e2e
@pytest.mark.slow
def test_efficientnet_package_builds_b0_and_trains_a_step(demo_records):
    """Opt-in (-m slow): the default suite builds and trains B0 through the training kernel (the efficientnet_export
    fixture of tests/test_inference.py), whose saved graph's op census (65 Conv2D, 16 depthwise) pins the
    architecture."""
    cfg = load_config(
        None, ["model.backbone=efficientnet", "model.efficientnet_weights=none", "train.steps_per_execution=1"]
    )
    model = build_model(cfg.model, 10, 32)
    assert any(layer.name == "efficientnet-b0" for layer in model.layers)
    assert 4_000_000 < model.count_params() < 4_100_000  # B0 without top: 4.05 M + head
    compile_model(model, cfg.train, TASKS["multiclass"], 1e-3)
    images, labels = _batches(demo_records, 32, batch=8)[0]
    before = [w.numpy().copy() for w in model.trainable_weights]
    loss, _ = model.train_on_batch(images, labels)
    assert np.isfinite(loss) and loss > 0
    moved = sum(not np.allclose(b, a.numpy()) for b, a in zip(before, model.trainable_weights, strict=True))
    assert moved > 0.9 * len(before), (moved, len(before))  # the step reached the backbone, not only the head


def test_missing_or_offline_hub_handles_are_clear_errors():
    for handle in ("/no/such/saved_model", "https://tfhub.dev/google/efficientnet/b0/feature-vector/1"):
        cfg = load_config(None, [f"model.hub_handle={handle}"])
        with pytest.raises(ConfigError) as err:
            build_model(cfg.model, 10, 32)
        assert f"model.hub_handle={handle!r} could not be loaded" in str(err.value)
        assert "model_sources" in str(err.value)
    with pytest.raises(ConfigError, match="model.efficientnet_weights='/nope.h5'"):
        build_model(
            load_config(None, ["model.backbone=efficientnet", "model.efficientnet_weights=/nope.h5"]).model, 10, 32
        )


@pytest.mark.e2e  # two full-size EfficientNets built
def test_an_efficientnet_weights_file_of_another_variant_is_one_line_naming_the_fix(tmp_path):
    """The efficientnet package's B1 weights given to a B0: the line names the variant and the fix, not a traceback
    from h5py or tf_keras."""
    import efficientnet.tfkeras as efn

    b1 = tmp_path / "efficientnet-b1_notop.h5"
    efn.EfficientNetB1(include_top=False, weights=None, input_shape=(32, 32, 3)).save_weights(b1)
    cfg = load_config(None, ["model.backbone=efficientnet", f"model.efficientnet_weights={b1}"])
    with pytest.raises(
        ConfigError,
        match=rf"model.efficientnet_weights='{b1}' does not fit EfficientNetB0 \(.+\)\. "
        r"Fix: the efficientnet package's weights file of B0, or "
        r"model.efficientnet_variant set to the file's variant",
    ):
        build_model(cfg.model, 10, 32)


def test_mixed_precision_keeps_float32_probabilities(tiny_backbone):
    cfg = load_config(None, [f"model.hub_handle={tiny_backbone}"])
    tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = build_model(cfg.model, 10, 16)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    assert model.get_layer("head_logits").compute_dtype == "bfloat16"
    assert model.output.dtype == tf.float32


@pytest.mark.e2e
def test_both_loops_train_under_mirrored_strategy(demo_records, tiny_backbone, tmp_path):
    """fit and the custom loop, each for a few steps on two replicas, through train_fold."""
    import time

    from common.data.records import record_set
    from common.training.backends.tf_keras.backend import TFBackend
    from common.training.fold import train_fold

    records_dir, _ = demo_records
    strategy = get_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2
    for loop in ("fit", "custom"):
        cfg = load_config(
            None,
            [
                f"model.hub_handle={tiny_backbone}",
                "data.image_size=16",
                "train.epochs=3",
                "train.steps_per_epoch=6",
                "train.steps_per_execution=3",
                f"train.loop={loop}",
                "train.batch_size_per_replica=16",
                "train.learning_rate=0.1",
                "train.warmup_epochs=0",
            ],
        )
        records = record_set(str(records_dir), cfg.data, 0)
        result = train_fold(
            cfg, TFBackend(cfg, strategy, str(tiny_backbone)), records, tmp_path / loop, deadline=time.monotonic() + 600
        )
        history = np.genfromtxt(result.history_csv, delimiter=",", names=True)
        assert result.epochs_done == 3 and len(history) == 3
        assert history["loss"][-1] < history["loss"][0], (loop, history["loss"])
        assert result.validation.predictions.shape == (288, 10) and len(set(result.validation.ids)) == 288
        np.testing.assert_allclose(result.validation.predictions.sum(axis=1), 1.0, rtol=1e-5)  # softmax rows


@pytest.mark.e2e
def test_each_validation_pass_is_keras_predict_in_record_order_on_two_replicas(demo_records, tiny_backbone):
    """The tf_keras backend scores the validation set every epoch through one repeated distributed iterator
    (RepeatedPasses) instead of Keras' predict: each pass gives what Keras' predict gives for the same padded
    batches, row for row, the last batch's padding dropped; a new model starts a new iterator."""
    from common.data.pipeline import make_padded_image_batches
    from common.data.records import record_set
    from common.training.backends.tf_keras.backend import TFBackend
    from common.training.plan import plan_fold

    records_dir, _ = demo_records
    strategy = get_strategy("mirrored")
    cfg = load_config(
        None, [f"model.hub_handle={tiny_backbone}", "data.image_size=16", "train.batch_size_per_replica=20"]
    )  # 288 records in batches of 40: 8, the last padded
    records = record_set(str(records_dir), cfg.data, 0)
    backend = TFBackend(cfg, strategy, str(tiny_backbone))
    passes = []
    for _ in range(2):  # a model, then the next fold's
        backend.build(plan_fold(cfg, records, strategy.num_replicas_in_sync))
        keras = backend.model.predict(
            make_padded_image_batches(records.val_files, records.schema, 16, 40), steps=8, verbose=0
        )[:288]
        for _ in range(3):
            outputs = backend.predict(records.val_files, records.schema, records.val_count)
            assert outputs.shape == (288, 10)
            np.testing.assert_allclose(outputs, keras, rtol=0, atol=1e-6)
        passes.append(backend._passes)
    assert passes[0] is not passes[1] and passes[1].model is backend.model
    # Each iterator is let go on a thread of its own, the first by the next fold's build, the last by release: taking
    # one down can wait up to 60 s on TensorFlow (common/training/backends/tf_keras/iterators.py).
    dropped_on, iterator = [], passes[1].iterator
    weakref.finalize(iterator, lambda: dropped_on.append(threading.current_thread().name))
    del iterator
    assert passes[0].iterator is None and dropped_on == []
    backend.release()
    deadline = time.monotonic() + 90
    while not dropped_on and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped_on == ["tpu2gpu-let-go"] and backend._passes is None and passes[1].iterator is None
