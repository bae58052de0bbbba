"""Data the tests build and read back themselves: small Kaggle-style competitions (random images, or the demo's digits
under other competitions' columns and task types), CSV files, the records a conversion wrote, and what an export
predicts in a process with TensorFlow alone. No network, no downloads: every file is made here from a seed."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.core.children import BLOCKED_IN_CHECK

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
# The suite's tiny training run: fold 0, 2 epochs of 4 steps of 16 images at 16 px (the trained_export fixture, the
# train_argv runs, the loopback Kaggle project's kernels).
TINY_RUN = [
    "data.image_size=16",
    "train.fold=0",
    "train.epochs=2",
    "train.steps_per_epoch=4",
    "train.batch_size_per_replica=16",
    "train.learning_rate=0.05",
]
# A fresh interpreter with TensorFlow alone (no tf_keras, TF Hub, Keras 3 or JAX), as on a GPU image that lacks them.
TENSORFLOW_ALONE = f"import sys; sys.modules.update(dict.fromkeys({BLOCKED_IN_CHECK!r})); "


def checkout_copy(destination: Path, link_venv: bool = False) -> Path:
    """This checkout's tracked and unignored files (what a clone of it holds, uncommitted changes included), and with
    link_venv its .venv linked in: commands run there write runs/ and build/ there, not into the user's checkout."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, destination / name)
    if link_venv:
        stamp = f".installed-{hashlib.sha256((REPO / 'pyproject.toml').read_bytes()).hexdigest()[:16]}-dev"
        # ./dev in the copy would install into the shared .venv from the copy, pointing its editable install there.
        assert (REPO / ".venv" / stamp).is_file(), (
            ".venv was not installed from this pyproject.toml (./dev stamps its install), and ./dev in the copy "
            "would install it from the copy. Fix: run ./dev test (or ./dev --help) once, then pytest"
        )
        (destination / ".venv").symlink_to(REPO / ".venv")
    return destination


def kill_after_epochs(
    command: list[str],
    progress: Path,
    epochs: int,
    timeout: float = 300,
    env: dict | None = None,
    log: Path | None = None,
) -> int:
    """Start a training run (or the demo) in `env` (default: this one), its output in `log` (default: none), SIGKILL
    it and every process it started once its progress.json counts `epochs` checkpointed epochs (a session that ends,
    or worse), and return the epochs its checkpoint holds."""
    output = log.open("w") if log else subprocess.DEVNULL
    run = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while not (progress.is_file() and json.loads(progress.read_text())["epochs_done"] >= epochs):
            assert run.poll() is None and time.monotonic() < deadline, f"the run ended before epoch {epochs}" + (
                f":\n{log.read_text()[-4000:]}" if log else ""
            )
            time.sleep(0.05)
    finally:
        kill_tree(run.pid)
        run.wait()
        if log:
            output.close()
    return json.loads(progress.read_text())["epochs_done"]


def kill_tree(root: int) -> None:
    """SIGKILL a process and all its descendants, stopped first so none goes on or starts another meanwhile."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
        except OSError:  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, index = [root], 0
    while index < len(tree):
        tree += children.get(tree[index], [])
        index += 1
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def run_inference_kernel(argv: list[str]) -> subprocess.CompletedProcess:
    """infer_gpu.infer's main(argv) in a fresh interpreter with TensorFlow alone (TENSORFLOW_ALONE)."""
    return run_inference_kernels([argv])


def run_inference_kernels(argvs: list[list[str]], blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """main(argv) for each argv in turn, in one such interpreter (TensorFlow imported once), where the `blocked`
    modules cannot be imported either; it stops at the first that fails."""
    code = (
        TENSORFLOW_ALONE
        + "".join(f"sys.modules[{name!r}] = None; " for name in blocked)
        + f"from infer_gpu.infer import main; sys.exit(next(filter(None, map(main, {argvs!r})), 0))"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)


def image_bytes(seed: int, size: int = 16, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, format=fmt)
    return out.getvalue()


def write_competition(root: Path, labels: list, size: int = 16, fmt: str = "JPEG", n_test: int = 5) -> Path:
    """train.csv (id,label), train/<id>.<ext>, test/<id>.<ext>, sample_submission.csv."""
    ext = ".jpg" if fmt == "JPEG" else ".png"
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    ids = [f"img{i:03d}" for i in range(len(labels))]
    for i, sample_id in enumerate(ids):
        (root / "train" / f"{sample_id}{ext}").write_bytes(image_bytes(i, size, fmt))
    test_ids = [f"t{i:03d}" for i in range(n_test)]
    for i, sample_id in enumerate(test_ids):
        (root / "test" / f"{sample_id}{ext}").write_bytes(image_bytes(1000 + i, size, fmt))
    write_csv(root / "train.csv", ["id", "label"], zip(ids, labels, strict=True))
    write_csv(root / "sample_submission.csv", ["id", "label"], [(t, labels[0]) for t in reversed(test_ids)])
    return root


def write_csv(path: Path, header, rows) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def read_records(files, schema=None, labeled=True) -> list[dict]:
    """Every record of the files, parsed with the project's own parser: [{'id', 'image' (bytes), 'label'?}]."""
    from common.data.pipeline import parse_record
    from common.data.records import RecordSchema

    import tensorflow as tf

    schema = schema or RecordSchema()
    dataset = tf.data.TFRecordDataset([str(f) for f in files]).map(lambda r: parse_record(r, schema, labeled))
    return [{k: (v.decode() if k == "id" else v) for k, v in r.items()} for r in dataset.as_numpy_iterator()]


# ------------------------------------------------------------------ the demo's digits in other competitions' shapes
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def digit_labels(value: int) -> str:
    """Plant-Pathology-like label sets: parity always, 'big' from 5, 'loop' for digits drawn with a closed loop."""
    labels = ["even" if value % 2 == 0 else "odd"]
    if value >= 5:
        labels.append("big")
    if value in (0, 6, 8, 9):
        labels.append("loop")
    return " ".join(sorted(labels))


SHAPES = {
    # task: (id column, target column, target from the digit, template placeholder, extra columns)
    "binary": ("image_name", "target", lambda d: str(int(d % 2 == 0)), "0.0"),
    "multilabel": ("image", "labels", digit_labels, "even"),
    "regression": ("Id", "Pawpularity", lambda d: str(10 * d), "0"),
    "ordinal": ("id", "grade", str, "0"),  # test_tasks.py's test-only fifth task: digits as grades 0..9
}


def task_competition(demo_dir: Path, root: Path, task: str) -> tuple[Path, list[dict]]:
    """The demo's images under another competition's columns; returns (folder, held-out answers)."""
    id_col, target_col, target, placeholder = SHAPES[task]
    root.mkdir(parents=True)
    for split in ("train", "test"):
        os.symlink(demo_dir / split, root / split)
    train = read_csv(demo_dir / "train.csv")
    header = [id_col, "patient_id", target_col] if task == "binary" else [id_col, target_col]
    rows = []
    for k, row in enumerate(train):
        value = target(DIGITS.index(row["label"]))
        rows.append([row["id"], f"patient_{k // 3:04d}", value] if task == "binary" else [row["id"], value])
    write_csv(root / "train.csv", header, rows)
    solution = read_csv(demo_dir / "solution.csv")
    write_csv(root / "sample_submission.csv", [id_col, target_col], [[r["id"], placeholder] for r in solution])
    answers = [{"id": r["id"], "target": target(DIGITS.index(r["label"]))} for r in solution]
    return root, answers


# Ten of Kaggle's Plant Seedlings classes, one per digit: names with spaces and hyphens, sorted in another order than
# the digits, so the mapping from folder to class index is exercised.
PLANTS = (
    "Black-grass",
    "Charlock",
    "Cleavers",
    "Common Chickweed",
    "Common wheat",
    "Fat Hen",
    "Loose Silky-bent",
    "Maize",
    "Scentless Mayweed",
    "Shepherds Purse",
)


def plant_competitions(demo_dir: Path, root: Path, per_class: int, n_test: int) -> tuple[Path, Path, list[dict]]:
    """The demo's digits as Kaggle ships Plant Seedlings: train/<class name>/<id>.png, test/<id>.png and
    sample_submission.csv (file,species; ids with their extension), per_class training images of each class and
    n_test test images; and beside it the same images with a train.csv (file,species) listing them in the order the
    folders hold them. Returns (class folders, CSV, held-out answers {'file', 'species'})."""
    folders, with_csv = root / "folders", root / "csv"
    chosen: dict[str, list[str]] = {}
    for row in read_csv(demo_dir / "train.csv"):
        plant = PLANTS[DIGITS.index(row["label"])]
        if len(chosen.setdefault(plant, [])) < per_class:
            chosen[plant].append(f"{row['id']}.png")
    rows = [(name, plant) for plant in sorted(chosen) for name in sorted(chosen[plant])]
    for name, plant in rows:
        for target in (folders / "train" / plant / name, with_csv / "train" / name):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(demo_dir / "train" / name, target)
    answers = [
        {"file": f"{r['id']}.png", "species": PLANTS[DIGITS.index(r["label"])]}
        for r in read_csv(demo_dir / "solution.csv")[:n_test]
    ]
    for competition in (folders, with_csv):
        (competition / "test").mkdir()
        for answer in answers:
            shutil.copyfile(demo_dir / "test" / answer["file"], competition / "test" / answer["file"])
        write_csv(competition / "sample_submission.csv", ["file", "species"], [[a["file"], PLANTS[0]] for a in answers])
    write_csv(with_csv / "train.csv", ["file", "species"], rows)
    return folders, with_csv, answers


def verify_batch_difference(python, export: Path) -> float:
    """An export loaded with tf.saved_model.load by `python` in a process where jax, keras, tf_keras and
    tensorflow_hub cannot be imported: the max abs difference of its predictions from its verify batch."""
    import os
    import subprocess

    code = (
        TENSORFLOW_ALONE + "\nimport numpy as np, tensorflow as tf\n"
        f"loaded = tf.saved_model.load({str(export / 'saved_model')!r})\n"
        f"batch = np.load({str(export / 'verify_batch.npz')!r})\n"
        "out = loaded.signatures['serving_default'](images=tf.constant(batch['images']))['predictions']\n"
        "print(float(np.max(np.abs(out.numpy() - batch['predictions']))))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=export, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return float(run.stdout.strip().splitlines()[-1])


def set_args(*settings: str) -> list[str]:
    """The command line `--set key=value` for each setting, as the kernels' main and the tpu2gpu CLI take them."""
    return [arg for setting in settings for arg in ("--set", setting)]


def says(text: str, *parts: str) -> None:
    """A log line or error message says each of `parts` (the figures, the names, the fix), in this order, whatever
    words join them: what it must say, not its wording."""
    at = 0
    for part in parts:
        found = text.find(part, at)
        assert found >= 0, f"{part!r} is not in (or not in order in) the message:\n{text}"
        at = found + len(part)
