"""float16's loss scaling on the Keras routes, as each backend builds its model and optimiser for
train.precision=mixed_float16 (a T4's precision), on the CPU: the optimiser is the framework's LossScaleOptimizer, a
step whose scaled gradients overflow float16 changes no trainable weight and halves the scale, and the next steps
train. tf_keras counts the skipped step as an optimiser iteration (its schedule moves on), Keras 3 does not. The
torch route's GradScaler: tests/test_plain_torch.py."""

from common.core.config import load_config
from common.tasks.types import TASKS
from common.training.plan import plan_fold

import numpy as np
import pytest

from builders import says

pytestmark = pytest.mark.e2e  # each builds and trains a model (seconds), not a unit's decision


class Records:  # what plan_fold reads of a fold's records
    train_count, class_names = 64, ["a", "b", "c"]


IMAGES = np.random.default_rng(0).integers(0, 255, (4, 16, 16, 3), dtype=np.uint8)
TARGETS = TASKS["multiclass"].target(np.array([0, 1, 2, 0]), 3, None).numpy()


def weights_of(model) -> list[np.ndarray]:
    """The trainable weights (a skipped step still moves batch norm's statistics, as a forward pass does)."""
    return [np.array(w) for w in model.trainable_weights]


def test_tf_keras_under_mixed_float16_skips_the_step_whose_gradients_overflow(tiny_backbone):
    from common.training.backends.tf_keras.backend import TFBackend

    import tensorflow as tf

    cfg = load_config(
        None,
        [
            f"model.hub_handle={tiny_backbone}",
            "data.image_size=16",
            "train.epochs=2",
            "train.precision=mixed_float16",
            "train.steps_per_execution=1",
        ],
    )
    backend = TFBackend(cfg, tf.distribute.get_strategy(), hub_handle=str(tiny_backbone))
    tf.keras.mixed_precision.set_global_policy("mixed_float16")  # what the route's start sets on a GPU
    try:
        backend.build(plan_fold(cfg, Records, backend.replicas))
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    model, optimizer = backend.model, backend.model.optimizer
    assert isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
    from common.training.fold import describe_precision

    says(
        describe_precision(backend, cfg),
        "backbone float32",
        "head float16",
        "mixed_float16",
        "TF Hub",
        "float32 speed",
        "model.backbone=efficientnet",
        "train.framework=keras_jax",
        "torch",
    )
    optimizer._loss_scale.current_loss_scale.assign(1e30)  # every float16 gradient of the head now overflows
    before = weights_of(model)
    model.train_on_batch(IMAGES, TARGETS)
    # tf_keras counts the skipped step as an iteration (the schedule moves on), and applies nothing.
    assert backend.optimizer_steps() == 1 and float(optimizer.loss_scale) == pytest.approx(5e29, rel=1e-6)
    assert all(np.array_equal(a, b) for a, b in zip(before, weights_of(model), strict=True))
    optimizer._loss_scale.current_loss_scale.assign(2.0**15)
    model.train_on_batch(IMAGES, TARGETS)
    assert backend.optimizer_steps() == 2
    assert not all(np.array_equal(a, b) for a, b in zip(before, weights_of(model), strict=True))
    backend.release()


def test_keras_jax_under_mixed_float16_skips_the_step_whose_gradients_overflow(tiny_keras_backbone):
    from common.training.backends.keras_jax.backend import JaxBackend

    import keras

    cfg = load_config(
        None,
        [
            "train.framework=keras_jax",
            "model.backbone=keras",
            f"model.keras_backbone={tiny_keras_backbone}",
            "data.image_size=16",
            "train.epochs=2",
            "train.precision=mixed_float16",
        ],
    )
    backend = JaxBackend(cfg)
    backend.build(plan_fold(cfg, Records, backend.replicas))
    model, optimizer = backend.model, backend.model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert backend.precision() == {"policy": "mixed_float16", "backbone": "float32", "head": "float16"}  # a loaded file
    optimizer.dynamic_scale.assign(1e30)  # beyond float16: the scaled loss and every gradient overflow
    before = weights_of(model)
    model.train_on_batch(IMAGES, TARGETS)
    # Keras 3 counts applied steps only: the skipped one is not an iteration (the schedule waits for it).
    assert backend.optimizer_steps() == 0 and float(optimizer.dynamic_scale.numpy()) == pytest.approx(5e29, rel=1e-6)
    assert all(np.array_equal(a, b) for a, b in zip(before, weights_of(model), strict=True))
    optimizer.dynamic_scale.assign(2.0**15)
    for _ in range(2):  # the warm-up's first rate is 0
        model.train_on_batch(IMAGES, TARGETS)
    assert backend.optimizer_steps() == 2
    assert not all(np.array_equal(a, b) for a, b in zip(before, weights_of(model), strict=True))
