"""The GPU inference kernel: exports -> test pipeline from the model card -> TTA / fold ensemble -> submission.csv.

    python -m infer_gpu.infer --set infer.exports=[runs/demo/train/export] \
        --set runtime.competition_dir=runs/demo/competition                   # locally
    tpu2gpu build, then kaggle kernels push                                  # on Kaggle (GPU T4 x2, internet off)

Needs TensorFlow only (no tf_keras, no tensorflow_hub) and no training config: task, image size, classes, thresholds
and schema come from each export's model_card.json; predictions are averaged over TTA views and exports before any
threshold or argmax. Test images come from the competition folder (data.test_images, ids and column
order from data.test_csv, i.e. sample_submission.csv) or from test TFRecords (runtime.tfrecords). Writes
submission.csv (validated: every test id once, no NaN, every label a class; written atomically) and
probabilities.csv into runtime.output_dir (/kaggle/working on Kaggle, ./runs/infer locally).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import common  # noqa: F401
from common.config import format_config, parse_kernel_args
from common.env import environment_report
from common.errors import UserError
from common.export import load_export, read_card
from common.inference import (
    check_record_ids,
    check_same_classes,
    check_template_classes,
    check_test_images,
    enable_amp,
    ensemble_probabilities,
    ensemble_thresholds,
    ensemble_weights,
    find_exports,
    find_test_images,
    inference_precision,
    read_template,
    submission_rows,
    tta_view_names,
    write_csv_atomically,
)
from common.kernel import guarded
from common.paths import output_dir, resolve_data_path
from common.strategy import get_strategy, split_cpu
from common.tasks import get_task, output_names


def test_batches(cfg, card: dict, template, csv_name: str):
    """Batches of {'image', 'id'} at the card's image size: from the competition's test images, or test records."""
    from common.data import make_eval_dataset, make_image_file_dataset, read_ids_and_labels
    from common.tfrecords import RecordSchema, glob_files, has_manifest, read_manifest, shard_paths

    size = card["image_size"]
    if cfg.runtime.competition_dir and not cfg.runtime.tfrecords:
        image_dir = Path(resolve_data_path(cfg.runtime.competition_dir)) / cfg.data.test_images
        paths = find_test_images(image_dir, template.ids, csv_name)
        if cfg.infer.check_images != "off":
            unlike = check_test_images(paths, card, strict=cfg.infer.check_images == "strict")
            if unlike:
                print(f"[infer] warning: {sum(unlike.values())} of {len(paths)} test images differ from the training "
                      f"images ({', '.join(f'{n} x {kind}' for kind, n in unlike.most_common(5))}); the pipeline "
                      "resizes and converts them to RGB. infer.check_images=strict refuses them", flush=True)
        return make_image_file_dataset(paths, template.ids, size, cfg.infer.batch_size)
    root = resolve_data_path(cfg.runtime.tfrecords)
    files = (shard_paths(read_manifest(root), root, ["test"]) if has_manifest(root)
             else glob_files(root, cfg.data.test_files))
    schema = RecordSchema(**card["record_schema"])
    check_record_ids(read_ids_and_labels(files, schema, labeled=False)[0], template.ids, csv_name)
    return make_eval_dataset(files, schema, size, cfg.infer.batch_size, labeled=False)


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()

    # ---- config and environment
    cfg = parse_kernel_args(__doc__, argv)
    print(format_config(cfg), flush=True)
    split_cpu(cfg.runtime.cpu_devices)
    strategy = get_strategy(cfg.runtime.strategy, cfg.runtime.tpu_address)
    print(environment_report(strategy), flush=True)

    # ---- exports: the cards say everything the pipeline needs
    exports = find_exports(cfg.infer.exports)
    cards = [read_card(e) for e in exports]
    weights = ensemble_weights(cards, exports, cfg.infer.cut_folds)  # folds the training time budget cut
    kept = [(e, c, w) for e, c, w in zip(exports, cards, weights, strict=True) if w > 0]
    exports, cards, weights = [e for e, _, _ in kept], [c for _, c, _ in kept], [w for _, _, w in kept]
    precision = inference_precision(cfg.infer.precision, cards)
    if precision == "amp":
        enable_amp()
    with strategy.scope():  # variables mirrored onto every replica
        models = [load_export(e, "float16" if precision == "float16" else "float32") for e in exports]
    class_names = check_same_classes(cards, exports)
    task, thresholds = get_task(cards[0]["task"]), ensemble_thresholds(cards, weights)
    computation = "float32 graphs, TensorFlow's automatic mixed precision rewrite on" if precision == "amp" \
        else f"{precision} computation"
    print(f"[infer] {len(exports)} {task.name} export(s), {computation}: "
          + ", ".join(f"{e} (weight {w:.2f})" if w != 1 else str(e) for e, w in zip(exports, weights, strict=True)),
          flush=True)

    # ---- test data, checked against the cards and the competition's template
    competition = Path(resolve_data_path(cfg.runtime.competition_dir)) if cfg.runtime.competition_dir else None
    if competition is None or not (competition / cfg.data.test_csv).is_file():
        raise UserError(f"no {cfg.data.test_csv} found: set runtime.competition_dir to the competition folder, which "
                        "gives the test ids and the submission's columns")
    template = read_template(competition / cfg.data.test_csv, cfg.data.id_column)
    check_template_classes(template, task, class_names, cfg.data.test_csv)

    # ---- predict: exports grouped by image size share one pass over the test data
    total, weight, ids = None, 0.0, None
    for size in sorted({card["image_size"] for card in cards}):
        group = [(card, predict, w) for (card, predict), w in zip(models, weights, strict=True)
                 if card["image_size"] == size]
        batches = test_batches(cfg, group[0][0], template, cfg.data.test_csv)
        ids, probs = ensemble_probabilities([p for _, p, _ in group], batches, cfg.infer.tta, strategy, cfg.infer.xla,
                                            [w for _, _, w in group])
        group_weight = sum(w for _, _, w in group)
        total = probs * group_weight if total is None else total + probs * group_weight
        weight += group_weight
    probs = total / weight

    # ---- write
    out = output_dir(cfg.runtime.output_dir, "runs/infer")
    rows = submission_rows(template, ids, probs, task, class_names, thresholds)  # averaged, then thresholded
    submission = out / cfg.infer.submission
    write_csv_atomically(submission, template.header, rows)
    if cfg.infer.save_probabilities:
        position = {i: k for k, i in enumerate(ids)}
        write_csv_atomically(out / "probabilities.csv", [template.id_column, *output_names(task, class_names)],
                             [[i, *(f"{v:.6f}" for v in probs[position[i]])] for i in template.ids])
    print(f"[infer] {len(rows)} predictions, {len(exports)} export(s) x {len(tta_view_names(cfg.infer.tta))} view(s), "
          f"{len(rows) / (time.perf_counter() - start):.0f} images/s overall; wrote {submission}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(guarded("infer_gpu", main))
