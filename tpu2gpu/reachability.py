"""What the training kernel loads but could not reach on Kaggle, checked at build time (`tpu2gpu build` refuses it):
the backbone (a TF Hub handle, a weights file, a Keras 3 backbone), the training data, the TPU stack's install
route, and a PyTorch route named for the other accelerator. Each problem names its config key and the fix.
"""

from __future__ import annotations

from pathlib import Path

from common.core.config import Config
from common.launch.backbones import BACKBONES, resolve
from common.launch.negotiation import parse_candidates
from common.launch.routes import ROUTES, route_names, route_of
from common.launch.tpu_stack import TpuStackError

TPU_SHAPES = ("TpuV38", "Tpu1VmV38", "TpuV5E8", "TpuV6E8")
KAGGLE_MODELS_URL = "https://www.kaggle.com/models/"


def _attached_as_dataset(cfg: Config, name: str) -> bool:
    refs = [source.split("/") for source in cfg.kaggle.dataset_sources]
    return any(name.strip("/") in ("/".join(ref[:2]), ref[1]) for ref in refs if len(ref) >= 2)


def keras_problems(cfg: Config) -> list[str]:
    """model.keras_backbone: a .keras file in an attached dataset, or an attached Kaggle Model (a KerasHub preset)."""
    k, path = cfg.kaggle, cfg.model.keras_backbone
    attached_model = path.strip("/").lower() in [m.lower() for m in k.model_sources]
    if path.startswith("/kaggle/input/") or attached_model:
        return []
    return [
        f"model.keras_backbone={path!r} is not in an attached input. Fix: a /kaggle/input/... path in a dataset "
        "of kaggle.dataset_sources (a .keras file), or the handle of a Kaggle Model listed in "
        "kaggle.model_sources (a KerasHub preset, owner/model/keras/variation/version)"
    ]


def hub_problems(cfg: Config) -> list[str]:
    """model.hub_handle: a TF Hub / Kaggle Models handle the kernel must reach offline or download."""
    k = cfg.kaggle
    handle = cfg.model.hub_handle
    bare = handle[len(KAGGLE_MODELS_URL) :] if handle.startswith(KAGGLE_MODELS_URL) else handle
    is_models_handle = "://" not in bare and len(bare.strip("/").split("/")) == 5
    listed = [m.lower() for m in k.model_sources]
    if handle.startswith("/kaggle/input/"):
        return []  # a path in an input the user attached
    if is_models_handle and not Path(handle).exists():
        if bare.strip("/").lower() not in listed and not k.train_internet:
            return [
                f"model.hub_handle={handle!r} is not in kaggle.model_sources {list(k.model_sources)} and "
                f"kaggle.train_internet is false, so the kernel could not load it. Fix: add {bare.strip('/')!r} "
                "to kaggle.model_sources (or set kaggle.train_internet=true)"
            ]
        return []
    if "://" in handle:
        if not k.train_internet:
            return [
                f"model.hub_handle={handle!r} is downloaded at run time, but kaggle.train_internet is false. Fix: "
                "use the model's Kaggle Models handle (owner/model/framework/variation/version) and list it in "
                "kaggle.model_sources, or set kaggle.train_internet=true"
            ]
        return []
    return [
        f"model.hub_handle={handle!r} is a local path, which does not exist on Kaggle. Fix: a Kaggle Models "
        "handle listed in kaggle.model_sources, e.g. "
        "google/efficientnet-v2/tensorflow2/imagenet21k-b0-feature-vector/1"
    ]


def timm_problems(cfg: Config) -> list[str]:
    """model.timm_model: a folder in an attached input, or a name whose pretrained weights timm downloads."""
    model, internet = cfg.model, cfg.kaggle.train_internet
    name = model.timm_model
    if "/" in name:
        if name.startswith("/kaggle/input/"):
            return []
        return [
            f"model.timm_model={name!r} is a local folder, which does not exist on Kaggle. Fix: put it "
            "(config.json + model.safetensors) in a dataset listed in kaggle.dataset_sources and give its "
            "/kaggle/input/... path"
        ]
    if model.timm_weights == "pretrained" and not internet:
        return [
            f"model.timm_model={name!r} with model.timm_weights=pretrained is downloaded at run time, but "
            "kaggle.train_internet is false. Fix: set kaggle.train_internet=true, or save the model with "
            "timm.models.save_for_hf into a dataset listed in kaggle.dataset_sources and give its "
            "/kaggle/input/... path"
        ]
    return []


def efficientnet_problems(cfg: Config) -> list[str]:
    """model.efficientnet_weights: downloaded (needs the internet), none, or a file in an attached input."""
    weights, internet = cfg.model.efficientnet_weights, cfg.kaggle.train_internet
    if weights in ("imagenet", "noisy-student"):
        if not internet:
            return [
                f"model.efficientnet_weights={weights!r} is downloaded at run time, but kaggle.train_internet is "
                "false. Fix: set kaggle.train_internet=true, or put the weights file in a dataset listed in "
                "kaggle.dataset_sources and give its /kaggle/input/... path"
            ]
        return []
    if weights != "none" and not weights.startswith("/kaggle/input/"):
        return [
            f"model.efficientnet_weights={weights!r} is a local file, which does not exist on Kaggle. Fix: a "
            "/kaggle/input/... path in a dataset listed in kaggle.dataset_sources"
        ]
    return []


def _data_problems(cfg: Config) -> list[str]:
    """The training data: the competition's, or TFRecords / a competition folder in an attached input."""
    k = cfg.kaggle
    key, data = (
        ("runtime.tfrecords", cfg.runtime.tfrecords)
        if cfg.runtime.tfrecords
        else ("runtime.competition_dir", k.competition or cfg.runtime.competition_dir)
    )
    if not data:
        return [
            "no training data: set kaggle.competition (the competition's data), runtime.tfrecords or "
            "runtime.competition_dir to an input attached to the training kernel"
        ]
    if not (data.startswith(("gs://", "/kaggle/input/")) or data == k.competition or _attached_as_dataset(cfg, data)):
        return [
            f"{key}={data!r} is not attached to the training kernel. Fix: name the competition "
            "(kaggle.competition) or a dataset listed in kaggle.dataset_sources (owner/slug or slug)"
        ]
    return []


def _tpu_stack_problems(cfg: Config) -> list[str]:
    """A TPU kernel that installs the TPU stack: valid pins, and wheels or the internet to install them from, unless
    it trains with Keras 3 on JAX (asked for, or what train.framework=auto falls back to for a Keras 3 backbone) or
    PyTorch/XLA (the image ships torch_xla)."""
    k = cfg.kaggle
    route = route_of(cfg)
    if k.train_accelerator not in TPU_SHAPES or k.tpu_runtime != "install" or not route.tpu_stack:
        return []
    problems = []
    try:
        parse_candidates(k.tpu_packages)
    except TpuStackError as err:
        problems.append(str(err))
    fallback = ROUTES.get(route.fallback)
    if not (k.tpu_wheels or k.train_internet or (fallback and cfg.model.backbone in fallback.backbones)):
        problems.append(
            "the training kernel runs on a TPU (kaggle.train_accelerator=" + k.train_accelerator + "), whose Kaggle "
            "image has no TPU build of TensorFlow, and has no way to install one. Fix: attach the TPU stack's wheels "
            "(`tpu2gpu wheels`, `tpu2gpu publish-wheels`, then kaggle.tpu_wheels=<its slug>) or set "
            "kaggle.train_internet=true; if the image already has a TPU build, kaggle.tpu_runtime=image"
        )
    return problems


def _accelerator_problems(cfg: Config) -> list[str]:
    """A route named for an accelerator it does not train on: torch_xla has no CUDA devices, and the torch route on a
    TPU VM would train on its CPU. (train.framework=auto picks by the hardware the kernel finds.)"""
    route, shape = route_of(cfg), cfg.kaggle.train_accelerator
    accelerator = "tpu" if shape in TPU_SHAPES else "gpu"
    if cfg.train.framework == "auto" or accelerator in route.accelerators:
        return []
    takers = route_names(lambda other: accelerator in other.accelerators and cfg.model.backbone in other.backbones)
    return [
        f"train.framework={route.name} on kaggle.train_accelerator={shape}: it trains on "
        f"{' and '.join(a.upper() for a in route.accelerators)}, not this {accelerator.upper()}. Fix: "
        f"train.framework={' or '.join([*takers, 'auto'])}, or another kaggle.train_accelerator"
    ]


def unreachable(cfg: Config) -> list[str]:
    """What the training kernel loads but could not reach on Kaggle, each with its config key and fix."""
    backbone = resolve(BACKBONES[cfg.model.backbone].reachable)(cfg)
    return backbone + _data_problems(cfg) + _tpu_stack_problems(cfg) + _accelerator_problems(cfg)
