"""data.augment_on=auto: the side the per-image augmentations run on, decided before the backend starts.

    cfg, line = choose_augment_side(cfg)   # data.augment_on now host or device; line: which, and why

Where the host's cores cannot decode and augment as fast as the accelerators take images, the augmentations move into
the training step on the accelerator (the routes whose Route.device_augment says they can), and the host decodes
only. In order:
- nothing per image to move (data.augment=false, or no transform on), or a route that augments on the host: host;
- the accelerator is this host's CPU (the device would be the same cores): host;
- a GPU machine with at most 2 CPU cores a GPU (a Kaggle GPU session: 2 cores for two T4s, bench/README.md "Two cores
  for two GPUs": the full stack 40 images a second at 512 px): device;
- otherwise the host's rate for the configured stack, measured here on synthetic JPEGs at data.image_size over all
  its cores, against what the accelerators take: below it, device.
What an accelerator takes is an estimate, scaled from 224 px by the pixels (ACCELERATOR_RATES; unmeasured here).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from common.core.config import Config
from common.data.transforms import active_transforms

# Images a second one accelerator trains EfficientNet-B0 on at 224 px in 16-bit floats: a T4 about 400 (NVIDIA's
# published B0 AMP training rates scaled by the T4's share: issue 79's estimate, 75-100 at 512 px); a TPU v5e chip
# about 1,500 (an estimate below the H100's 4,070-6,887 measured in bench/README.md). Larger models take fewer: the
# estimate errs towards the host.
ACCELERATOR_RATES = {"gpu": 400.0, "tpu": 1500.0}
FEW_CORES_PER_GPU = 2


def host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def accelerators_here(kind: str, environ=None) -> int:
    """GPUs (CUDA_VISIBLE_DEVICES where set, else the driver's list) or TPU chips (TPU_ACCELERATOR_TYPE's count,
    e.g. v5litepod-8) this machine trains on; 1 for the CPU or where nothing says."""
    environ = os.environ if environ is None else environ
    if kind == "gpu":
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return max(1, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
        listed = Path("/proc/driver/nvidia/gpus")
        return max(1, len(list(listed.iterdir()))) if listed.is_dir() else 1
    if kind == "tpu":
        count = environ.get("TPU_ACCELERATOR_TYPE", "").rsplit("-", 1)[-1]
        return int(count) if count.isdigit() else 8
    return 1


def host_rate(data_cfg, images: int = 96) -> float:
    """Images a second this host decodes and augments with data_cfg's stack, on all its cores (tf.data's parallel
    map, as the training pipeline): synthetic JPEGs at data.image_size, timed after a warm-up pass."""
    from common.data.pipeline import augment, decode_image

    import numpy as np
    import tensorflow as tf

    size = data_cfg.image_size
    pixels = np.random.default_rng(0).integers(0, 256, (8, size, size, 3), dtype=np.uint8)
    jpegs = [tf.io.encode_jpeg(image).numpy() for image in pixels]
    dataset = (
        tf.data.Dataset.from_tensor_slices(jpegs)
        .repeat(-(-images // len(jpegs)))
        .map(lambda b: augment(decode_image(b, size), data_cfg), num_parallel_calls=tf.data.AUTOTUNE)
        .batch(16)
    )
    for _ in dataset.take(1):  # the map's tracing and the pool's start
        pass
    began = time.perf_counter()
    count = sum(int(batch.shape[0]) for batch in dataset)
    return count / (time.perf_counter() - began)


def decide(cfg: Config, accelerator: str, devices: int, cores: int, measure=host_rate) -> tuple[str, str]:
    """(host | device, why) for data.augment_on=auto on this machine (the module's rules, in order)."""
    from common.launch.routes import route_of

    route = route_of(cfg)
    if not active_transforms(cfg.data):
        return "host", "no per-image transform to move"
    if not route.device_augment:
        return "host", f"train.framework={route.name} augments on the host"
    if accelerator == "cpu":
        return "host", "the accelerator is this host's CPU, whose cores the step would share"
    if accelerator == "gpu" and cores <= FEW_CORES_PER_GPU * devices:
        return "device", f"{cores} CPU core(s) for {devices} GPU(s) cannot decode and augment as fast as they train"
    rate = measure(cfg.data)
    needed = devices * ACCELERATOR_RATES[accelerator] * (224 / cfg.data.image_size) ** 2
    figures = (
        f"the host augments {rate:.0f} images/s with this stack on {cores} core(s), {devices} {accelerator.upper()}(s) "
        f"take about {needed:.0f} at {cfg.data.image_size} px (an estimate)"
    )
    return ("device", figures) if rate < needed else ("host", figures)


def choose_augment_side(cfg: Config, measure=host_rate) -> tuple[Config, str]:
    """cfg with data.augment_on=auto resolved here (unchanged otherwise), and the run's line saying where and why."""
    from common.launch.routes import accelerator_here

    setting = cfg.data.augment_on
    if setting != "auto":
        side, why = setting, "as set"
    else:
        accelerator = accelerator_here()
        side, why = decide(cfg, accelerator, accelerators_here(accelerator), host_cores(), measure)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, augment_on=side))
    where = "the device, in the training step" if side == "device" else "the host, in the tf.data pipeline"
    return cfg, f"[train] augmentations on {where} (data.augment_on={setting}: {why})"
