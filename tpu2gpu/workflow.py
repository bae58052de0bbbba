"""The Kaggle workflow, each step a thin wrapper over the official `kaggle` CLI run as a subprocess.

    once: tpu2gpu wheels -> publish (the TPU stack's wheels dataset, kaggle.tpu_wheels)
    push train -> wait train -> fetch train -> publish (model dataset) -> push infer -> wait infer -> submit

Every command is printed before it runs; with dry_run it is only printed. A failing CLI call stops the chain with the
CLI's own message, including the failures the CLI reports with exit code 0 ("Kernel push error: ...", "Dataset
creation error: ..."). `push` records the version Kaggle gave the kernel (build/<kernel>/pushed.json, gone with the
next build): a code-competition submission names it. Credentials stay where the CLI reads them
(~/.kaggle/kaggle.json or KAGGLE_USERNAME / KAGGLE_KEY): nothing here reads, prints or passes them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common.core.atomic import staged_dir
from common.core.config import Config
from common.core.errors import UserError
from common.export.card import read_card
from common.inference.blend import BLEND_NAME, member_weights, read_blend

STATUSES = ("QUEUED", "RUNNING", "COMPLETE", "ERROR", "CANCEL_REQUESTED", "CANCEL_ACKNOWLEDGED")


class WorkflowError(UserError, RuntimeError):
    """A kaggle CLI call that failed, or a step whose result is not usable."""


def kaggle_executable() -> str:
    beside = Path(sys.executable).parent / "kaggle"  # the CLI installed with this project
    return str(beside) if beside.exists() else "kaggle"


# Failures the kaggle CLI (2.2.4) prints but exits 0 on (kaggle_api_extended.py), and sources it silently dropped.
_SILENT_FAILURES = re.compile(
    r"^(Kernel push error|Dataset creation error|Dataset version creation error|"
    r"The following are not valid .* sources|Upload unsuccessful|"
    r"Could not submit to competition|Could not find competition)",
    re.M,
)
PUSHED_NAME = "pushed.json"
LINKS_NAME = "links.json"


# Kaggle's limit on an account's batch sessions at once (1 TPU, 2 GPU), in the push's answer on stdout.
_SESSION_LIMIT = re.compile(r"Maximum batch (\w+) session count of (\d+) reached")


def run_kaggle(args: list[str], dry_run: bool = False) -> str:
    command = [kaggle_executable(), *args]
    print("$ " + shlex.join(["kaggle", *args]), flush=True)
    if dry_run:
        return ""
    result = subprocess.run(command, capture_output=True, text=True)
    output = (result.stdout + result.stderr).strip()
    limit = _SESSION_LIMIT.search(output)
    if limit:
        raise WorkflowError(
            f"`kaggle {shlex.join(args)}`: Kaggle runs at most {limit.group(2)} {limit.group(1)} batch session(s) of "
            f'an account at once, and that many run now ("{limit.group(0)}"). Fix: `tpu2gpu wait` for one of '
            "them to end, then push again"
        )
    if result.returncode != 0 or _SILENT_FAILURES.search(result.stdout):
        raise WorkflowError(f"`kaggle {shlex.join(args)}` failed (exit {result.returncode}): {output[-1500:]}")
    if output:
        print(output, flush=True)
    return result.stdout


def kernel_ref(cfg: Config, kernel: str, build_dir: Path | None = None) -> str:
    """owner/slug of the kernel: the one built in build_dir where there is one (a chain's link has a slug of its
    own), else the config's."""
    built = Path(build_dir) / kernel / "kernel-metadata.json" if build_dir is not None else None
    if built is not None and built.is_file():
        return json.loads(built.read_text())["id"]
    slug = cfg.kaggle.train_kernel if kernel.startswith("train") else cfg.kaggle.infer_kernel
    return f"{cfg.kaggle.owner}/{slug}"


def push(build_dir: Path, kernel: str, dry_run: bool = False) -> int | None:
    """kaggle kernels push; returns the kernel version Kaggle reports and records it beside the built kernel."""
    folder = Path(build_dir) / kernel
    if not dry_run and not (folder / "kernel-metadata.json").is_file():
        raise WorkflowError(f"{folder} holds no kernel-metadata.json. Fix: run `tpu2gpu build` first")
    try:
        output = run_kaggle(["kernels", "push", "-p", str(folder)], dry_run)
    except WorkflowError as err:  # over Kaggle's sessions at once: say which of this build's kernels were pushed
        pushed = [p.parent.name for p in sorted(Path(build_dir).glob(f"*/{PUSHED_NAME}"))]
        if not _SESSION_LIMIT.search(str(err)) or not pushed:
            raise
        raise WorkflowError(f"{err} (pushed from {build_dir} since its build: {', '.join(pushed)})") from None
    if dry_run:
        return None
    found = re.search(r"Kernel version (\d+) successfully pushed", output)
    if not found:
        raise WorkflowError(
            f"`kaggle kernels push` reported no version number: {output[-500:]!r}. Fix: look the "
            "version up on the kernel's page and pass it as --version"
        )
    version = int(found.group(1))
    (folder / PUSHED_NAME).write_text(json.dumps({"kernel": kernel, "version": version}) + "\n")
    if kernel.startswith("train"):  # the chain's links so far, each kernel with the version Kaggle gave it
        ref = json.loads((folder / "kernel-metadata.json").read_text())["id"]
        links = [*chain_links(folder), {"kernel": ref, "version": version}]
        (folder / LINKS_NAME).write_text(json.dumps(links, indent=1) + "\n")
    return version


def chain_links(folder: Path) -> list[dict]:
    """The links a training kernel's chain has pushed ({"kernel", "version"} each; build/<kernel>/links.json): the
    kernels cannot know their own versions, so the record of which version trained which epochs is kept here."""
    record = Path(folder) / LINKS_NAME
    return json.loads(record.read_text()) if record.is_file() else []


def pushed_version(build_dir: Path, kernel: str = "infer") -> int | None:
    """The version the last `push` of this build got (None: not pushed since it was built)."""
    record = Path(build_dir) / kernel / PUSHED_NAME
    return json.loads(record.read_text())["version"] if record.is_file() else None


def parse_status(output: str) -> str:
    """The status word in `kaggle kernels status` output, e.g. 'owner/slug has status "KernelWorkerStatus.COMPLETE"'."""
    found = re.findall(r"\b(" + "|".join(STATUSES) + r")\b", output.upper())
    if not found:
        raise WorkflowError(f"no kernel status in the CLI's answer: {output[-300:]!r}")
    return found[-1]


def wait(ref: str, interval: float = 60.0, timeout_hours: float = 24.0, dry_run: bool = False) -> str:
    """Poll until the kernel is COMPLETE (returned) or failed (raised), printing one progress line per poll; at most
    timeout_hours (a GPU session's 12 h and the time it waits in Kaggle's queue)."""
    if dry_run:
        run_kaggle(["kernels", "status", ref], dry_run=True)
        return "COMPLETE"
    start = time.monotonic()
    while True:
        output = subprocess.run([kaggle_executable(), "kernels", "status", ref], capture_output=True, text=True)
        if output.returncode != 0:
            raise WorkflowError(f"`kaggle kernels status {ref}` failed: {(output.stdout + output.stderr)[-800:]}")
        status = parse_status(output.stdout)
        elapsed = time.monotonic() - start
        print(f"[wait] {ref}: {status} after {elapsed / 60:.1f} min", flush=True)
        if status == "COMPLETE":
            return status
        if status in ("ERROR", "CANCEL_REQUESTED", "CANCEL_ACKNOWLEDGED"):
            raise WorkflowError(
                f"kernel {ref} ended with {status}: {output.stdout.strip()[-800:]}. Its log: "
                f"`kaggle kernels output {ref} -p <dir>`"
            )
        if elapsed > timeout_hours * 3600:
            raise WorkflowError(f"kernel {ref} still {status} after {timeout_hours} h")
        time.sleep(interval)


def kernel_folders(build_dir: Path, kernel: str) -> list[str]:
    """The built folders a step acts on: ['infer'], or every training kernel of the build (['train'], or
    ['train-p1', 'train-p2', ...] for kaggle.train_parts)."""
    if kernel == "infer":
        return ["infer"]
    built = sorted(p.name for p in Path(build_dir).glob("train*") if (p / "kernel-metadata.json").is_file())
    return built or ["train"]


def fetched_folder(out_dir: Path, folders: list[str], folder: str) -> Path:
    """Where a training kernel's output is fetched: out_dir itself, or out_dir/<folder> where there are several."""
    return Path(out_dir) if len(folders) == 1 else Path(out_dir) / folder


def fetch(ref: str, out_dir: Path, dry_run: bool = False) -> Path:
    """The kernel's latest output into out_dir. A training run's output (export/training_report.json) replaces what
    out_dir held, since a chain's later link is a whole run of its own and files of the link before must not mix
    with it; any other output is written over what is there."""
    out_dir = Path(out_dir)
    if dry_run:
        run_kaggle(["kernels", "output", ref, "-p", str(out_dir), "-o"], dry_run)
        return out_dir
    download = out_dir.parent / f".{out_dir.name}.download"
    shutil.rmtree(download, ignore_errors=True)
    download.mkdir(parents=True)
    try:
        run_kaggle(["kernels", "output", ref, "-p", str(download), "-o"])
        if (download / "export" / "training_report.json").is_file():
            with staged_dir(out_dir, overwrite=True) as tmp:
                shutil.copytree(download, tmp, dirs_exist_ok=True)
        else:
            shutil.copytree(download, out_dir, dirs_exist_ok=True)
    finally:
        shutil.rmtree(download, ignore_errors=True)
    return out_dir


def chain_link(base: str, slug: str) -> int | None:
    """Which link of the chain of kernel `base` the kernel `slug` is: 1 for base itself, n for <base>-n; None for a
    kernel of another chain."""
    if slug == base:
        return 1
    found = re.fullmatch(re.escape(base) + r"-(\d+)", slug)
    return int(found.group(1)) if found and int(found.group(1)) >= 2 else None


def next_link(cfg: Config, fetched: Path) -> tuple[Config | None, dict]:
    """The config of the chain's next link after the run fetched into `fetched` (its export/training_report.json):
    the same run as the next slug (<kaggle.train_kernel>-2, -3, ...; its title to match), attaching the fetched link's
    kernel and continuing from it (runtime.continue_from). (None, report) where the report leaves no fold."""
    path = Path(fetched) / "export" / "training_report.json"
    if not path.is_file():
        raise WorkflowError(
            f"{fetched} holds no export/training_report.json: no ended run was fetched there. Fix: `tpu2gpu fetch "
            f"--out {fetched}` once the training kernel's version ended COMPLETE (`tpu2gpu wait`)"
        )
    report = json.loads(path.read_text())
    if not report.get("cut") and not report.get("not_started"):
        return None, report
    base, previous = cfg.kaggle.train_kernel, report["config"]["kaggle"]["train_kernel"]
    link = chain_link(base, previous)
    if link is None:
        raise WorkflowError(
            f"the run in {fetched} was trained by the kernel {previous!r}, which is no link of {base!r}'s chain "
            f"(kaggle.train_kernel, then {base}-2, {base}-3, ...). Fix: the config that run was built from"
        )
    title = f"{cfg.kaggle.train_title or base.replace('-', ' ')} {link + 1}"
    kaggle = dataclasses.replace(cfg.kaggle, train_kernel=f"{base}-{link + 1}", train_title=title)
    runtime = dataclasses.replace(cfg.runtime, continue_from=f"{cfg.kaggle.owner}/{previous}")
    return dataclasses.replace(cfg, kaggle=kaggle, runtime=runtime), report


def continue_chains(cfg: Config, build_dir: Path, out_dir: Path, dry_run: bool = False) -> list[str]:
    """`tpu2gpu continue`: for each training kernel of the build whose fetched run left folds, the next link built
    from the same config (tpu2gpu/parts.py: its part) and pushed. Returns the build folders pushed."""
    from tpu2gpu.parts import training_kernels

    folders, pushed = kernel_folders(build_dir, "train"), []
    for trainer in training_kernels(cfg):
        fetched = fetched_folder(out_dir, folders, trainer.folder)
        link, report = next_link(trainer.cfg, fetched)
        if link is None:
            print(f"[continue] {fetched}: no fold left ({len(report['folds'])} exported)", flush=True)
            continue
        left = [f"fold {f} (cut)" for f in report.get("cut", [])] + [f"fold {f}" for f in report["not_started"]]
        folder, ref = Path(build_dir) / trainer.folder, f"{link.kaggle.owner}/{link.kaggle.train_kernel}"
        if kernel_ref(trainer.cfg, trainer.folder, build_dir) == ref and (folder / PUSHED_NAME).is_file():
            print(f"[continue] {ref} is built and pushed already (`tpu2gpu wait`, then `fetch`)", flush=True)
            continue
        print(f"[continue] {ref} continues {link.runtime.continue_from}: {', '.join(left)} left", flush=True)
        if dry_run:  # the build stays as it is: what the link would be, and its push
            print(f"# {folder} would be built again as {ref}, kernel_sources [{link.runtime.continue_from}]")
            push(build_dir, trainer.folder, dry_run=True)
            pushed.append(trainer.folder)
            continue
        _push_link(link, Path(build_dir), trainer.folder)
        pushed.append(trainer.folder)
    return pushed


def _push_link(link: Config, build_dir: Path, name: str) -> None:
    """The link built in place of the kernel before it and pushed; a push that fails (over Kaggle's sessions at once)
    puts the previous build back, so the build names the kernels that were pushed."""
    from tpu2gpu.build import rebuild_training_kernel

    folder = build_dir / name
    links = chain_links(folder)  # kept across the link's build
    before = build_dir / f".{name}.before-link"
    shutil.rmtree(before, ignore_errors=True)
    shutil.copytree(folder, before)
    try:
        rebuild_training_kernel(link, folder)
        if links:
            (folder / LINKS_NAME).write_text(json.dumps(links, indent=1) + "\n")
        push(build_dir, name)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        before.rename(folder)
        raise
    shutil.rmtree(before, ignore_errors=True)


def chains_left(cfg: Config, build_dir: Path, out_dir: Path) -> list[str]:
    """The training kernels (their build folders) whose fetched run left folds for a next link."""
    from tpu2gpu.parts import training_kernels

    folders = kernel_folders(build_dir, "train")
    return [
        t.folder
        for t in training_kernels(cfg)
        if next_link(t.cfg, fetched_folder(out_dir, folders, t.folder))[0] is not None
    ]


def fetched_exports(build_dir: Path, out_dir: Path) -> list[Path]:
    """The export folder of each training kernel's fetched run, as `fetch` lays them out."""
    folders = kernel_folders(build_dir, "train")
    return [fetched_folder(out_dir, folders, folder) / "export" for folder in folders]


def verify_export(export_root: Path) -> list:
    """Every fold export under export_root must be complete (the training kernel marks it after checking)."""
    folds = sorted(p for p in Path(export_root).glob("fold*") if p.is_dir())
    if not folds:
        raise WorkflowError(f"no fold export in {export_root}: the training run produced none (see its log)")
    return [read_card(fold) for fold in folds]


def publish(
    folder: Path,
    dataset_metadata: Path | None,
    dataset_ref: str,
    message: str,
    dir_mode: bool = True,
    dry_run: bool = False,
) -> str:
    """Create the dataset, or add a version. Sub-folders (SavedModels) need --dir-mode zip: without it the CLI skips
    them. dataset_metadata, when given, is copied into the folder first."""
    if not dry_run and dataset_metadata is not None:
        shutil.copyfile(dataset_metadata, Path(folder) / "dataset-metadata.json")
    zipped = ["--dir-mode", "zip"] if dir_mode else []
    if dry_run:
        run_kaggle(["datasets", "status", dataset_ref], dry_run=True)
        print("# then, if it exists (else `kaggle datasets create -p ...`):", flush=True)
        exists = True
    else:
        status = subprocess.run(
            [kaggle_executable(), "datasets", "status", dataset_ref], capture_output=True, text=True
        )
        if status.returncode != 0 and "404" not in status.stdout + status.stderr:  # 404: not created yet
            raise WorkflowError(
                f"`kaggle datasets status {dataset_ref}` failed: {(status.stdout + status.stderr).strip()[-800:]}"
            )
        exists = status.returncode == 0
    if exists:
        return run_kaggle(["datasets", "version", "-p", str(folder), "-m", message, *zipped], dry_run)
    return run_kaggle(["datasets", "create", "-p", str(folder), *zipped], dry_run)


def _planned_folds(export_root: Path) -> set[int]:
    """The folds the run in export_root set out to train, by its training report (those it trained, cut or did not
    start); none where it has no report."""
    path = Path(export_root) / "training_report.json"
    if not path.is_file():
        return set()
    report = json.loads(path.read_text())
    return {int(name.removeprefix("fold")) for name in report["folds"]} | set(report.get("not_started", []))


def one_ensemble(export_roots: list[Path], allow_missing: bool = False) -> list[Path]:
    """Every fold export under export_roots (each complete), checked to make one ensemble: one task, one class list
    and label schema, each fold once, and every fold the runs set out to train (unless allow_missing). Several
    problems are one message."""
    exports = [fold for root in export_roots for fold in sorted(p for p in Path(root).glob("fold*") if p.is_dir())]
    if not exports:
        raise WorkflowError(
            f"no fold export in {', '.join(str(r) for r in export_roots)}: the training run produced none (see its log)"
        )
    cards = {export: read_card(export) for export in exports}
    first, card = exports[0], cards[exports[0]]
    problems, owners, planned = [], {}, set()
    for root in export_roots:
        planned.update(_planned_folds(root))
    for export, other in cards.items():
        owners.setdefault(other.fold, []).append(export)
        for what, mine, theirs in (
            ("task", other.task, card.task),
            ("class names", other.class_names, card.class_names),
            ("label schema", (other.label_type, other.record_schema), (card.label_type, card.record_schema)),
        ):
            if mine != theirs:
                problems.append(f"{export} has other {what} than {first} ({str(mine)[:80]} against {str(theirs)[:80]})")
    problems += [f"fold {f} is exported twice ({' and '.join(map(str, e))})" for f, e in owners.items() if len(e) > 1]
    missing = sorted(planned - set(owners))
    if missing and allow_missing:
        print(f"[publish] fold(s) {missing} missing: the model dataset holds the folds there are", flush=True)
    elif missing:
        problems += [f"fold {f} is missing (planned, not exported; --allow-missing publishes without)" for f in missing]
    if problems:
        raise WorkflowError(
            "the exports do not make one ensemble: "
            + "; ".join(problems)
            + ". Fix: publish the folds of one competition's runs, each fold once (`tpu2gpu continue` trains the "
            "folds a run left)"
        )
    return exports


def gather(export_roots: list[Path], into: Path, allow_missing: bool = False) -> Path:
    """One model dataset folder of the folds under several export roots (several kernels' runs), checked as one
    ensemble first; a single root is published as it is."""
    exports = one_ensemble(export_roots, allow_missing)
    if len(export_roots) == 1:
        return Path(export_roots[0])
    with staged_dir(into, overwrite=True) as tmp:
        for export in exports:
            shutil.copytree(export, tmp / export.name)
        sources = {export.name: str(export) for export in exports}
        (tmp / "gathered.json").write_text(json.dumps({"folds": sources}, indent=2) + "\n")
    print(f"[publish] {len(exports)} fold(s) of {len(export_roots)} runs gathered in {into}", flush=True)
    return Path(into)


def blend_dataset(roots: list[Path]) -> Path:
    """A blend's folder (`tpu2gpu blend`), published as it is once every fold it weighs is there and complete."""
    if len(roots) > 1:
        raise WorkflowError(
            f"{', '.join(map(str, roots))}: a blend's folder is published alone (it holds its runs' folds). Fix: "
            "--export <the blend folder> only"
        )
    blend = read_blend(roots[0] / BLEND_NAME)
    exports = [fold for run in roots[0].iterdir() if run.is_dir() for fold in sorted(run.glob("fold*"))]
    for export in exports:
        read_card(export)  # complete, or one error naming it
    member_weights(blend, exports)  # every weighted fold there, nothing else
    return roots[0]


def publish_export(
    export_roots: list[Path],
    dataset_metadata: Path,
    dataset_ref: str,
    message: str,
    dry_run: bool = False,
    allow_missing: bool = False,
) -> str:
    """The model dataset: the fold exports of every run given, checked complete and one ensemble, gathered into one
    folder where there are several, before anything is uploaded."""
    roots = [Path(r) for r in export_roots]
    folder = roots[0] if len(roots) == 1 else roots[0].parent.parent / "model-dataset"
    if any((root / BLEND_NAME).is_file() for root in roots):
        folder = blend_dataset(roots)
    elif not dry_run:
        gather(roots, folder, allow_missing)
    return publish(folder, dataset_metadata, dataset_ref, message, dir_mode=True, dry_run=dry_run)


def submit(
    cfg: Config, build_dir: Path, version: int, message: str, submission_file: Path, dry_run: bool = False
) -> str:
    """A code competition: the inference kernel's version (`version`, else the one `push` recorded) is submitted and
    Kaggle re-runs it on the hidden test set. Any other competition: submission_file (the inference kernel's
    submission.csv, downloaded by `fetch --kernel infer`) is uploaded."""
    competition = cfg.kaggle.competition
    if not competition:
        raise WorkflowError("kaggle.competition is empty: set it to the competition slug")
    if not cfg.kaggle.code_competition:
        if not dry_run and not Path(submission_file).is_file():
            raise WorkflowError(
                f"{submission_file} does not exist. Fix: `tpu2gpu fetch --kernel infer --out "
                f"{Path(submission_file).parent}` downloads the inference kernel's submission first"
            )
        return run_kaggle(["competitions", "submit", competition, "-f", str(submission_file), "-m", message], dry_run)
    version = version or pushed_version(build_dir, "infer")
    if not version:
        raise WorkflowError(
            f"a code-competition submission names the inference kernel's version, and no push of "
            f"{Path(build_dir) / 'infer'} is recorded. Fix: `tpu2gpu push --kernel infer` first (it "
            "records the version), or pass --version N"
        )
    return run_kaggle(
        [
            "competitions",
            "submit",
            competition,
            "-k",
            kernel_ref(cfg, "infer"),
            "-f",
            cfg.infer.submission,
            "-v",
            str(version),
            "-m",
            message,
        ],
        dry_run,
    )
