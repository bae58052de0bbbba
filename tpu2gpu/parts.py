"""The training kernels a config builds: one, or its folds split over several that Kaggle runs at once.

    kaggle.train_parts: ["0,1,2@TpuV5E8", "3@NvidiaTeslaT4 train.framework=torch model.backbone=timm",
                         "4@NvidiaTeslaT4 train.framework=torch model.backbone=timm"]

Kaggle runs one TPU and two GPU batch sessions of an account at the same time, and every route exports the same
contract, so five folds can train on three machines at once: each part is a training kernel of its own
(<kaggle.train_kernel>-p1, -p2, ...) with its folds (train.folds), its machine (kaggle.train_accelerator) and any
settings of its own (a route for that machine), each continuing in its own chain (`tpu2gpu continue`). `tpu2gpu
publish` gathers their folds into one model dataset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.core.config import Config, with_overrides
from common.core.errors import ConfigError

SESSIONS_AT_ONCE = {"TPU": 1, "GPU": 2}  # an account's batch sessions at once (the push's own refusals)


@dataclass(frozen=True)
class TrainingKernel:
    folder: str  # in the build folder: "train", or "train-p1", "train-p2", ...
    cfg: Config  # what it runs: its folds, its machine, its settings


def _machine(accelerator: str) -> str:
    return "TPU" if accelerator.startswith("Tpu") else "GPU"


def _part(cfg: Config, number: int, spec: str) -> TrainingKernel:
    head, *settings = spec.split()
    folds, at, accelerator = head.partition("@")
    try:
        fold_list = [int(f) for f in folds.split(",")]
    except ValueError:
        fold_list = []
    if not at or not accelerator or not fold_list:
        raise ConfigError(
            f"kaggle.train_parts[{number - 1}]={spec!r} must start with FOLDS@ACCELERATOR, e.g. '0,1,2@TpuV5E8' or "
            "'3@NvidiaTeslaT4 train.framework=torch model.backbone=timm'"
        )
    part = with_overrides(cfg, settings)  # the part's own settings, checked as any config's
    k = cfg.kaggle
    kaggle = dataclasses.replace(
        part.kaggle,
        train_accelerator=accelerator,
        train_kernel=f"{k.train_kernel}-p{number}",
        train_title=f"{k.train_title or k.train_kernel.replace('-', ' ')} p{number}",
        train_parts=(),
    )
    train = dataclasses.replace(part.train, folds=tuple(fold_list))
    return TrainingKernel(f"train-p{number}", dataclasses.replace(part, kaggle=kaggle, train=train))


def training_kernels(cfg: Config) -> list[TrainingKernel]:
    """The training kernels cfg builds: one ("train"), or one per kaggle.train_parts entry, checked to train every
    fold of data.folds once, within the sessions Kaggle runs at once."""
    if not cfg.kaggle.train_parts:
        return [TrainingKernel("train", cfg)]
    parts = [_part(cfg, number, spec) for number, spec in enumerate(cfg.kaggle.train_parts, 1)]
    owners: dict[int, list[str]] = {}
    for part in parts:
        for fold in part.cfg.train.folds:
            owners.setdefault(fold, []).append(part.cfg.kaggle.train_kernel)
    folds = range(cfg.data.folds or 1)
    problems = [f"fold {f} in {' and '.join(kernels)}" for f, kernels in sorted(owners.items()) if len(kernels) > 1]
    problems += [f"fold {f} in none" for f in folds if f not in owners]
    problems += [f"fold {f} beyond data.folds={cfg.data.folds}" for f in sorted(owners) if f not in folds]
    for machine, limit in SESSIONS_AT_ONCE.items():
        on = [p.cfg.kaggle.train_kernel for p in parts if _machine(p.cfg.kaggle.train_accelerator) == machine]
        if len(on) > limit:
            problems.append(f"{len(on)} parts on a {machine} ({', '.join(on)}), where Kaggle runs {limit} at once")
    if problems:
        raise ConfigError(
            f"kaggle.train_parts must train each of the {len(folds)} folds once, at most one part on a TPU and two "
            f"on GPUs: {'; '.join(problems)}. Fix: list each fold in one part"
        )
    return parts
