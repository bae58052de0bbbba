"""Both PyTorch routes' model: a timm backbone's features, pooled, and the template's head.

    model = build_timm_model(cfg.model, outputs, activation)   # uint8 [B, S, S, 3] -> float32 [B, outputs]
    architecture, folder = timm_source(cfg.model)              # e.g. ("efficientnet_b0", None)

The preprocessing (uint8 to the model's own mean and std, from timm's pretrained_cfg) and the head (dropout, a linear
layer of the task's width, the task's activation in float32) are part of the model, as on the other routes. For the
architectures keras-hub rebuilds (KERAS_HUB_REBUILDS) the head sits on forward_features, not on timm's own pooled head:
that feature map is what keras-hub's timm converters rebuild under TensorFlow for the export (for MobileNetV3, timm's
pooled output would also pass its conv_head, which keras-hub's backbone does not hold). Every other architecture
(lowered through JAX for the export) keeps timm's own pooling, forward_head(pre_logits=True). model.timm_model is an
architecture name (timm.create_model, with timm_weights) or a folder
as timm.models.save_for_hf writes it: config.json (its architecture and pretrained_cfg) + model.safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.core.errors import ConfigError, root_cause
from common.launch.backbones import KERAS_HUB_REBUILDS

import timm
import torch
from safetensors import SafetensorError
from torch import nn

ACTIVATIONS = {"softmax": lambda x: torch.softmax(x, dim=-1), "sigmoid": torch.sigmoid, "linear": lambda x: x}
WEIGHTS_FILE = "model.safetensors"


def timm_source(model_cfg) -> tuple[str, Path | None]:
    """(architecture, folder or None) of model.timm_model; a folder's architecture read from its config.json."""
    name = model_cfg.timm_model
    if "/" not in name:
        return name, None
    folder = Path(name)
    config = folder / "config.json"
    if not config.is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ConfigError(
            f"model.timm_model={name!r} is not a timm model folder (config.json and {WEIGHTS_FILE}, as "
            "timm.models.save_for_hf writes them). Fix: the folder's path, or an architecture name"
        )
    architecture = json.loads(config.read_text()).get("architecture", "")
    if not architecture:
        raise ConfigError(f"{config} names no architecture. Fix: write the folder with timm.models.save_for_hf")
    return architecture, folder


def create_timm(architecture: str, image_size: int | None = None, **options) -> nn.Module:
    """timm.create_model at the images' size where the architecture takes one (a ViT's patch grid is fixed when it is
    built); a convolutional network, which takes any size, refuses img_size and is built without it."""
    if image_size:
        try:
            return timm.create_model(architecture, img_size=image_size, **options)
        except TypeError as err:
            if "img_size" not in str(err):
                raise
    return timm.create_model(architecture, **options)


def create_backbone(model_cfg, image_size: int | None = None) -> nn.Module:
    """The timm model without its classifier, for images of image_size: a folder's weights, or a name's
    (pretrained: timm downloads them)."""
    architecture, folder = timm_source(model_cfg)
    if folder is not None:
        # The folder's own normalisation, where its config.json gives one: timm's default for the architecture name
        # may be another's (EfficientNet-Lite weights from TF take (x - 0.5) / 0.5, timm's name says ImageNet's).
        saved = json.loads((folder / "config.json").read_text()).get("pretrained_cfg") or {}
        overlay = {key: saved[key] for key in ("mean", "std") if key in saved}
        try:
            return create_timm(
                architecture,
                image_size,
                pretrained=True,
                num_classes=0,
                pretrained_cfg_overlay={**overlay, "file": str(folder / WEIGHTS_FILE)},
            )
        except (SafetensorError, RuntimeError, OSError) as err:  # a copy cut short; another model's weights
            raise ConfigError(
                f"{folder / WEIGHTS_FILE} cannot be read as the weights of its config.json's "
                f"{architecture} ({root_cause(err)}). Fix: write the "
                "folder again with timm.models.save_for_hf and attach it again"
            ) from err
    return create_timm(architecture, image_size, pretrained=model_cfg.timm_weights == "pretrained", num_classes=0)


class TimmClassifier(nn.Module):
    """uint8 images [B, S, S, 3] -> the task's outputs [B, outputs] in float32. With `autocast` (a dtype), the
    backbone computes in it under torch.autocast (bfloat16 on a TPU or a GPU from capability 8.0, float16 below); the
    head always in float32. The images' permute gives the backbone channels-last input, which a channels-last model
    (the torch route) convolves without a copy."""

    def __init__(
        self, backbone: nn.Module, outputs: int, activation: str, dropout: float, autocast: torch.dtype | None = None
    ):
        super().__init__()
        self.backbone = backbone
        self.autocast = autocast
        self.activation = activation
        self.frozen = False  # freeze_backbone
        config = backbone.pretrained_cfg
        self.register_buffer("mean", torch.tensor(config["mean"]).view(1, 3, 1, 1) * 255.0, persistent=False)
        self.register_buffer("std", torch.tensor(config["std"]).view(1, 3, 1, 1) * 255.0, persistent=False)
        # keras-hub rebuilds these for the export from forward_features' map, so the head pools that map itself
        self.keras_hub = backbone.pretrained_cfg.get("architecture") in KERAS_HUB_REBUILDS
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(feature_width(backbone, self.keras_hub), outputs)

    def freeze_backbone(self) -> None:
        """model.trainable=false: the backbone's weights get no gradient, and its BatchNorm layers keep their
        pretrained statistics (evaluation mode whatever train() says), as Keras freezes a layer. Left in training
        mode, a frozen timm backbone would still normalise by each batch's statistics and move its running ones."""
        self.backbone.requires_grad_(False)
        self.frozen = True

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen:
            self.backbone.eval()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.permute(0, 3, 1, 2).float() - self.mean) / self.std
        with torch.autocast(x.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            features = self.backbone.forward_features(x)
            if not self.keras_hub:  # timm's own pooling (a ViT's class token, a ConvNeXt's norm after the pool)
                features = self.backbone.forward_head(features, pre_logits=True)
        pooled = features.float().mean(dim=(2, 3)) if self.keras_hub else features.float()
        return ACTIVATIONS[self.activation](self.head(self.dropout(pooled)))


def feature_width(backbone: nn.Module, keras_hub: bool = True) -> int:
    """Channels of forward_features' map: timm's num_features (1280 for EfficientNet-B0, whose map ends in its
    conv_head; 288 for MobileNetV3-small-050, whose conv_head follows the pooling). Not feature_info's last stage:
    EfficientNet's is the last block's (320), before the conv_head. Through timm's own head (keras_hub False): its
    pre-logits width (head_hidden_size where the head has a hidden layer)."""
    hidden = None if keras_hub else getattr(backbone, "head_hidden_size", None)
    return int(hidden or backbone.num_features)


def build_timm_model(
    model_cfg, outputs: int, activation: str, autocast: torch.dtype | None = None, image_size: int | None = None
) -> TimmClassifier:
    if activation == "softmax" and outputs < 2:
        raise ConfigError(f"a classifier needs at least 2 classes, got {outputs}")
    backbone = create_backbone(model_cfg, image_size)
    model = TimmClassifier(backbone, outputs, activation, model_cfg.dropout, autocast)
    model.image_size = image_size  # what a copy of it is built for (the export's)
    if not model_cfg.trainable:
        model.freeze_backbone()
    return model
