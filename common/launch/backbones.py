"""The backbone families (model.backbone), each registered once: which routes train it and with what builder, the
model names it knows, how logs and cards name it, how the build checks that Kaggle can reach it, and the small network
the offline demo trains in its place.

    family = BACKBONES[cfg.model.backbone]
    family.builders["tf_keras"]          # "module:function" building it under that route's framework
    family.label(cfg.model)              # "EfficientNet B0", "timm mobilenetv3_small_050"
    family.check(cfg.model, route_name)  # a mistyped model name: a ConfigError naming the known ones

A family added here is a model.backbone choice at once, trained by the routes its builders name; the routes' table
(common/launch/routes.py) reads which families each trains from here. Standard library at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.core.errors import ConfigError
from common.core.fields import supply_choices

# The timm architectures keras-hub's timm converters (0.29-0.32) rebuild under TensorFlow for the export, a native
# TensorFlow graph with a float16 signature (keras_hub/src/utils/timm/convert_*.py, by exact name; their output is
# forward_features'). Any other timm architecture is lowered through JAX (torchax, jax2tf) for the export instead.
KERAS_HUB_REBUILDS = (
    *(f"efficientnet_b{k}" for k in range(6)),
    "efficientnet_lite0",
    *(f"resnet{depth}" for depth in (18, 26, 34, 50, 101, 152)),
    "mobilenetv3_small_050",
    "mobilenetv3_small_100",
    "mobilenetv3_large_100",
)
# Lowered through JAX, a family each, trained and exported by the suite (tests/test_timm_export.py) and named where an
# architecture is refused before training (torch_shared/capture.py).
LOWERED_CHECKED = {"ConvNeXt": "convnext_atto", "EfficientNetV2": "tf_efficientnetv2_b0", "ViT": "vit_tiny_patch16_224"}
# EfficientNet variants: the efficientnet package's (tf_keras) and keras.applications' (keras_jax).
EFFICIENTNET_VARIANTS = {
    "tf_keras": tuple(f"B{k}" for k in range(8)),
    "keras_jax": (*(f"B{k}" for k in range(8)), *(f"V2{v}" for v in ("B0", "B1", "B2", "B3", "S", "M", "L"))),
}
# Named weights of the EfficientNet builders; any other value is a weights file's path.
EFFICIENTNET_WEIGHTS = {"tf_keras": ("none", "imagenet", "noisy-student"), "keras_jax": ("none", "imagenet")}


def last_part(path: str) -> str:
    """A path's or handle's last part; a Kaggle Models handle's variation, not its version number."""
    parts = [part for part in path.split("/") if part]
    return parts[-2] if len(parts) > 1 and parts[-1].isdigit() else (parts[-1] if parts else path)


def check_nothing(model_cfg, route: str) -> None:
    """A family named by a path or handle: what it names is checked where it is loaded, and at build for Kaggle."""


def check_efficientnet(model_cfg, route: str) -> None:
    check_efficientnet_names(model_cfg.efficientnet_variant, model_cfg.efficientnet_weights, route)


def check_efficientnet_names(variant: str, weights: str, route: str) -> None:
    """An EfficientNet variant and named weights the route's builder has (a weights file is checked when loaded)."""
    variants = EFFICIENTNET_VARIANTS[route]
    if variant.upper() not in variants:
        raise ConfigError(
            f"model.efficientnet_variant={variant!r} is not an EfficientNet that train.framework={route} builds: "
            f"{', '.join(variants)}"
        )
    known = EFFICIENTNET_WEIGHTS[route]
    named = weights.lower() in {w for names in EFFICIENTNET_WEIGHTS.values() for w in names} or not weights
    if named and (weights.lower() or "none") not in known:
        raise ConfigError(
            f"model.efficientnet_weights={weights!r} is not one that train.framework={route} loads: "
            f"{', '.join(known)} or a weights file's path"
        )


def check_timm(model_cfg, route: str) -> None:
    """An architecture timm knows, where timm is installed (a folder's name is read from its config.json when
    loaded): a mistyped name is one line with the nearest names, not a download that fails on Kaggle."""
    import difflib
    import importlib.util

    name = model_cfg.timm_model
    if "/" in name or importlib.util.find_spec("timm") is None:
        return
    import timm

    known = timm.list_models()
    if name not in known:
        near = difflib.get_close_matches(name, known, n=5)
        raise ConfigError(
            f"model.timm_model={name!r} is not a timm architecture"
            + (f" (the nearest: {', '.join(near)})" if near else "")
            + ". Fix: a name timm.list_models() gives, or a folder holding one (config.json + model.safetensors)"
        )


@dataclass(frozen=True)
class DemoNetwork:
    """The small network the offline demo saves and trains in a family's place (nothing can be downloaded there)."""

    kind: str  # how the demo's log names it
    file: str  # its name in the demo's folder
    key: str  # the config key that takes its path
    save: str  # "module:function" saving it: save(path) -> path


@dataclass(frozen=True)
class Backbone:
    """A model.backbone family."""

    name: str
    builders: dict[str, str]  # route -> "module:function" building it under that route's framework
    label: Callable[[object], str]  # label(model_cfg): the backbone as logs and cards name it
    reachable: str  # "module:function" (cfg) -> problems: what the training kernel could not reach on Kaggle
    demo: DemoNetwork | None  # the demo's stand-in, where a route's demo trains this family
    check: Callable[[object, str], None] = check_nothing  # check(model_cfg, route): its model name is known there
    keeps_dtypes: bool = False  # a loaded SavedModel keeps its own variables' dtypes whatever the precision policy


BACKBONES = {
    family.name: family
    for family in (
        Backbone(
            "hub",
            {"tf_keras": "common.training.backends.tf_keras.model:hub_features"},
            lambda m: f"TF Hub {last_part(m.hub_handle)}",
            "tpu2gpu.reachability:hub_problems",
            DemoNetwork(
                "SavedModel (TF Hub contract)", "backbone", "model.hub_handle", "tpu2gpu.backbones:save_tiny_backbone"
            ),
            keeps_dtypes=True,  # tensorflow/hub #790
        ),
        Backbone(
            "efficientnet",
            {
                "tf_keras": "common.training.backends.tf_keras.model:efficientnet_features",
                "keras_jax": "common.training.backends.keras_jax.model:efficientnet_features",
            },
            lambda m: f"EfficientNet {m.efficientnet_variant}",
            "tpu2gpu.reachability:efficientnet_problems",
            None,
            check=check_efficientnet,
        ),
        Backbone(
            "keras",
            {"keras_jax": "common.training.backends.keras_jax.model:file_features"},
            lambda m: f"Keras backbone {last_part(m.keras_backbone)}",
            "tpu2gpu.reachability:keras_problems",
            DemoNetwork(
                ".keras file (Keras 3)",
                "backbone.keras",
                "model.keras_backbone",
                "tpu2gpu.backbones:save_tiny_keras_backbone",
            ),
        ),
        Backbone(
            "timm",
            {
                "torch_xla": "common.training.backends.torch_shared.model:create_backbone",
                "torch": "common.training.backends.torch_shared.model:create_backbone",
            },
            lambda m: f"timm {last_part(m.timm_model)}",
            "tpu2gpu.reachability:timm_problems",
            DemoNetwork(
                "timm mobilenetv3_small_050 (save_for_hf folder)",
                "timm_backbone",
                "model.timm_model",
                "tpu2gpu.backbones:save_tiny_timm_backbone",
            ),
            check=check_timm,
        ),
    )
}


def backbone_choices() -> tuple[str, ...]:
    """model.backbone's values (read at each check: a family added at run time is a choice)."""
    return tuple(BACKBONES)


def trained_by(route: str) -> tuple[str, ...]:
    """The families a route trains."""
    return tuple(name for name, family in BACKBONES.items() if route in family.builders)


def resolve(target: str):
    """The function a "module:function" names, imported now."""
    import importlib

    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


supply_choices("model.backbone", backbone_choices)
