"""The offline end-to-end demo: the whole product in miniature on the embedded digits competition.

    ./dev demo            (or: .venv/bin/python -m tpu2gpu.demo [--fresh])

  1. competition folder (scikit-learn digits in Kaggle's layout)      runs/demo/competition
  2. sharded TFRecords + manifest                                      runs/demo/tfrecords
  3. backbone: a small SavedModel, loaded through hub.KerasLayer exactly as an attached EfficientNet would be
     (nothing can be downloaded here)                                  runs/demo/backbone
  4. training kernel, CPU strategy, fold 0 -> verified export          runs/demo/train/export
  5. inference kernel in a fresh process where tf_keras and tensorflow_hub cannot be imported -> submission.csv
                                                                       runs/demo/infer
  6. score: macro-F1 of submission.csv against the held-out answers (solution.csv)
  7. both Kaggle kernel bundles built                                  runs/demo/build
About a minute on 2 cores, macro-F1 about 0.98. A second run reuses the competition, backbone and a complete export
(the training kernel skips exported folds and resumes unfinished ones) and replaces the rest; --fresh starts over.

    ./dev demo --framework keras_jax      (in runs/demo-keras_jax)

trains the same way with Keras 3 on JAX (train.framework=keras_jax), the route a Kaggle TPU takes when no TensorFlow
TPU stack answers: the backbone is the same small network as a .keras file, and the export is the same contract, so
step 5 is unchanged.

    ./dev demo --framework torch_xla      (in runs/demo-torch_xla; ./dev installs torch, torch_xla, timm first)

trains a timm MobileNetV3 (random weights, as timm's save_for_hf writes it) with PyTorch/XLA on two XLA CPU devices,
which stand for the TPU's chips; the export is rebuilt under TensorFlow by keras-hub, so step 5 is unchanged.

    ./dev demo --framework torch          (in runs/demo-torch)

trains the same timm model with plain PyTorch, the route Kaggle's GPU T4 x2 takes, here on the CPU.

    ./dev demo --framework keras_jax --processes 2      (in runs/demo-keras_jax-2proc)

trains with 2 processes on 127.0.0.1, one CPU device each, as the hosts of a pod slice would (`tpu2gpu train
--processes 2`, docs/beyond-kaggle.md), on the one-process demo's global batch; the card records the processes.
`--framework torch --processes 2` does the same with two torchrun nodes and DistributedDataParallel over gloo.
`--set KEY=VALUE` (repeatable) sets a config key over the demo's own, e.g. `--set train.optimizer=adamw`.
Every step writes through a hidden temporary name, so an interrupted run leaves nothing that looks complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import common  # noqa: F401  (environment bootstrap first)
from common.core.children import BLOCKED_IN_CHECK
from common.core.config import load_config
from common.core.errors import UserError, run_entry
from common.launch.backbones import BACKBONES, resolve
from common.launch.routes import ROUTES, route_names

CONFIG = Path("configs/demo.yaml")
DEMO_ROOT = Path("runs/demo")
MIN_MACRO_F1 = 0.90
DEFAULT_FRAMEWORK = next(iter(ROUTES))  # the route table's first: tf_keras, the seeds' own route


def step(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def score(submission: Path, solution: Path) -> float:
    import csv

    from sklearn.metrics import f1_score

    def labels(path):
        with path.open(newline="") as f:
            return {row["id"]: row["label"] for row in csv.DictReader(f)}

    truth, predicted = labels(solution), labels(submission)
    ids = sorted(truth)
    return float(f1_score([truth[i] for i in ids], [predicted[i] for i in ids], average="macro"))


def demo_paths(root: Path, framework: str) -> list[str]:
    """The settings (--set) of the demo in `root` on `framework`, over configs/demo.yaml: where its inputs are, and its
    backbone."""
    return [
        f"runtime.competition_dir={root / 'competition'}",
        f"runtime.tfrecords={root / 'tfrecords'}",
        f"train.framework={framework}",
        *DemoBackbone.of(root, framework).settings,
    ]


def inference_command(root: Path, settings: list[str]) -> list[str]:
    """Step 5: the inference kernel on the export in `root`, in a fresh interpreter where tf_keras, tensorflow_hub,
    Keras 3 and JAX cannot be imported, ending as every entry point does (run_entry)."""
    infer_argv = [
        "--config",
        str(CONFIG),
        *settings,
        "--set",
        f"infer.exports=[{root / 'train' / 'export'}]",
        "--set",
        f"runtime.output_dir={root / 'infer'}",
        "--set",
        "runtime.tfrecords=",
    ]
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({BLOCKED_IN_CHECK!r})); "
        "from common.core.errors import run_entry; from infer_gpu.infer import main; "
        f"run_entry('infer', main, {infer_argv!r})"
    )
    return [sys.executable, "-c", code]


def run(root: Path, framework: str = DEFAULT_FRAMEWORK, processes: int = 1, overrides: tuple[str, ...] = ()) -> float:
    from common.data.conversion import convert_competition

    from tpu2gpu.build import build
    from tpu2gpu.demo_data import make_demo_competition

    backbone = DemoBackbone.of(root, framework)
    paths = [*demo_paths(root, framework), *overrides]
    cfg = load_config(CONFIG, paths)
    if processes > 1:  # the one-process demo's global batch, split over the processes: the same steps and rate
        paths.append(f"train.batch_size={cfg.train.batch_size_per_replica}")
    settings = [a for s in paths for a in ("--set", s)]

    step("1/7 competition folder")
    competition = make_demo_competition(root / "competition")
    print(
        f"{competition}: train.csv, train/ ({len(list((competition / 'train').iterdir()))} PNGs), test/, "
        "sample_submission.csv",
        flush=True,
    )

    step("2/7 TFRecords")
    manifest = convert_competition(competition, root / "tfrecords", cfg.data, overwrite=True)
    print(", ".join(f"{n}: {s['count']}" for n, s in manifest["splits"].items()), flush=True)

    step(f"3/7 backbone {backbone.kind}")
    print(backbone.save(backbone.path), flush=True)

    step(f"4/7 training kernel ({framework}" + (f", {processes} processes on 127.0.0.1)" if processes > 1 else ")"))
    train(
        ["--config", str(CONFIG), *settings, "--set", f"runtime.output_dir={root / 'train'}"],
        processes,
        in_child=ROUTES[framework].before_tensorflow,
        torchrun=ROUTES[framework].processes == "per_gpu",
    )

    step("5/7 inference kernel (TensorFlow alone: tf_keras, tensorflow_hub, Keras 3 and JAX blocked)")
    subprocess.run(inference_command(root, settings), check=True)

    step("6/7 score against the held-out answers")
    macro_f1 = score(root / "infer" / "submission.csv", competition / "solution.csv")
    print(f"macro-F1 {macro_f1:.4f}", flush=True)

    step("7/7 Kaggle kernel bundles")
    folders = build(cfg, root / "build", demo=True)
    for name, folder in folders.items():
        print(f"{name}: {folder}/ " + " ".join(sorted(p.name for p in folder.iterdir())), flush=True)
    return macro_f1


@dataclass(frozen=True)
class DemoBackbone:
    """The small network a route's demo trains from scratch here (nothing can be downloaded), and its settings: the
    route table's DemoSetup names the family, whose registered DemoNetwork it is."""

    path: Path
    kind: str
    settings: tuple[str, ...]
    save: Callable[[Path], Path]

    @classmethod
    def of(cls, root: Path, framework: str) -> DemoBackbone:
        demo = ROUTES[framework].demo
        network = BACKBONES[demo.backbone].demo
        path = root / network.file
        settings = (f"model.backbone={demo.backbone}", f"{network.key}={path}", *demo.settings)
        return cls(path, network.kind, settings, resolve(network.save))


def train(argv: list[str], processes: int, in_child: bool = False, torchrun: bool = False) -> None:
    """The training kernel, in this process, or in `processes` processes on 127.0.0.1 with one CPU device each (as
    `tpu2gpu train --processes N` runs them), or in a child interpreter (torch_xla: this process has imported
    TensorFlow, and torch_xla must come first)."""
    if in_child:
        subprocess.run([sys.executable, "-m", "train_tpu.train", *argv], check=True)
        return
    if processes == 1:
        from train_tpu.train import main

        main(argv)
        return
    from tpu2gpu.launcher import launch

    if launch(argv, processes, processes, torchrun=torchrun):
        raise UserError(f"the training kernel's {processes} processes did not finish (see their log above)")


def trained_by(root: Path) -> str:
    import json

    runtime = json.loads((root / "train" / "export" / "fold0" / "model_card.json").read_text())["runtime"]
    return f"trained by {runtime.get('processes', 1)} process(es)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=DEMO_ROOT, help="where the demo writes (default: %(default)s)")
    parser.add_argument("--fresh", action="store_true", help="delete the previous demo's outputs first")
    parser.add_argument(
        "--framework",
        choices=tuple(ROUTES),
        default=DEFAULT_FRAMEWORK,
        help=f"{DEFAULT_FRAMEWORK} (default), Keras 3 on JAX, or a timm model with PyTorch/XLA or plain PyTorch "
        "(written to runs/demo-<framework>)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config setting over the demo's (repeatable), e.g. --set train.optimizer=sgd",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="keras_jax, torch: train with this many processes "
        "on 127.0.0.1, as the hosts of a pod slice or GPU nodes would (runs/demo-<framework>-<N>proc)",
    )
    args = parser.parse_args(argv)
    several = route_names(lambda route: route.processes != "one")
    if args.processes > 1 and args.framework not in several:
        parser.error(
            f"--processes trains across processes on the {' and '.join(several)} routes: add --framework "
            + " or ".join(several)
        )
    for name, value in ROUTES[args.framework].environment:  # before a framework is first imported
        os.environ.setdefault(name, value)
    if args.framework != DEFAULT_FRAMEWORK and args.root == DEMO_ROOT:
        args.root = Path(f"{DEMO_ROOT}-{args.framework}" + (f"-{args.processes}proc" if args.processes > 1 else ""))
    if args.fresh:
        shutil.rmtree(args.root, ignore_errors=True)
    start = time.perf_counter()
    try:
        macro_f1 = run(args.root, args.framework, args.processes, tuple(args.overrides))
    except (UserError, subprocess.CalledProcessError) as err:
        print(f"demo: error: {err}", file=sys.stderr)
        return 2
    root = args.root
    print(
        f"""
=== done in {time.perf_counter() - start:.0f} s ===
competition     {root / "competition"}
tfrecords       {root / "tfrecords"}
backbone        {DemoBackbone.of(root, args.framework).path}
export          {root / "train" / "export" / "fold0"}  (training_report.json beside it; {trained_by(root)})
submission      {root / "infer" / "submission.csv"}
kernel bundles  {root / "build"}
macro-F1        {macro_f1:.4f} on the held-out test set (target >= {MIN_MACRO_F1})""",
        flush=True,
    )
    return 0 if macro_f1 >= MIN_MACRO_F1 else 1


if __name__ == "__main__":
    run_entry("demo", main)
