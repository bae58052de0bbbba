"""`tpu2gpu blend` (tpu2gpu/blend.py): runs weighed on their out-of-fold predictions by hill climbing, held out
against the best run alone; and the inference kernel's reading of the blend (common/inference/blend.py)."""

import json
from pathlib import Path
from types import SimpleNamespace

from common.export.card import ExportError
from common.inference.blend import BLEND_FORMAT, member_weights
from common.tasks.types import get_task

import numpy as np
import pytest

from tpu2gpu.blend import Metric, Run, choose_blend, hill_climb, table

from builders import says


def synthetic_runs(task: str, metric: str, predictions: dict[str, np.ndarray], labels) -> list[Run]:
    """Runs of one fold each over the same records, holding `predictions` as their out-of-fold predictions."""
    card = SimpleNamespace(task=task, metric={"name": metric}, class_names=["0", "1"])
    ids = [f"r{k}" for k in range(len(labels))]
    return [
        Run(name, Path(name), {"fold0": Path(name)}, [card], ids, list(labels), p, dict.fromkeys(ids, 0))
        for name, p in predictions.items()
    ]


def test_hill_climbing_weighs_two_complementary_runs_alike_and_gives_a_noise_run_nothing_for_an_error_to_lower():
    """Regression, rmse (lower is better): two runs whose errors cancel (the truth plus and minus the same noise)
    blend to the truth itself at half and half; a run of pure noise takes no weight."""
    rng = np.random.default_rng(0)
    truth = rng.normal(size=400)
    error = rng.normal(size=400)
    runs = {"plus": truth + error, "noise": rng.normal(size=400), "minus": truth - error}
    metric = Metric(get_task("regression"), "rmse")
    climb = hill_climb([p[:, None] for p in runs.values()], truth, metric)
    assert climb.weights.tolist() == [0.5, 0.0, 0.5]
    assert climb.order == [0, 2] and climb.scores[-1] < 1e-12 < climb.scores[0]
    assert climb.added[0] is None and climb.added[2] == pytest.approx(-climb.scores[0])


def test_hill_climbing_finds_the_complementary_pair_and_gives_a_noise_run_nothing_for_a_score_to_raise():
    """Binary, ROC AUC (higher is better): each of two runs knows the labels of one half of the records and guesses
    on the other; together they rank nearly every record right. A run of pure noise takes no weight."""
    rng = np.random.default_rng(1)
    labels = np.tile([0, 1], 200)
    first = np.arange(400) < 200
    knows = 0.25 + 0.5 * labels + rng.normal(scale=0.05, size=400)
    guesses = rng.uniform(size=400)
    runs = {
        "noise": rng.uniform(size=400),
        "first half": np.where(first, knows, guesses),
        "second half": np.where(first, guesses, knows),
    }
    blend = choose_blend(synthetic_runs("binary", "roc_auc", {k: v[:, None] for k, v in runs.items()}, labels))
    assert blend.weights[0] == 0 and blend.weights[1] >= 0.3 and blend.weights[2] >= 0.3, blend.weights
    assert blend.oof > max(blend.singles) + 0.1 and blend.kept == "blend"
    assert blend.held_out > blend.best_held_out + 0.1  # each split's weights, chosen without it, hold on it
    says(table(synthetic_runs("binary", "roc_auc", runs, labels), blend), "roc_auc (higher is better)", "noise")


def test_a_blend_that_does_not_hold_out_keeps_the_best_run_alone_and_says_so():
    """Twenty runs of noise beside one of signal on 30 records: on every row the climb adds noise runs that happen
    to fit these records; held out, they fall below the signal run alone, which is kept alone (weight 1)."""
    rng = np.random.default_rng(3)
    truth = rng.normal(size=30)
    predictions = {"signal": truth + rng.normal(scale=0.8, size=30)}
    predictions.update({f"noise{k}": rng.normal(size=30) for k in range(20)})
    runs = synthetic_runs("regression", "rmse", {k: v[:, None] for k, v in predictions.items()}, truth)
    blend = choose_blend(runs, splits=5)
    assert blend.climb.weights[0] < 1 and blend.held_out > blend.best_held_out, (blend.climb.weights, blend)
    assert blend.kept == "best run" and blend.weights.tolist() == [1.0] + [0.0] * 20
    says(table(runs, blend), "the blend scores below signal alone on the held-out splits", "signal is kept alone")


def write_fold(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "model_card.json").write_text(json.dumps({"model": name}))
    return folder


def test_the_inference_kernel_weighs_each_fold_by_its_runs_share_and_refuses_an_export_the_blend_does_not_name(
    tmp_path,
):
    """A run's weight is split over its folds; copies of one model share its weight; an export the blend does not
    name, and a weighted fold not attached, are each one error naming it."""
    from common.export.card import card_digest

    a0, a1 = write_fold(tmp_path / "a" / "fold0", "a0"), write_fold(tmp_path / "a" / "fold1", "a1")
    b0 = write_fold(tmp_path / "b" / "fold0", "b0")
    copy = write_fold(tmp_path / "copy" / "fold0", "b0")  # the same card: the same model
    stray = write_fold(tmp_path / "stray" / "fold0", "stray")
    blend = {
        "format": BLEND_FORMAT,
        "path": "blend.json",
        "runs": [
            {"name": "a", "weight": 0.6, "folds": {"fold0": card_digest(a0), "fold1": card_digest(a1)}},
            {"name": "b", "weight": 0.4, "folds": {"fold0": card_digest(b0)}},
        ],
    }
    assert member_weights(blend, [a0, a1, b0]) == {a0: 0.3, a1: 0.3, b0: 0.4}
    assert member_weights(blend, [a0, a1, b0, copy]) == {a0: 0.3, a1: 0.3, b0: 0.2, copy: 0.2}
    with pytest.raises(ExportError) as refused:
        member_weights(blend, [a0, a1, b0, stray])
    says(str(refused.value), str(stray), "is not in the blend blend.json", "a, b", "Fix", "infer.blend=none")
    with pytest.raises(ExportError) as refused:
        member_weights(blend, [a0, b0])
    says(str(refused.value), "weighs a/fold1, which is not attached", "Fix")


@pytest.mark.e2e
def test_two_runs_and_a_copy_blend_and_the_inference_kernel_writes_the_weighted_average_of_their_own_predictions(
    trained_export, efficientnet_export, demo_dir, tmp_path, capsys, recorder
):
    """Two runs on the same records (a TF Hub backbone at 16 px, an EfficientNet-B0 at 32 px) and a copy of the
    first: `tpu2gpu blend` prints the table and writes the blend; the copy takes no weight beyond the original's
    share (the blend without it gives the original the same). The inference kernel given the blend's folder writes
    probabilities equal to the blend's weights on each run's own probabilities.csv, for the weights the climb chose
    and for fixed ones (a quarter and three quarters), and its time plan sheds the lighter member first. `publish`
    uploads the blend's folder as it is (the real kaggle CLI against the loopback recorder)."""
    import dataclasses
    import shutil

    from common.core.config import load_config
    from common.inference.ensemble import load_members
    from common.inference.predict import ensemble_units
    from common.inference.time_plan import shed_steps

    import tensorflow as tf

    from infer_gpu.infer import main as infer_main
    from tpu2gpu import blend as blending
    from tpu2gpu.build import build
    from tpu2gpu.cli import main as cli

    from builders import read_csv, set_args
    from fake_kaggle import PROJECT

    runs = tmp_path / "runs"
    hub = shutil.copytree(trained_export, runs / "hub16" / "export")
    effnet = shutil.copytree(efficientnet_export, runs / "effnet32" / "export")
    copy = shutil.copytree(trained_export, runs / "hub16-copy" / "export")
    capsys.readouterr()
    assert cli(["blend", str(hub), str(effnet), str(copy), "--out", str(tmp_path / "blend")]) == 0
    says(
        capsys.readouterr().out,
        "[blend] macro_f1 (higher is better) on 288 out-of-fold records of 3 runs",
        "hub16",
        "effnet32",
        "hub16-copy",
        "blend",
        "held out",
        "tpu2gpu publish --export",
    )
    record = json.loads((tmp_path / "blend" / "blend.json").read_text())
    weights = {run["name"]: run["weight"] for run in record["runs"]}
    assert weights["hub16-copy"] == 0 and sum(weights.values()) == pytest.approx(1)
    assert cli(["blend", str(hub), str(effnet), "--out", str(tmp_path / "without-copy")]) == 0
    without = {
        run["name"]: run["weight"] for run in json.loads((tmp_path / "without-copy" / "blend.json").read_text())["runs"]
    }
    assert without == {"hub16": weights["hub16"], "effnet32": weights["effnet32"]}
    assert (tmp_path / "blend" / "hill.png").stat().st_size > 1000
    held = sorted(str(p.relative_to(tmp_path / "blend")) for p in (tmp_path / "blend").glob("*/fold*"))
    assert held == sorted(f"{name}/fold0" for name, weight in weights.items() if weight > 0)

    def probabilities(exports: Path, out: Path) -> dict:
        settings = set_args(
            f"infer.exports=[{exports}]", f"runtime.competition_dir={demo_dir}", f"runtime.output_dir={out}"
        )
        assert infer_main(settings) == 0
        return {row.pop("id"): {k: float(v) for k, v in row.items()} for row in read_csv(out / "probabilities.csv")}

    own = {
        "hub16": probabilities(hub, tmp_path / "own-hub16"),
        "effnet32": probabilities(effnet, tmp_path / "own-effnet32"),
    }
    runs_read = blending.read_runs([hub, effnet])
    fixed = dataclasses.replace(blending.choose_blend(runs_read), weights=np.array([0.25, 0.75]))
    blending.write_blend(tmp_path / "fixed", runs_read, fixed)
    for folder, shares in ((tmp_path / "blend", weights), (tmp_path / "fixed", {"hub16": 0.25, "effnet32": 0.75})):
        got = probabilities(folder, tmp_path / f"infer-{folder.name}")
        difference = max(abs(got[i][c] - sum(shares[run] * own[run][i][c] for run in own)) for i in got for c in got[i])
        assert len(got) == 360 and difference < 1e-5, (folder.name, difference)
        submission = {r["id"]: r["label"] for r in read_csv(tmp_path / f"infer-{folder.name}" / "submission.csv")}
        for i, row in got.items():  # the class of the largest weighted probability, where no near-tie could flip it
            expected = {c: sum(shares[run] * own[run][i][c] for run in own) for c in row}
            first, second = sorted(expected.values())[-2:][::-1]
            assert first - second < 1e-4 or submission[i] == max(expected, key=expected.get), (i, expected)
        says(capsys.readouterr().out, f"[infer] blend {folder / 'blend.json'}", "hub16", "effnet32")

    build_dir = tmp_path / "build"
    build(load_config(None, PROJECT), build_dir)
    assert cli(["publish", "--build", str(build_dir), "--export", str(tmp_path / "fixed"), *set_args(*PROJECT)]) == 0
    assert {"hub16.zip", "effnet32.zip", "blend.json", "hill.png"} <= {name for name, _ in recorder.uploads}

    cfg = load_config(None, [f"infer.exports=[{tmp_path / 'fixed'}]"])
    members, _, _ = load_members(cfg.infer, tf.distribute.get_strategy())
    assert sorted(m.weight for m in members) == [0.25, 0.75]
    steps = [what for what, _ in shed_steps(ensemble_units(members, ()))]
    assert steps == ["hub16/fold0", "effnet32/fold0"], steps  # the lighter first; the last is never shed


@pytest.mark.e2e
def test_runs_over_other_records_or_another_class_list_are_refused_in_one_message(trained_export, tmp_path, capsys):
    """A run whose out-of-fold predictions cover other records, and one whose classes come in another order, beside
    the trained run: `tpu2gpu blend` refuses each in one line naming the runs and what differs, and writes nothing."""
    import shutil

    from common.export.card import CARD_NAME

    from tpu2gpu.cli import main as cli

    from builders import read_csv, write_csv

    original = shutil.copytree(trained_export, tmp_path / "original" / "export")
    other = shutil.copytree(trained_export, tmp_path / "other-records" / "export")
    rows = read_csv(other / "fold0" / "oof.csv")
    write_csv(other / "fold0" / "oof.csv", list(rows[0]), [[f"x{r['id']}", *list(r.values())[1:]] for r in rows[:100]])
    reordered = shutil.copytree(trained_export, tmp_path / "reordered" / "export")
    card = json.loads((reordered / "fold0" / CARD_NAME).read_text())
    card["class_names"] = card["class_names"][::-1]
    (reordered / "fold0" / CARD_NAME).write_text(json.dumps(card))
    for run, says_what in (
        (other, ["other-records's out-of-fold predictions cover 100 records and original's 288", "288 of original's"]),
        (reordered, ["reordered predicts classes", "original"]),
    ):
        capsys.readouterr()
        assert cli(["blend", str(original), str(run), "--out", str(tmp_path / "blend")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        says(err[0], "these runs cannot be blended:", *says_what, "Fix: blend runs of one competition")
        assert not (tmp_path / "blend").exists()


def test_a_damaged_blend_json_is_one_named_error(tmp_path):
    """A blend.json cut short, and a JSON list under the name: each one ExportError naming the file and the fix."""
    from common.inference.blend import read_blend

    path = tmp_path / "blend.json"
    for text in ('{"format": "tpu2gpu-blend-1", "runs": [', "[1, 2]", ""):
        path.write_text(text)
        with pytest.raises(ExportError) as refused:
            read_blend(path)
        says(str(refused.value), str(path), "Fix: write it again with `tpu2gpu blend`")
