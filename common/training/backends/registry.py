"""The training backend a run uses, started once: the route train.framework names (common/launch/routes.py ROUTES,
or the TPU negotiation's fallback), its environment prepared before its framework is imported, then its start(cfg).

    backend = start_backend(cfg)     # hardware decided and logged (strategy or devices, precision)
"""

from __future__ import annotations

import dataclasses
import importlib

from common.core.config import Config
from common.core.paths import resolve_input_path
from common.launch.routes import ROUTES, chosen_framework


def with_local_paths(cfg: Config):
    """cfg with the backbone files it names (model.keras_backbone, model.efficientnet_weights, a model.timm_model
    folder) where this kernel finds them (common.core.paths.resolve_input_path); the run's own cfg, printed and saved
    in the card, keeps them as given."""
    model = dataclasses.replace(
        cfg.model,
        keras_backbone=resolve_input_path(cfg.model.keras_backbone),
        efficientnet_weights=resolve_input_path(cfg.model.efficientnet_weights),
        timm_model=resolve_input_path(cfg.model.timm_model),
    )
    return dataclasses.replace(cfg, model=model)


def prepare_route(cfg: Config):
    """The route cfg takes, its environment set before its framework is first imported (again: harmless)."""
    route = ROUTES[chosen_framework(cfg)]
    route.prepare(cfg)
    return route


def start_backend(cfg: Config):
    """The training backend for cfg (a common.training.backends.base.Backend)."""
    route = prepare_route(cfg)
    module, function = route.start.split(":")
    return getattr(importlib.import_module(module), function)(with_local_paths(cfg))
