"""infer.time_limit: the inference kernel times each member's views, projects the rows against the limit and sheds
views, then members, to end within it (common/inference/time_plan.py)."""

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from common.core.config import load_config
from common.core.errors import guarded
from common.core.fields import duration_seconds
from common.inference.predict import Unit, predict_rows, time_units
from common.inference.time_plan import TimePlan, clock_text, shed_steps

import pytest

from infer_gpu.infer import main as infer_main
from tpu2gpu.backbones import save_tiny_backbone
from tpu2gpu.build import build
from train_tpu.train import main as train_main

from builders import read_csv, set_args
from fake_kaggle import PROJECT, offline

HIDDEN_COPIES = 20  # the hidden test set: the public one 20 times over (7,200 images)
VIEWS = ("flip_left_right", "flip_up_down", "rotate90", "rotate180", "rotate270", "transpose")
SHED_VIEWS = [f"view {v}" for v in reversed(VIEWS)]  # the last configured first


def test_a_time_limit_is_read_in_hours_minutes_and_seconds_and_anything_else_is_one_line(tmp_path, capsys):
    assert [duration_seconds(t) for t in ("9h", "2h30m", "45m", "90s", "1h0m30s", "1.5h", "none")] == [
        32400,
        9000,
        2700,
        90,
        3630,
        5400,
        None,
    ]
    for wrong in ("9 hours", "540", "0s", ""):
        assert guarded("infer", infer_main, ["--set", f"infer.time_limit={wrong}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"infer: error: config key 'infer.time_limit' is '{wrong}', not a length of time. Fix: hours, "
            "minutes and seconds such as 9h, 2h30m, 45m or 90s, or none for no limit"
        ], err


def test_views_are_shed_first_then_the_members_of_least_weight_then_the_worst_validation_score():
    def unit(member, view, weight, metric):
        card = SimpleNamespace(metric={"name": "log_loss", "value": metric}, image_size=16)
        return Unit(member, view, weight, card, step=None)

    # fold1 was cut by the training budget (weight 0.5); fold2's log loss is the worst of the full folds.
    folds = {"fold0": (1.0, 0.30), "fold1": (0.5, 0.20), "fold2": (1.0, 0.40), "fold3": (1.0, 0.35)}
    units = [unit(m, v, w, s) for m, (w, s) in folds.items() for v in ("identity", "flip_left_right", "rotate90")]
    steps = shed_steps(units)
    assert [what for what, _ in steps] == ["view rotate90", "view flip_left_right", "fold1", "fold2", "fold3", "fold0"]
    assert [u.name for u in steps[0][1]] == ["fold0/rotate90", "fold1/rotate90", "fold2/rotate90", "fold3/rotate90"]
    assert [u.name for u in steps[2][1]] == ["fold1/identity", "fold1/flip_left_right", "fold1/rotate90"]


def test_a_pace_that_falls_midway_sheds_more_and_each_row_averages_the_views_that_ran_on_it(capsys):
    """Two members x two views on a clock of the test's own, which each step moves on: 4 ms a batch of 8 until a
    busy neighbour makes it 40 ms from the 11th batch. The plan measures that clock as it would the real one: the
    first projection fits, the fallen pace sheds the views at the batch where the last 3 batches' pace ends past
    the plan, and each row's prediction is the weighted mean of the units that ran on its batch. (The built kernel
    on the real clock: the rerun test below.)"""
    import numpy as np
    import tensorflow as tf

    clock = SimpleNamespace(now=0.0, batches=0)

    def unit(member, view, value, weight):
        def step(images):
            if (member, view) == ("fold0", "identity"):
                clock.batches += 1
            clock.now += 0.004 if clock.batches <= 10 else 0.040
            return tf.fill([int(images.shape[0]), 1], value)

        return Unit(member, view, weight, SimpleNamespace(image_size=8, metric={}), step)

    units = [
        unit("fold0", "identity", 1.0, 1.0),
        unit("fold0", "flip_left_right", 3.0, 1.0),
        unit("fold1", "identity", 5.0, 0.5),
        unit("fold1", "flip_left_right", 7.0, 0.5),
    ]
    rows = 40 * 8
    data = tf.data.Dataset.from_tensor_slices(
        {"image": tf.zeros([rows, 8, 8, 3], tf.uint8), "id": tf.constant([f"r{i}" for i in range(rows)])}
    ).batch(8)
    plan = TimePlan(units, rows, "5s", 0.1)
    plan.clock, plan.origin = (lambda: clock.now), 0.0  # the kernel starts at 0 on the test's clock
    ids, predictions = predict_rows(units, {8: data}, plan=plan)
    out = capsys.readouterr().out
    record = plan.record()
    assert ids == [f"r{i}" for i in range(rows)] and record["within_limit"], (out, record)
    # Batch 1 is every unit's warm-up; from batch 2, 4 units x 0.5 ms an image: 304 rows left at 0.032 s end at 0.64 s.
    assert record["projection"] == {
        "at_row": 16,
        "at_seconds": 0.032,
        "ends_at_seconds": 0.64,
        "images_per_second": 500.0,
    }, record
    # Batch 13 (row 104): the last 3 batches at 40 ms, 5 ms an image for each unit, 216 rows left at 0.64 s: 4.96 s,
    # past the 4.5 s planned. Without the flipped views 2.8 s, and the remaining 27 batches take 2 x 40 ms each.
    assert record["shed"] == [
        {
            "what": ["view flip_left_right"],
            "at_row": 104,
            "at_seconds": 0.64,
            "projected_seconds": 4.96,
            "after_seconds": 2.8,
        }
    ], record
    assert round(plan.now(), 3) == 2.8 and record["finished_at_seconds"] == 2.8, record
    assert (
        "nothing to shed" in out
        and "at row 104 of 320 the pace fell: the rows would end at 5.0s, past the 4.5s "
        "planned (5s limit less infer.time_margin=0.1): shedding view flip_left_right; they now end at 2.8s"
        in out
    ), out
    # Each row: the weighted mean of the units not yet shed when its batch ran.
    values = {u: float(u.step(tf.zeros([1, 8, 8, 3]))[0, 0]) for u in units}
    for row in range(0, rows, 8):
        ran = units if row < 104 else [units[0], units[2]]
        mean = sum(values[u] * u.weight for u in ran) / sum(u.weight for u in ran)
        assert np.allclose(predictions[row : row + 8, 0], mean), (row, predictions[row : row + 8, 0], mean, record)
    assert np.allclose(predictions[:104, 0], (1 + 3 + 5 * 0.5 + 7 * 0.5) / 3)
    assert np.allclose(predictions[104:, 0], (1 + 5 * 0.5) / 1.5)


def test_a_public_test_of_one_batch_still_projects_the_hidden_set_from_a_full_batch_of_each_unit(capsys):
    """One batch of 8 public images times no unit (a batch shape's first call is its warm-up): the save run's look
    ahead repeats that batch to a full one of infer.batch_size and times each unit on it, then projects."""
    import tensorflow as tf

    def unit(view, seconds_a_batch):
        def step(images):
            time.sleep(seconds_a_batch)
            return tf.zeros([int(images.shape[0]), 1])

        return Unit("fold0", view, 1.0, SimpleNamespace(image_size=8, metric={}), step)

    units = [unit("identity", 0.004), unit("flip_left_right", 0.004)]
    data = tf.data.Dataset.from_tensor_slices(
        {"image": tf.zeros([8, 8, 8, 3], tf.uint8), "id": tf.constant([f"r{i}" for i in range(8)])}
    ).batch(32)
    plan = TimePlan(units, 8, "1h", 0.1)
    plan.origin = time.monotonic()
    predict_rows(units, {8: data}, plan=plan)
    assert all(plan.pace[u].seconds_an_image() is None for u in units)  # warm-ups only
    expected = plan.expected(100_000, lambda untimed, samples: time_units(untimed, samples, 32, None, plan))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # Each unit: a sleep of 4 ms a batch of 32, 0.125 ms an image at least: 100,000 images take 25 s or more.
    assert [plan.pace[u].recent[-1][0] for u in units] == [32, 32]
    assert 25 <= expected["ends_at_seconds"] < 3240 and expected["would_shed"] == [], expected
    assert (
        line.startswith(
            "[infer] time: for 100000 test images (infer.expected_test_images), 1 member(s) x 2 view(s) at "
        )
        and "(the models' time alone: one public batch measures no reading): nothing to shed" in line
    ), line


def kaggle_layout(tmp_path: Path, export: Path) -> tuple[Path, dict]:
    """/kaggle with three folds of the model dataset attached (`export` three times over) and the kernel's env."""
    kaggle = tmp_path / "kaggle"
    for fold in range(3):
        shutil.copytree(export, kaggle / "input" / "datasets" / "tester" / "tpu2gpu-model" / f"fold{fold}")
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_USE_LEGACY_KERAS")}
    env.update(
        TPU2GPU_KAGGLE_ROOT=str(kaggle),
        KAGGLE_KERNEL_RUN_TYPE="Batch",
        PYTHONDONTWRITEBYTECODE="1",
        TMPDIR=str(tmp_path / "tmp"),
    )
    return kaggle, env


def write_test_set(competition: Path, public: Path, copies: int) -> list[str]:
    """sample_submission.csv and test/ of `copies` times the public test set, under new ids."""
    shutil.rmtree(competition, ignore_errors=True)
    (competition / "test").mkdir(parents=True)
    rows = read_csv(public / "sample_submission.csv")
    ids = []
    for copy in range(copies):
        for row in rows:
            ids.append(f"{row['id']}-{copy}" if copies > 1 else row["id"])
            source = next((public / "test").glob(f"{row['id']}.*"))
            shutil.copyfile(source, competition / "test" / f"{ids[-1]}{source.suffix}")
    with (competition / "sample_submission.csv").open("w", newline="") as f:
        csv.writer(f).writerows([["id", "label"], *([i, rows[0]["label"]] for i in ids)])
    os.sync()  # the copies written back now, not while the timed kernel reads them
    return ids


def run_kernel(kaggle: Path, env: dict, script: Path) -> tuple[subprocess.CompletedProcess, float]:
    """The built inference kernel as Kaggle runs it: its script alone, from a fresh /kaggle/working, no network."""
    shutil.rmtree(kaggle / "working", ignore_errors=True)
    (kaggle / "working").mkdir()
    shutil.copyfile(script, kaggle / "working" / "__script__.py")
    started = time.monotonic()
    run = subprocess.run(
        offline([sys.executable, "__script__.py"]),
        cwd=kaggle / "working",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run, time.monotonic() - started


def time_lines(run) -> list[str]:
    return [line for line in run.stdout.splitlines() if line.startswith(("[infer] time", "[infer] warning: time"))]


@pytest.mark.e2e
def test_a_code_competition_rerun_sheds_views_to_end_within_the_limit_and_a_limit_that_fits_changes_nothing(
    tmp_path, demo_records, demo_dir
):
    """One model as 3 folds x 7 views, built into the inference kernel three times on this host's own pace: with no
    limit on the public test, it measures where the public rows end (F) and where the hidden set's, 20 times larger,
    would (E); with a limit planned between the two (the geometric mean, so that either side has the same slack
    whatever the host's speed), the public test fits (nothing shed, the submission byte-identical to the unlimited
    one's) and the rerun's shedding is projected; on the hidden test, where the whole ensemble cannot end in time, it
    sheds views, writes every row within the limit and names what it shed in inference_time.json. The model: the
    tiny backbone 32 wide at 32 px, whose 21 views x folds take about 2 ms an image on an idle 2-core host; E is
    several times F (start-up dominates F), so the limit falls well clear of both. The process's own end, interpreter
    teardown included, is allowed a twentieth of the limit past it."""
    backbone = save_tiny_backbone(tmp_path / "backbone", width=32)
    settings = [
        f"runtime.tfrecords={demo_records[0]}",
        f"model.hub_handle={backbone}",
        "data.image_size=32",
        "train.fold=0",
        "train.epochs=1",
        "train.steps_per_epoch=2",
        "train.batch_size_per_replica=16",
        "train.export_float16=false",
        f"runtime.output_dir={tmp_path / 'trained'}",
    ]
    assert train_main(set_args(*settings)) == 0
    kaggle, env = kaggle_layout(tmp_path, tmp_path / "trained" / "export" / "fold0")
    competition = kaggle / "input" / "competitions" / "digit-comp"
    public = write_test_set(competition, demo_dir, 1)
    hidden_size = len(public) * HIDDEN_COPIES
    views = f"infer.tta=[{','.join(VIEWS)}]"

    def kernel_with(limit: str):
        config = load_config(
            None,
            [
                *PROJECT,
                views,
                f"infer.time_limit={limit}",
                "infer.time_margin=0.5",
                f"infer.expected_test_images={hidden_size}",
            ],
        )
        return build(config, tmp_path / f"build-{limit}")["infer"] / "infer.py"

    # This host's pace: no limit, the public test's end and the hidden set's projected end.
    run, _ = run_kernel(kaggle, env, kernel_with("none"))
    unlimited = (kaggle / "working" / "submission.csv").read_bytes()
    record = json.loads((kaggle / "working" / "inference_time.json").read_text())
    public_end, hidden_end = record["finished_at_seconds"], record["expected"]["ends_at_seconds"]
    assert record["shed"] == [] and record["expected"]["would_shed"] == [] and hidden_end > public_end, record
    planned = math.ceil(math.sqrt(public_end * hidden_end))
    limit = f"{2 * planned}s"  # infer.time_margin=0.5 plans half of it
    limited = kernel_with(limit)

    # The save run on the public test: within the limit, nothing shed, the same submission as without a limit; the
    # rerun's size projected past the plan, and its shedding named.
    run, _ = run_kernel(kaggle, env, limited)
    lines = time_lines(run)
    # 21 units, each its own function traced once per batch shape: no false "Tracing is expensive" from TensorFlow
    # (it counts traces per code object, and one lambda's code stood for all of them).
    assert "triggered tf.function retracing" not in run.stderr, run.stderr[-3000:]
    record = json.loads((kaggle / "working" / "inference_time.json").read_text())
    assert record["shed"] == [] and record["within_limit"] and record["rows"] == len(public), record
    assert [(u["member"], u["view"], u["images"], u["shed"]) for u in record["units"]] == [
        (f"fold{k}", view, len(public), False) for k in range(3) for view in ("identity", *VIEWS)
    ]
    assert re.fullmatch(
        rf"\[infer\] time: 3 member\(s\) x 7 view\(s\) at \d+ images/s: the {len(public)} rows "
        rf"would end at [\d.hms]+ of the {re.escape(clock_text(planned))} planned \({limit} limit "
        r"less infer.time_margin=0.5\): nothing to shed",
        lines[0],
    ), lines
    expected = record["expected"]
    assert expected["images"] == hidden_size and expected["ends_at_seconds"] > planned, (planned, expected)
    # Views first, the last configured first; where the views alone do not end in time, members too.
    would_shed = expected["would_shed"]
    assert would_shed[:6] == SHED_VIEWS[: len(would_shed)] and would_shed, expected
    assert all(member.startswith("fold") for member in would_shed[6:]), expected
    assert lines[1].startswith(
        f"[infer] time: for {hidden_size} test images (infer.expected_test_images), 3 member(s) x 7 view(s) at "
    ), lines
    assert f"a rerun would shed {', '.join(expected['would_shed'])} and end at " in lines[1], lines
    assert (kaggle / "working" / "submission.csv").read_bytes() == unlimited

    # The rerun on the hidden test set: every row, within the limit, the shedding named.
    hidden = write_test_set(competition, demo_dir, HIDDEN_COPIES)
    run, wall = run_kernel(kaggle, env, limited)
    submission = read_csv(kaggle / "working" / "submission.csv")
    assert [r["id"] for r in submission] == hidden and all(r["label"] for r in submission)
    record = json.loads((kaggle / "working" / "inference_time.json").read_text())
    report = "\n".join(time_lines(run)) + "\n" + json.dumps(record, indent=1)[:3000]
    assert record["within_limit"] and record["finished_at_seconds"] <= 2 * planned, report
    assert wall < 2 * planned * 1.05, (wall, report)
    # The whole ensemble would not end in time: each shedding followed a projection past the plan (the first one's, or
    # a later one's where the host's pace fell during the run; this host's pace moves from run to run).
    assert record["shed"] and all(step["projected_seconds"] > planned for step in record["shed"]), report
    shed = [what for step in record["shed"] for what in step["what"]]
    assert shed[:6] == SHED_VIEWS[: len(shed)] and shed, report  # views first, the last configured first
    ran = {(u["member"], u["view"]): u for u in record["units"]}
    assert not ran[("fold0", "identity")]["shed"] and ran[("fold0", "identity")]["images"] == len(hidden), report
    assert all(u["images"] < len(hidden) for u in record["units"] if u["shed"]), report
    assert f"; shed {', '.join(shed)}; wrote " in run.stdout, report
