"""`tpu2gpu wheels` and `tpu2gpu publish-wheels`: every candidate TPU stack's wheels (kaggle.tpu_packages,
common/launch/negotiation.py) for Kaggle's TPU image, in one dataset the training kernel installs from offline."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from common.core.config import Config, config_from_args
from common.core.errors import UserError


def _wheels_dataset(cfg: Config) -> str:
    from common.launch.tpu_stack import wheels_ref

    ref = wheels_ref(cfg.kaggle.tpu_wheels, cfg.kaggle.owner)
    if not ref:
        raise UserError(
            "kaggle.tpu_wheels is empty: set it to the slug of the wheels dataset, e.g. "
            "--set kaggle.tpu_wheels=tpu2gpu-tpu-wheels"
        )
    return ref


def cmd_wheels(args) -> int:
    from common.core.atomic import staged_dir
    from common.launch.negotiation import every_pin, parse_candidates
    from common.launch.tpu_stack import IMAGE_PLATFORMS, download_args, download_wheels

    from tpu2gpu.build import validate_dataset_metadata

    cfg = config_from_args(args)
    ref = _wheels_dataset(cfg)
    stacks = every_pin(parse_candidates(cfg.kaggle.tpu_packages))  # every candidate's, into one dataset
    meta = {"title": f"{ref.split('/')[1].replace('-', ' ')}"[:50], "id": ref, "licenses": [{"name": "other"}]}
    validate_dataset_metadata(meta)
    platforms = tuple(args.platform) or IMAGE_PLATFORMS
    for pins in stacks:
        print(
            f"[wheels] {', '.join(f'{n}=={v}' for n, v in pins.items())} for Python {args.python} "
            f"({platforms[0]}, ...) into {args.out}",
            flush=True,
        )
        if args.dry_run:
            print(
                "$ "
                + shlex.join(
                    ["pip", *download_args(pins, Path(args.out), cfg.kaggle.tpu_find_links, args.python, platforms)]
                )
            )
    if args.dry_run:
        return 0
    with staged_dir(Path(args.out), overwrite=args.overwrite) as tmp:
        for pins in stacks:
            download_wheels(pins, tmp, cfg.kaggle.tpu_find_links, args.python, platforms)
        (tmp / "dataset-metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    wheels = sorted(Path(args.out).glob("*.whl"))
    print("\n".join(f"{wheel.stat().st_size / 1e6:9.1f} MB  {wheel.name}" for wheel in wheels))
    print(
        f"[wheels] dataset {ref} ready in {args.out} ({len(stacks)} stacks, {len(wheels)} wheels, "
        f"{sum(w.stat().st_size for w in wheels) / 1e6:.0f} MB): `tpu2gpu publish-wheels --wheels {args.out}` "
        "uploads it"
    )
    return 0


def cmd_publish_wheels(args) -> int:
    from common.launch.negotiation import every_pin, parse_candidates
    from common.launch.tpu_stack import check_wheels

    from tpu2gpu import workflow

    cfg = config_from_args(args)
    ref = _wheels_dataset(cfg)
    folder = Path(args.wheels)
    if not args.dry_run:
        for pins in every_pin(parse_candidates(cfg.kaggle.tpu_packages)):  # what the kernel checks, before uploading
            check_wheels(pins, folder)
        if not (folder / "dataset-metadata.json").is_file():
            raise UserError(f"{folder} holds no dataset-metadata.json. Fix: `tpu2gpu wheels --out {folder}` makes it")
    workflow.publish(folder, None, ref, args.message, dir_mode=False, dry_run=args.dry_run)
    return 0
