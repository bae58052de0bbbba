"""`tpu2gpu`: one command per workflow step. `tpu2gpu --help` lists them, `tpu2gpu STEP --help` explains one.

Every step takes the same config flags: `--config FILE` (YAML or JSON) and any number of `--set section.key=value`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (environment bootstrap first)
import common.launch.routes  # noqa: F401  (on import, the routes and the tasks supply what every step's config
import common.tasks.types  # noqa: F401  is checked against: train.framework, model.backbone, data.task)
from common.core.config import add_config_flags, config_from_args, format_config
from common.launch.tpu_stack import IMAGE_PYTHON

from tpu2gpu.wheels import cmd_publish_wheels, cmd_wheels

DEFAULT_DEMO_DIR = Path("runs/demo/competition")


def cmd_config(args) -> int:
    if args.reference:
        from common.core.config import config_reference

        print(config_reference())
        return 0
    print(format_config(config_from_args(args)))
    return 0


def cmd_env(args) -> int:
    from common.core.platform import environment_report
    from common.core.strategy import get_strategy, split_cpu

    cfg = config_from_args(args)
    split_cpu(cfg.runtime.cpu_devices)
    print(environment_report(get_strategy(cfg.runtime.strategy, cfg.runtime.tpu_address)))
    return 0


def cmd_train(args) -> int:
    from common.core.errors import ConfigError
    from common.launch.routes import route_names, route_of

    from tpu2gpu.launcher import launch

    cfg = config_from_args(args)  # checked here, before any process starts
    route = route_of(cfg)
    if args.processes > 1 and route.processes == "one":
        several = route_names(lambda other: other.processes != "one")
        raise ConfigError(
            f"train.framework={route.name} drives every device from one process; --processes {args.processes} "
            f"trains across processes. Fix: train.framework={' or '.join(several)}, or --processes 1"
        )
    kernel_args = [
        *(["--config", args.config] if args.config else []),
        *[a for s in args.overrides for a in ("--set", s)],
    ]
    return launch(kernel_args, args.processes, cfg.runtime.cpu_devices, torchrun=route.processes == "per_gpu")


def cmd_demo_data(args) -> int:
    from tpu2gpu.demo_data import make_demo_competition

    out = make_demo_competition(args.out, overwrite=args.overwrite)
    print(f"demo competition in {out}")
    return 0


def cmd_tfrecords(args) -> int:
    from common.core.gcs import require_access
    from common.core.paths import local_folder
    from common.data.conversion import convert_competition
    from common.data.records import require_no_records, upload_records

    cfg = config_from_args(args)
    competition = args.competition or cfg.runtime.competition_dir
    if not competition:
        from tpu2gpu.demo_data import make_demo_competition

        competition = make_demo_competition(DEFAULT_DEMO_DIR)
        print(f"[tfrecords] no competition given: using the embedded demo in {competition}", file=sys.stderr)
    out = args.out or cfg.runtime.tfrecords or f"{Path(competition).resolve()}-tfrec"
    print(format_config(cfg))
    if out.startswith("gs://"):  # converted here, then uploaded with the manifest last
        require_access(writes=[out])
        require_no_records(out, args.overwrite)
        with tempfile.TemporaryDirectory() as local:
            manifest = convert_competition(competition, Path(local) / "records", cfg.data)
            upload_records(Path(local) / "records", out)
    else:
        out = local_folder(out, "--out" if args.out else "runtime.tfrecords", "the records' folder")
        manifest = convert_competition(competition, out, cfg.data, overwrite=args.overwrite)
    for name, split in manifest["splits"].items():
        sizes = [s["bytes"] / 1e6 for s in split["shards"]]
        print(
            f"{name:>8}: {split['count']:6d} records in {len(sizes):3d} shards of {min(sizes):.2f}-{max(sizes):.2f} MB"
        )
    skipped = manifest["skipped"]
    if skipped["count"]:
        print(f"skipped {skipped['count']} bad image(s) (data.on_bad_image=skip): listed in {out}/{skipped['file']}")
    print(f"{len(manifest['class_names'])} classes; TFRecords and manifest.json in {out}")
    return 0


def cmd_verify_records(args) -> int:
    from common.data.records import check_shards, read_manifest, require_whole_records, shard_paths

    manifest = read_manifest(args.records)
    names = list(manifest["splits"])
    check_shards(manifest, args.records, names)
    files = shard_paths(manifest, args.records, names)
    how = "present and of the size the manifest recorded"
    if args.full:
        started = time.perf_counter()
        require_whole_records(files, args.records, "verify-records --full")
        how += f", and every record read back whole ({time.perf_counter() - started:.1f} s)"
    print(f"{len(files)} shards of {args.records} ({', '.join(names)}): {how}")
    return 0


def cmd_augment_preview(args) -> int:
    from tpu2gpu.preview import augment_preview

    titles = augment_preview(config_from_args(args), args.out, args.rows, args.cols)
    print(f"{len(titles)} training images as the pipeline yields them, in {args.out}")
    return 0


def cmd_build(args) -> int:
    from tpu2gpu.build import build

    folders = build(config_from_args(args), args.out)
    for name, folder in folders.items():
        print(f"{name:>8}: {folder}/ " + " ".join(sorted(p.name for p in folder.iterdir())))
    return 0


def cmd_push(args) -> int:
    from tpu2gpu import workflow

    for folder in workflow.kernel_folders(Path(args.build), args.kernel):
        version = workflow.push(Path(args.build), folder, args.dry_run)
        if version is not None:
            print(f"[push] {folder} kernel version {version} (recorded in {Path(args.build) / folder})")
    return 0


def cmd_wait(args) -> int:
    from tpu2gpu import workflow

    cfg = config_from_args(args)
    for folder in workflow.kernel_folders(Path(args.build), args.kernel):  # several run at once: each in turn
        workflow.wait(workflow.kernel_ref(cfg, folder, Path(args.build)), args.interval, dry_run=args.dry_run)
    return 0


def cmd_fetch(args) -> int:
    from tpu2gpu import workflow

    cfg, folders = config_from_args(args), workflow.kernel_folders(Path(args.build), args.kernel)
    for folder in folders:
        ref = workflow.kernel_ref(cfg, folder, Path(args.build))
        workflow.fetch(ref, workflow.fetched_folder(Path(args.out), folders, folder), args.dry_run)
    return 0


def cmd_continue(args) -> int:
    """Each chain's next link, where a fetched run left folds: built from the same config and pushed, attaching the
    fetched link's kernel."""
    from tpu2gpu import workflow

    if workflow.continue_chains(config_from_args(args), Path(args.build), Path(args.out), args.dry_run):
        print(
            f"[continue] next (each with this config): `tpu2gpu wait --build {args.build}`, then `tpu2gpu fetch "
            f"--build {args.build} --out {args.out}`, and `tpu2gpu continue` again while folds are left",
            flush=True,
        )
    else:
        print(
            f"[continue] no link pushed. Once every fold is exported: `tpu2gpu publish --build {args.build} --out "
            f"{args.out}` with this config"
        )
    return 0


def cmd_verify_export(args) -> int:
    from tpu2gpu import workflow

    for card in workflow.verify_export(Path(args.export)):
        m, metric = card.metrics, card.metric
        value = "n/a" if metric["value"] is None else f"{metric['value']:.4f}"
        print(
            f"fold{card.fold}: complete, {card.task}, {len(card.class_names)} classes, {card.image_size} px, "
            f"{metric['name']} {value} (epoch {m['best_epoch']} of {m['epochs']}), signatures "
            f"{sorted(card.precisions)}"
        )
    return 0


def cmd_publish(args) -> int:
    from tpu2gpu import workflow

    cfg = config_from_args(args)
    workflow.publish_export(
        [Path(e) for e in args.export] or workflow.fetched_exports(Path(args.build), Path(args.out)),
        Path(args.build) / "dataset" / "dataset-metadata.json",
        f"{cfg.kaggle.owner}/{cfg.kaggle.model_dataset}",
        args.message,
        args.dry_run,
        args.allow_missing,
    )
    return 0


def cmd_blend(args) -> int:
    from tpu2gpu import blend

    runs = blend.read_runs([Path(r) for r in args.runs], args.name or None)
    chosen = blend.choose_blend(runs, args.splits, args.seed)
    print(blend.table(runs, chosen), flush=True)
    out = blend.write_blend(Path(args.out), runs, chosen)
    print(
        f"[blend] wrote {out} (blend.json, hill.png, the weighted runs' folds). Next: `tpu2gpu publish --export {out}`,"
        " and the inference kernel weighs its members by it",
        flush=True,
    )
    return 0


def cmd_submit(args) -> int:
    from tpu2gpu import workflow

    cfg = config_from_args(args)
    workflow.submit(cfg, Path(args.build), args.version, args.message, Path(args.file), args.dry_run)
    return 0


def cmd_workflow(args) -> int:
    """Every step in order; stops at the first failure."""
    from tpu2gpu import workflow
    from tpu2gpu.build import build

    cfg = config_from_args(args)
    build_dir, fetched = Path(args.build), Path(args.out)
    build(cfg, build_dir)
    running = workflow.kernel_folders(build_dir, "train")
    for folder in running:
        workflow.push(build_dir, folder, args.dry_run)
    every = list(running)  # the build's training kernels; a link is built in its kernel's folder
    for links in range(1, cfg.kaggle.max_links + 1):  # each kernel's chain: the next links pushed by continue
        for folder in running:  # they run at once on Kaggle: waited for in turn
            workflow.wait(workflow.kernel_ref(cfg, folder, build_dir), args.interval, dry_run=args.dry_run)
        for folder in running:
            ref = workflow.kernel_ref(cfg, folder, build_dir)
            workflow.fetch(ref, workflow.fetched_folder(fetched, every, folder), args.dry_run)
        if args.dry_run:
            print("# then, while a fetched run leaves folds: tpu2gpu continue (each chain's next link)", flush=True)
            break
        if links == cfg.kaggle.max_links:  # no next link: stop where folds are still left
            left = workflow.chains_left(cfg, build_dir, fetched)
            if left:
                raise workflow.WorkflowError(
                    f"folds are still left after kaggle.max_links={links} links of the training kernel(s) in "
                    f"{', '.join(str(build_dir / name) for name in left)}. Fix: `tpu2gpu continue --build "
                    f"{build_dir} --out {fetched}` with this config goes on, or a larger kaggle.max_links"
                )
            break
        running = workflow.continue_chains(cfg, build_dir, fetched)  # the chains whose fetched run left folds
        if not running:
            break
    workflow.publish_export(
        workflow.fetched_exports(build_dir, fetched),
        build_dir / "dataset" / "dataset-metadata.json",
        f"{cfg.kaggle.owner}/{cfg.kaggle.model_dataset}",
        args.message,
        args.dry_run,
    )
    version = workflow.push(build_dir, "infer", args.dry_run)
    workflow.wait(workflow.kernel_ref(cfg, "infer", build_dir), args.interval, dry_run=args.dry_run)
    if not args.submit:
        return 0
    infer_out = Path(args.infer_out)
    if not cfg.kaggle.code_competition:  # a file competition: upload what the kernel wrote
        workflow.fetch(workflow.kernel_ref(cfg, "infer", build_dir), infer_out, args.dry_run)
    elif args.dry_run:  # no push ran, so no version is known: say where it comes from instead of inventing one
        print(
            f"# then: kaggle competitions submit {cfg.kaggle.competition} -k {workflow.kernel_ref(cfg, 'infer')} "
            f"-f {cfg.infer.submission} -v <the version the push above reports> -m {args.message}",
            flush=True,
        )
        return 0
    workflow.submit(cfg, build_dir, version or 0, args.message, infer_out / cfg.infer.submission, args.dry_run)
    return 0


# ---------------------------------------------------------------------------------------------------------- parser
def _step(steps, name: str, help_text: str, func, config: bool = True, **options) -> argparse.ArgumentParser:
    """A step's parser, run by func: with the config flags (--config, --set) unless config=False."""
    step = steps.add_parser(name, help=help_text, **options)
    if config:
        add_config_flags(step)
    step.set_defaults(func=func)
    return step


def _kaggle_step(steps, name: str, help_text: str, func, kernel: bool = False) -> argparse.ArgumentParser:
    """A step that runs the kaggle CLI: --dry-run, --build and, where it acts on one of the kernels, --kernel."""
    step = _step(steps, name, help_text, func)
    step.add_argument("--dry-run", action="store_true", help="print the kaggle CLI commands instead of running")
    step.add_argument("--build", default="build", help="build folder (default: %(default)s)")
    if kernel:
        step.add_argument("--kernel", choices=("train", "infer"), default="train")
    return step


def _local_steps(steps) -> None:
    """The steps on this machine: config, environment, data, the kernels' build."""
    p = _step(steps, "config", "print the resolved config (defaults < --config file < --set)", cmd_config)
    p.add_argument("--reference", action="store_true", help="print every key, its default and meaning (markdown)")
    _step(steps, "env", "print the environment block: versions, devices, strategy, replicas", cmd_env)
    p = _step(
        steps,
        "train",
        "run the training kernel here: one process, or N training together (keras_jax, torch)",
        cmd_train,
        description="The training kernel on this machine. With --processes N > 1, N processes on "
        "127.0.0.1 train together as the hosts of a pod slice or several GPU nodes would: keras_jax with "
        "runtime.cpu_devices / N CPU devices each, torch as N torchrun nodes (gloo on the CPU); logs are "
        "prefixed [pK] and the first failure stops the rest.",
    )
    p.add_argument("--processes", type=int, default=1, help="processes to train with (default: %(default)s)")
    p = _step(
        steps, "demo-data", "write the embedded demo competition (Kaggle layout, digits)", cmd_demo_data, config=False
    )
    p.add_argument("--out", default=str(DEFAULT_DEMO_DIR), help="folder to write (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="rewrite it even if complete")
    p = _step(
        steps,
        "tfrecords",
        "convert a competition folder (CSV + images, or class folders) into sharded TFRecords",
        cmd_tfrecords,
        description="Convert a Kaggle-style competition (a CSV of ids and labels and a folder of JPEG/PNG "
        "images, or the images in one folder per class; a test folder) into TFRecord shards with a manifest. "
        "Column names, layout, folds, shard size and re-encoding come from the data section of the config.",
    )
    p.add_argument(
        "--competition",
        metavar="DIR",
        help="competition folder (default: runtime.competition_dir, else the embedded demo)",
    )
    p.add_argument("--out", metavar="DIR", help="output folder (default: runtime.tfrecords, else <competition>-tfrec)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p = _step(
        steps,
        "verify-records",
        "check TFRecords against their manifest.json: every shard present and of its "
        "size (before an upload, after a download)",
        cmd_verify_records,
        config=False,
    )
    p.add_argument("--records", required=True, metavar="DIR", help="a `tpu2gpu tfrecords` folder")
    p.add_argument("--full", action="store_true", help="also read every record back (its CRC): seconds per GB")
    p = _step(
        steps,
        "augment-preview",
        "draw a grid of augmented (and mixed) training images with their targets",
        cmd_augment_preview,
    )
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--cols", type=int, default=6)
    p = _step(steps, "build", "write both kernel scripts and all Kaggle metadata into build/", cmd_build)
    p.add_argument("--out", default="build", help="build folder (default: %(default)s)")


def _kernel_steps(steps) -> None:
    """A built kernel's way through Kaggle: pushed, waited for, its output fetched, its export checked and published."""
    _kaggle_step(steps, "push", "kaggle kernels push a built kernel", cmd_push, kernel=True)
    p = _kaggle_step(steps, "wait", "poll kaggle kernels status until the kernel completes", cmd_wait, kernel=True)
    p.add_argument("--interval", type=float, default=60.0, help="seconds between polls")
    p = _kaggle_step(
        steps, "fetch", "kaggle kernels output: download a kernel's outputs and log", cmd_fetch, kernel=True
    )
    p.add_argument("--out", default="runs/kaggle/train", help="download folder (default: %(default)s)")
    p = _kaggle_step(
        steps,
        "continue",
        "build and push the next link of a training chain: the folds a fetched run left (cut, not started)",
        cmd_continue,
    )
    p.add_argument("--out", default="runs/kaggle/train", help="the fetched run to continue (default: %(default)s)")
    p = _step(
        steps,
        "verify-export",
        "check that every fold export is complete and show its card",
        cmd_verify_export,
        config=False,
    )
    p.add_argument("--export", default="runs/kaggle/train/export", help="export folder (default: %(default)s)")
    p = _kaggle_step(
        steps, "publish", "verify the export and create / version the model dataset (--dir-mode zip)", cmd_publish
    )
    p.add_argument(
        "--export",
        action="append",
        default=[],
        help="an export folder to publish (repeatable: several runs' folds gathered into one dataset; default: "
        "each training kernel's fetched run under --out)",
    )
    p.add_argument("--out", default="runs/kaggle/train", help="where `fetch` put the runs (default: %(default)s)")
    p.add_argument(
        "--allow-missing", action="store_true", help="publish the folds there are when a run left some untrained"
    )
    p.add_argument("-m", "--message", default="tpu2gpu export")
    p = _step(
        steps,
        "blend",
        "weigh several runs' exports on their out-of-fold predictions (hill climbing), for one model dataset",
        cmd_blend,
        config=False,
    )
    p.add_argument("runs", nargs="+", metavar="EXPORT", help="a run's export folder (its fold*/), e.g. runs/a/export")
    p.add_argument("--name", action="append", default=[], help="a run's name in the table (repeatable, in order)")
    p.add_argument("--out", default="runs/blend", help="the blend's model dataset folder (default: %(default)s)")
    p.add_argument("--splits", type=int, default=5, help="splits the weights are held out on (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the splits' seed (default: %(default)s)")


def _wheels_steps(steps) -> None:
    """The TPU stack's wheels, downloaded into a dataset folder and published for the training kernel."""
    p = _step(
        steps,
        "wheels",
        "download the TPU stack's wheels (kaggle.tpu_packages) for Kaggle's TPU image into a dataset folder",
        cmd_wheels,
    )
    p.add_argument("--out", default="build/tpu-wheels", help="dataset folder to write (default: %(default)s)")
    p.add_argument("--python", default=IMAGE_PYTHON, help="the TPU image's Python (default: %(default)s)")
    p.add_argument(
        "--platform",
        action="append",
        default=[],
        help="pip --platform tags (repeatable; default: manylinux x86_64 tags)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    p.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    p = _kaggle_step(
        steps, "publish-wheels", "create / version the wheels dataset (kaggle.tpu_wheels)", cmd_publish_wheels
    )
    p.add_argument(
        "--wheels", default="build/tpu-wheels", help="folder made by `tpu2gpu wheels` (default: %(default)s)"
    )
    p.add_argument("-m", "--message", default="tpu2gpu TPU wheels")


def _submission_steps(steps) -> None:
    """The submission, and the whole workflow that ends in it."""
    p = _kaggle_step(
        steps,
        "submit",
        "submit to the competition: the pushed inference kernel (code competition) or its fetched submission.csv",
        cmd_submit,
    )
    p.add_argument("-m", "--message", default="tpu2gpu submission")
    p.add_argument(
        "--version",
        type=int,
        default=0,
        help="inference kernel version (default: the one `push --kernel infer` recorded)",
    )
    p.add_argument(
        "--file",
        default="runs/kaggle/infer/submission.csv",
        help="file to upload when the competition "
        "is not a code competition (default: %(default)s, where `fetch --kernel infer --out "
        "runs/kaggle/infer` puts it)",
    )
    p = _kaggle_step(
        steps, "workflow", "build, push train, wait, fetch, publish, push infer, wait (, submit)", cmd_workflow
    )
    p.add_argument("--out", default="runs/kaggle/train", help="where the training output is downloaded")
    p.add_argument(
        "--infer-out", default="runs/kaggle/infer", help="where the inference output is downloaded (file competitions)"
    )
    p.add_argument("--interval", type=float, default=60.0)
    p.add_argument("-m", "--message", default="tpu2gpu")
    p.add_argument("--submit", action="store_true", help="submit to the competition at the end")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpu2gpu", description="Train on Kaggle's TPU, submit from a GPU kernel.")
    steps = parser.add_subparsers(dest="command", metavar="STEP", required=True)
    for add_steps in (_local_steps, _kernel_steps, _wheels_steps, _submission_steps):  # in the order --help lists
        add_steps(steps)
    return parser


def main(argv: list[str] | None = None) -> int:
    from common.launch.kernel import guarded

    args = build_parser().parse_args(argv)
    try:
        return guarded(f"tpu2gpu {args.command}", args.func, args)
    except FileExistsError as err:  # an output that --overwrite would replace: the user's call
        print(f"tpu2gpu {args.command}: error: {err}", file=sys.stderr)
        return 2


def run() -> None:
    """The `tpu2gpu` command (pyproject's console script) and `python -m tpu2gpu.cli`: main's exit code ends the
    process (common.core.errors.run_entry), whatever threads a step left behind."""
    from common.core.errors import run_entry

    run_entry("tpu2gpu", main)


if __name__ == "__main__":
    run()
