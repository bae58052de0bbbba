"""The TPU training kernel: config -> framework and hardware -> data -> model -> fit -> export, for each fold.

    python -m train_tpu.train --config configs/demo.yaml --set train.epochs=3     # locally (CPU)
    python -m tpu2gpu.demo --framework keras_jax                                # the demo's, on Keras 3 on JAX
    tpu2gpu build, then kaggle kernels push                                     # on Kaggle (TPU v5e-8)

Writes to runtime.output_dir (/kaggle/working on Kaggle, ./runs/train locally, or a gs:// folder: worked on in a
local copy, each checkpoint and export uploaded with its marker last, common/core/gcs.py):
    export/fold<k>/            the verified export of each fold (what becomes the model dataset)
    export/training_report.json  per-fold and out-of-fold scores
    export/bad_images.csv      images the conversion left out (data.on_bad_image=skip), if any
and to runtime.scratch_dir (/kaggle/temp on Kaggle, not kernel output; runtime.output_dir locally; work/ goes to a
gs:// output's local copy, and so to the bucket):
    tfrecords/                 runtime.competition_dir converted, when no runtime.tfrecords is given
    work/fold<k>/              checkpoints and history while a fold trains (checkpoints removed once it is exported)
Started again with the same output folder, it skips exported folds and resumes a fold from its last checkpoint.
Folds start only while train.time_budget_hours covers them (common/training/budget.py; by default the training
accelerator's session less a margin); a fold the budget cuts still exports, and keeps its work folder in the output
(work/fold<k>) for a later run. With runtime.continue_from (a chain's next link, common/training/chain.py) it first
takes the previous link's output: its exports carried, a cut fold's checkpoint put back.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import common  # noqa: F401  (TF_USE_LEGACY_KERAS before tensorflow)
import common.launch.routes  # noqa: F401  (supplies the config train.framework's routes and backbone rule)
from common.core.config import config_to_dict, format_config, parse_kernel_args
from common.core.errors import run_entry
from common.core.gcs import require_access
from common.core.paths import training_folders
from common.data.records import has_manifest, read_manifest
from common.data.sources import open_source
from common.launch.torchrun import processes_to_start, start_on_this_machine
from common.training.chain import previous_run


def skipped_images(tfrecord_dir: str, export_root: Path) -> dict | None:
    """The images the conversion left out (data.on_bad_image=skip): their list is copied into the kernel output,
    beside the exports, so a Kaggle run says what it trained without."""
    import tensorflow as tf

    skipped = read_manifest(tfrecord_dir).get("skipped", {}) if has_manifest(tfrecord_dir) else {}
    if not skipped.get("count"):
        return None
    export_root.mkdir(parents=True, exist_ok=True)
    tf.io.gfile.copy(
        f"{tfrecord_dir.rstrip('/')}/{skipped['file']}", str(export_root / skipped["file"]), overwrite=True
    )
    print(
        f"[train] the records leave out {skipped['count']} bad image(s) (data.on_bad_image=skip): listed in "
        f"{export_root / skipped['file']}",
        flush=True,
    )
    return skipped


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()  # the time budget counts from here

    # ---- config, framework and hardware (common/launch/routes.py: tf_keras, Keras 3 on JAX, torch_xla or torch)
    cfg = parse_kernel_args(__doc__, argv)
    print(format_config(cfg), flush=True)
    # a chain's next link: the previous link's output found first, so a missing one stops before the backend starts
    previous = previous_run(cfg.runtime.continue_from) if cfg.runtime.continue_from else None
    processes = processes_to_start(cfg)  # the torch route on several GPUs: one process each, torchrun starts them
    if processes > 1:
        return start_on_this_machine(processes, sys.argv[1:] if argv is None else argv)
    from common.training.augment_side import choose_augment_side
    from common.training.backends.registry import prepare_route, start_backend

    prepare_route(cfg)  # the route's environment first: deciding where to augment may import TensorFlow
    cfg, augment_line = choose_augment_side(cfg)  # data.augment_on=auto: host or device, before the backend reads it
    print(augment_line, flush=True)
    backend = start_backend(cfg)
    from common.training.budget import budget_hours
    from common.training.chain import take_previous_run
    from common.training.run import train_folds, write_report

    # ---- data
    hosts = backend.hosts  # several processes (keras_jax across hosts): process 0 alone writes the output
    folders = training_folders(cfg.runtime, hosts)  # a gs:// output: its local copy, pushed by folders.mirror
    require_access(reads=[cfg.runtime.tfrecords], writes=[cfg.runtime.output_dir] if hosts.writer else [])
    tfrecord_dir = open_source(cfg).training_records(folders.scratch)

    # ---- a chain's next link: the previous link's exports and cut fold's checkpoint first (common/training/chain.py)
    if previous and hosts.writer:
        take_previous_run(previous, cfg, folders.out, folders.work)
    hosts.wait("the previous run taken")

    # ---- train and export each fold, as far as the time budget goes (common/training/budget.py)
    skipped = skipped_images(tfrecord_dir, folders.out / "export") if hosts.writer else None
    hours = budget_hours(cfg.train.time_budget_hours, cfg.kaggle.train_accelerator)
    print(
        f"[train] time budget: {hours:g} h (train.time_budget_hours={cfg.train.time_budget_hours:g}, "
        f"kaggle.train_accelerator={cfg.kaggle.train_accelerator})",
        flush=True,
    )
    report = train_folds(cfg, backend, tfrecord_dir, folders, start + hours * 3600)
    if hosts.writer:
        path = write_report(
            folders.out / "export",
            {
                "folds": report["folds"],
                "config": config_to_dict(cfg),
                "runtime": backend.runtime(),
                "not_started": report["not_started"],
                "cut": report["cut"],
                "skipped_images": skipped,
            },
        )
        for written in [path, *([path.parent / skipped["file"]] if skipped else [])]:
            folders.mirror.push(written)
    return 0


if __name__ == "__main__":
    run_entry("train_tpu", main)
