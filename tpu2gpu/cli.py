"""`tpu2gpu`: one command per workflow step. `tpu2gpu --help` lists them, `tpu2gpu STEP --help` explains one.

Every step takes the same config flags: `--config FILE` (YAML or JSON) and any number of `--set section.key=value`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import common  # noqa: F401  (environment bootstrap first)
from common.config import format_config, load_config
from common.errors import UserError

DEFAULT_DEMO_DIR = Path("runs/demo/competition")



def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON config over the defaults")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key, e.g. --set train.epochs=3 (repeatable)")


def _config(args):
    return load_config(args.config, args.overrides)


def cmd_config(args) -> int:
    print(format_config(_config(args)))
    return 0


def cmd_env(args) -> int:
    from common.env import environment_report
    from common.strategy import get_strategy, split_cpu

    cfg = _config(args)
    split_cpu(cfg.runtime.cpu_devices)
    print(environment_report(get_strategy(cfg.runtime.strategy, cfg.runtime.tpu_address)))
    return 0


def cmd_demo_data(args) -> int:
    from tpu2gpu.demo_data import make_demo_competition

    out = make_demo_competition(args.out, overwrite=args.overwrite)
    print(f"demo competition in {out}")
    return 0


def cmd_tfrecords(args) -> int:
    from common.tfrecords import convert_competition

    cfg = _config(args)
    competition = args.competition or cfg.runtime.competition_dir
    if not competition:
        from tpu2gpu.demo_data import make_demo_competition

        competition = make_demo_competition(DEFAULT_DEMO_DIR)
        print(f"[tfrecords] no competition given: using the embedded demo in {competition}", file=sys.stderr)
    out = Path(args.out or cfg.runtime.tfrecords or f"{Path(competition).resolve()}-tfrec")
    print(format_config(cfg))
    manifest = convert_competition(competition, out, cfg.data, overwrite=args.overwrite)
    for name, split in manifest["splits"].items():
        sizes = [s["bytes"] / 1e6 for s in split["shards"]]
        print(f"{name:>8}: {split['count']:6d} records in {len(sizes):3d} shards of "
              f"{min(sizes):.2f}-{max(sizes):.2f} MB")
    print(f"{len(manifest['class_names'])} classes; TFRecords and manifest.json in {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpu2gpu", description="Train on Kaggle's TPU, submit from a GPU kernel.")
    steps = parser.add_subparsers(dest="command", metavar="STEP", required=True)

    p = steps.add_parser("config", help="print the resolved config (defaults < --config file < --set)")
    _add_config_flags(p)
    p.set_defaults(func=cmd_config)

    p = steps.add_parser("env", help="print the environment block: versions, devices, strategy, replicas")
    _add_config_flags(p)
    p.set_defaults(func=cmd_env)

    p = steps.add_parser("demo-data", help="write the embedded demo competition (Kaggle layout, digits)")
    p.add_argument("--out", default=str(DEFAULT_DEMO_DIR), help="folder to write (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="rewrite it even if complete")
    p.set_defaults(func=cmd_demo_data)

    p = steps.add_parser("tfrecords", help="convert a competition folder (CSV + images) into sharded TFRecords",
                         description="Convert a Kaggle-style competition (a CSV of ids and labels, a folder of "
                         "JPEG/PNG images, a test folder) into TFRecord shards with a manifest. Column names, folds, "
                         "shard size and re-encoding come from the data section of the config.")
    _add_config_flags(p)
    p.add_argument("--competition", metavar="DIR", help="competition folder (default: runtime.competition_dir, "
                   "else the embedded demo)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: runtime.tfrecords, else <competition>-tfrec)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=cmd_tfrecords)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UserError, FileExistsError) as err:  # the user's to fix: one clear line, no traceback
        print(f"tpu2gpu {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
