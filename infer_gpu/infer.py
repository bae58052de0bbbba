"""The GPU inference kernel: exports -> test pipeline from the model card -> TTA / fold ensemble -> submission.csv.

    python -m infer_gpu.infer --set infer.exports=[runs/demo/train/export] \
        --set runtime.competition_dir=runs/demo/competition                   # locally
    tpu2gpu build, then kaggle kernels push                                  # on Kaggle (GPU T4 x2, internet off)

Needs TensorFlow only (no tf_keras, no tensorflow_hub) and no training config: task, image size, classes, thresholds
and schema come from each export's model_card.json; predictions are averaged over TTA views and exports before any
threshold or argmax. Test images come from the competition folder (data.test_images, ids and column
order from data.test_csv, i.e. sample_submission.csv) or from test TFRecords (runtime.tfrecords). Writes
submission.csv (validated: every test id once, no NaN, every label a class; written atomically),
probabilities.csv and, where a test image could not be read, bad_test_images.csv into runtime.output_dir
(/kaggle/working on Kaggle, ./runs/infer locally). Every row of the template is written: an image TensorFlow cannot
decode is read with Pillow, and one nothing can read gets the mean prediction of the readable test images
(infer.on_bad_image=error stops instead). Within infer.time_limit (default 9h, from the kernel's start): each export's
TTA views are timed, and where the rows would end past the limit views, then exports, are shed, said in a line and
in inference_time.json beside submission.csv (common/inference/time_plan.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import common  # noqa: F401
from common.core.atomic import write_json
from common.core.config import Config, format_config, parse_kernel_args
from common.core.errors import UserError, run_entry
from common.core.paths import output_dir, resolve_data_path
from common.core.platform import environment_report
from common.core.strategy import get_strategy, split_cpu
from common.data.sources import open_source
from common.inference.ensemble import confirm_float16, ensemble_thresholds, load_members
from common.inference.predict import ensemble_predict, ensemble_units, time_units
from common.inference.submission import (
    check_template_classes,
    read_template,
    submission_rows,
    write_csv_atomically,
)
from common.inference.time_plan import TIME_RECORD, clock_text, time_plan
from common.inference.unread import BAD_TEST_IMAGES, predict_unread, write_bad_test_images
from common.tasks.parts import decimal_text
from common.tasks.types import get_task


def competition_template(cfg: Config):
    """sample_submission.csv of the competition folder: the test ids, their order and the submission's columns."""
    competition = Path(resolve_data_path(cfg.runtime.competition_dir)) if cfg.runtime.competition_dir else None
    if competition is None or not (competition / cfg.data.test_csv).is_file():
        raise UserError(
            f"no {cfg.data.test_csv} found: set runtime.competition_dir to the competition folder, which "
            "gives the test ids and the submission's columns"
        )
    return read_template(competition / cfg.data.test_csv, cfg.data.id_column)


def describe_members(members, precision: str) -> str:
    computation = (
        "float32 graphs, TensorFlow's automatic mixed precision rewrite on"
        if precision == "amp"
        else f"{precision} computation"
    )
    return f"[infer] {len(members)} {members[0].card.task} export(s), {computation}: " + ", ".join(
        f"{m.export} (weight {m.weight:.2f})" if m.weight != 1 else str(m.export) for m in members
    )


def write_probabilities(path: Path, template, ids, predictions, names) -> None:
    """probabilities.csv: every model output per test id, in the template's order, for blending."""
    position = {i: k for k, i in enumerate(ids)}
    write_csv_atomically(
        path, [template.id_column, *names], [[i, *map(decimal_text, predictions[position[i]])] for i in template.ids]
    )


def write_time(plan, infer_cfg, strategy, path: Path) -> None:
    """The save run's look ahead (infer.expected_test_images), then inference_time.json: what ran, what was shed, the
    projection and the time. No plan (infer.time_limit=none): an earlier run's record is removed."""
    if plan is None:
        path.unlink(missing_ok=True)
        return
    expected = (
        plan.expected(
            infer_cfg.expected_test_images,
            lambda untimed, samples: time_units(untimed, samples, infer_cfg.batch_size, strategy, plan),
        )
        if infer_cfg.expected_test_images
        else None
    )
    record = plan.record(expected)
    write_json(path, record, indent=1)
    shed = [what for step in plan.shed for what in step["what"]]
    print(
        f"[infer] time: finished at {clock_text(record['finished_at_seconds'])} of the kernel"
        + ("" if plan.limit is None else f" ({infer_cfg.time_limit} limit)")
        + (f"; shed {', '.join(shed)}" if shed else "; nothing shed")
        + f"; wrote {path}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()

    # ---- config and environment
    cfg = parse_kernel_args(__doc__, argv)
    print(format_config(cfg), flush=True)
    split_cpu(cfg.runtime.cpu_devices)
    strategy = get_strategy(cfg.runtime.strategy, cfg.runtime.tpu_address)
    print(environment_report(strategy), flush=True)

    # ---- the ensemble: each export's card says everything the pipeline needs
    members, precision, blend = load_members(cfg.infer, strategy)  # weighed by the blend there (tpu2gpu blend)
    card = members[0].card
    task, thresholds = get_task(card.task), ensemble_thresholds(members, blend)
    print(describe_members(members, precision), flush=True)

    # ---- test data, checked against the cards and the competition's template
    template = competition_template(cfg)
    check_template_classes(template, task, card.class_names, cfg.data.test_csv)

    # ---- predict (averaged over exports and views, then thresholded) and write
    source = open_source(cfg)

    datasets = {}

    def batches_for(card):  # one dataset per image size, as the ensemble groups members: its images checked once
        if card.image_size not in datasets:
            datasets[card.image_size] = source.test_batches(card, template, cfg.infer)
        return datasets[card.image_size]

    members, precision = confirm_float16(members, precision, batches_for)  # on this GPU, before it counts
    units = ensemble_units(members, cfg.infer.tta, cfg.infer.xla)  # a member's view each: timed, shed by the plan
    plan = time_plan(cfg.infer, units, rows=len(template.ids))  # infer.time_limit (common/inference/time_plan.py)
    ids, predictions = ensemble_predict(units, batches_for, strategy, plan)
    # what TensorFlow could not decode: read with Pillow, or named and given the fallback (common/inference/unread.py)
    ids, predictions, bad = predict_unread(
        card,
        source,
        template,
        (ids, predictions),
        cfg.infer,
        lambda batches: ensemble_predict(units, batches, strategy, plan),
    )
    rows = submission_rows(template, ids, predictions, task, card.class_names, thresholds)
    out = output_dir(cfg.runtime.output_dir, "runs/infer")
    write_csv_atomically(out / cfg.infer.submission, template.header, rows)
    write_bad_test_images(out / BAD_TEST_IMAGES, bad)
    if cfg.infer.save_probabilities:
        write_probabilities(out / "probabilities.csv", template, ids, predictions, task.output_names(card.class_names))
    shed = " (before the time plan shed some)" if plan is not None and plan.shed else ""
    print(
        f"[infer] {len(rows)} predictions, {len(members)} export(s) x {len(units) // len(members)} view(s){shed},"
        f" {len(rows) / (time.perf_counter() - start):.0f} images/s overall; wrote {out / cfg.infer.submission}",
        flush=True,
    )
    write_time(plan, cfg.infer, strategy, out / TIME_RECORD)
    return 0


if __name__ == "__main__":
    run_entry("infer_gpu", main)
