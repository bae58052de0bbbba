"""Every task type on the torch_xla route: the demo's digits as binary, multilabel and regression competitions
(builders.task_competition), each the route's own model (model.py: the timm backbone, the task's head width and
activation) exported by the route's own export (export.py: keras-hub's rebuild in a TensorFlow child, the fresh-process
check) and scored by the inference kernel in a child where torch, torch_xla, timm and keras-hub cannot be imported.
The route's multiclass training, killed and resumed, exported and scored, is tests/test_timm_export.py's ConvNeXt.

In the default suite the models are not trained: each task's export (its job folder written by the route's export,
the three jobs run by one export child) against the torch model, and the TF-only kernel's outputs for every test
image against the torch model's own. Trained by the training kernel on two XLA CPU devices, against held-out bars, is
the opt-in run (-m slow, about 2 minutes: each task's graphs compile, about 8 s, and its export, about 13 s). Each
slow run turns on one more of the shared pipeline's and loop's features: MixUp + CutMix soft targets with label
smoothing (binary), the weights' moving average (multilabel), the output scaling (regression). In the default suite
the route's training is tests/test_timm_export.py's and test_torch_route.py's, and each task's loss is checked
against the other routes' (tests/test_tasks.py)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from common.launch.routes import torch_xla_missing

import numpy as np
import pytest

from builders import SHAPES, read_csv, run_inference_kernels, set_args, task_competition

REPO = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        bool(torch_xla_missing()), reason=f"{torch_xla_missing()} not installed (./dev test installs the torch extra)"
    ),
]

EXTRA = {
    "binary": [
        "data.group_column=patient_id",
        "data.mixup_prob=0.5",
        "data.cutmix_prob=0.5",
        "train.label_smoothing=0.1",
    ],
    "multilabel": ["train.ema=0.8", "train.keep=last"],
    "regression": ["train.epochs=6", "train.learning_rate=0.05"],
}
# Held-out scores after 4 epochs of 8 steps (6 at half the rate for regression) of 128 images at 16 px (tiny data, a
# random MobileNetV3), measured here: AUC 0.957-0.974, samples-F1 0.88-0.90, RMSE 18.9. The bars leave room for the
# noise seen between runs (not traced) and sit above the trivial answers: AUC 0.5, samples-F1 0.74 (every label for
# every image), RMSE 28.7 (the mean for every image: the target's std).
BARS = {"binary": ("roc_auc", 0.85), "multilabel": ("samples_f1", 0.8), "regression": ("rmse", 24.0)}

# The training kernel's main, once per task, in one process: torch_xla is imported by the first run's route (before
# anything imports TensorFlow); the later runs find it loaded.
RUN_KERNELS = """
import json, sys
from train_tpu.train import main
for argv in json.loads(sys.argv[1]):
    if main(argv):
        sys.exit(1)
"""


TASKS = ("binary", "multilabel", "regression")

# The route's export child (export.py's main) for each job folder of its arguments in turn, in one interpreter: the
# child's imports (TensorFlow, Keras 3, keras-hub, torch, timm) once, not once per task.
EXPORT_JOBS = """
import sys
from common.training.backends.torch_shared.export import main
for job in sys.argv[1:]:
    assert main(job) == 0, job
"""


def inference_argv(task: str, exports: Path, competition: Path, out: Path) -> list[str]:
    """The inference kernel's arguments for the task's exports on its competition: no training config, the card says
    what the task is; the template's id column named."""
    return set_args(
        f"infer.exports=[{exports}]",
        f"runtime.competition_dir={competition}",
        f"data.id_column={SHAPES[task][0]}",
        f"runtime.output_dir={out}",
    )


def settings(task: str, timm_folder: Path) -> list[str]:
    id_col, target_col = SHAPES[task][:2]
    return [
        "train.framework=torch_xla",
        "model.backbone=timm",
        f"model.timm_model={timm_folder}",
        "runtime.cpu_devices=2",
        f"data.task={task}",
        f"data.id_column={id_col}",
        f"data.label_column={target_col}",
        "data.image_size=16",
        "data.flip_left_right=false",
        "train.fold=0",
        "train.epochs=4",
        "train.steps_per_epoch=8",
        "train.batch_size_per_replica=64",
        "train.learning_rate=0.1",
        "train.export_float16=false",
        *EXTRA[task],
    ]


def held_out_score(task: str, values: list[str], answers: list[dict]) -> float:
    from sklearn.metrics import f1_score, roc_auc_score, root_mean_squared_error
    from sklearn.preprocessing import MultiLabelBinarizer

    truth = [a["target"] for a in answers]
    if task == "binary":
        return float(roc_auc_score([int(t) for t in truth], [float(v) for v in values]))
    if task == "regression":
        return float(root_mean_squared_error([float(t) for t in truth], [float(v) for v in values]))
    labels = MultiLabelBinarizer().fit([t.split() for t in truth])
    return float(
        f1_score(
            labels.transform([t.split() for t in truth]),
            labels.transform([v.split() for v in values]),
            average="samples",
        )
    )


@pytest.mark.slow
def test_each_task_trains_on_torch_xla_exports_the_same_contract_and_the_tf_only_kernel_scores_it(
    tmp_path, demo_dir, tiny_timm_backbone
):
    from tpu2gpu.cli import main as cli_main

    runs, inference, answers_of = [], [], {}
    for task in TASKS:
        competition, answers_of[task] = task_competition(demo_dir, tmp_path / task / "competition", task)
        flags = set_args(*settings(task, tiny_timm_backbone))
        assert (
            cli_main(
                ["tfrecords", "--competition", str(competition), "--out", str(tmp_path / task / "records"), *flags]
            )
            == 0
        )
        runs.append(
            [
                *flags,
                *set_args(
                    f"runtime.tfrecords={tmp_path / task / 'records'}",
                    f"runtime.output_dir={tmp_path / task / 'train'}",
                ),
            ]
        )
        inference.append(
            inference_argv(task, tmp_path / task / "train" / "export", competition, tmp_path / task / "infer")
        )
    run = subprocess.run(
        [sys.executable, "-c", RUN_KERNELS, json.dumps(runs)], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-5000:]
    assert log.count("devices       2 x cpu XLA device(s); SPMD data parallel") == 3

    infer = run_inference_kernels(inference, blocked=("torch", "torch_xla", "timm", "keras_hub"))
    assert infer.returncode == 0, infer.stdout[-2000:] + infer.stderr[-2000:]

    for task in TASKS:
        answers, (id_col, target_col) = answers_of[task], SHAPES[task][:2]
        card = json.loads((tmp_path / task / "train" / "export" / "fold0" / "model_card.json").read_text())
        assert card["task"] == task and card["complete"] and card["runtime"]["framework"] == "torch_xla"
        difference = card["verification"]["max_abs_diff"]["float32"]
        submission = read_csv(tmp_path / task / "infer" / "submission.csv")
        assert [r[id_col] for r in submission] == [a["id"] for a in answers]  # the template's rows, in its order
        metric, bar = BARS[task]
        score = held_out_score(task, [r[target_col] for r in submission], answers)
        print(
            f"{task} on torch_xla: validation {metric} {card['metrics'][metric]:.4f}, held-out {score:.4f}; export "
            f"max abs difference from the torch model {difference:.1e}"
        )
        assert card["metric"]["name"] == metric
        assert difference <= 1e-4
        assert (score <= bar) if metric == "rmse" else (score >= bar), (task, score)


# ------------------------------------------------------------------------------ the default suite: untrained models
IMAGE_SIZE = 32  # the demo's own: the inference kernel feeds the PNGs unresized, as the torch model sees them here


def image_array(paths) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.open(path).convert("RGB")) for path in paths])


def model_whose_outputs_vary(cfg, task, width: int, images: np.ndarray):
    """The route's model for the task, untrained, with outputs that depend on the image (else the export's check could
    not fail): timm's random backbone keeps batch-norm statistics of 0 and 1, which make every output alike in
    evaluation mode, so they are set to these images' own; the head's weights spread each logit over about +-2."""
    from common.training.backends.torch_shared.model import build_timm_model

    import torch

    torch.manual_seed(0)
    model = build_timm_model(cfg.model, width, task.activation)
    for norm in (m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)):
        norm.reset_running_stats()
        norm.momentum = None  # a plain average over the pass below
    pooled = []
    with torch.no_grad():
        model.train()(torch.from_numpy(images))
        hook = model.head.register_forward_hook(lambda module, inputs, output: pooled.append(inputs[0]))
        model.eval()(torch.from_numpy(images))  # the head's input as it will be predicted: no dropout
        hook.remove()
        weight = torch.randn(width, pooled[0].shape[1])
        logits = pooled[0] @ weight.T
        scale = 2 / logits.std(dim=0)
        model.head.weight.copy_(weight * scale[:, None])
        model.head.bias.copy_(-logits.mean(dim=0) * scale)
    return model.eval()


def torch_predictions(model, images: np.ndarray, scaling: dict | None) -> np.ndarray:
    """What the model predicts, as the export must: the regression value with its scaling undone."""
    from common.training.backends.torch_shared.export import torch_outputs

    outputs = torch_outputs(model, images)
    return outputs * scaling["std"] + scaling["mean"] if scaling else outputs


def export_untrained(task_name: str, competition: Path, timm_folder: Path, export_dir: Path) -> tuple:
    """The task's untrained model exported by the route's export, as the training kernel's fold would write it:
    (the model, the target scaling, the card's thresholds)."""
    from common.core.config import config_to_dict, load_config
    from common.export.card import ModelCard
    from common.export.writer import ExportContents
    from common.tasks.types import get_task
    from common.training.backends.torch_shared.export import export

    id_col, target_col = SHAPES[task_name][:2]
    cfg = load_config(
        None,
        [
            "train.framework=torch_xla",
            "model.backbone=timm",
            f"model.timm_model={timm_folder}",
            f"data.task={task_name}",
            f"data.id_column={id_col}",
            f"data.label_column={target_col}",
            f"data.image_size={IMAGE_SIZE}",
            "train.export_float16=false",
        ],
    )
    task, rows = get_task(task_name), read_csv(competition / "train.csv")
    labels, class_names, label_type = task.encode([r[target_col] for r in rows], [r[id_col] for r in rows])
    images = image_array(competition / "train" / f"{r[id_col]}.png" for r in rows)
    width, scaling = task.outputs(len(class_names)), task.target_scaling(labels)
    model = model_whose_outputs_vary(cfg, task, width, images)
    predictions = torch_predictions(model, images, scaling)
    thresholds = task.choose_thresholds(labels, predictions)
    card = ModelCard.create(
        task,
        class_names,
        IMAGE_SIZE,
        label_type=label_type,
        thresholds=thresholds,
        target_scaling=scaling,
        runtime={"framework": "torch_xla"},
        config=config_to_dict(cfg),
        metric={"name": task.default_metric, "value": task.score(task.default_metric, labels, predictions, thresholds)},
    )
    backend = SimpleNamespace(model=model, cfg=cfg, plan=SimpleNamespace(outputs=width, task=task))
    export(backend, export_dir, ExportContents(card, images[:8], {}, scaling))
    return model, scaling, thresholds


def test_each_task_types_torch_model_exports_the_same_contract_and_the_tf_only_kernel_predicts_what_it_does(
    tmp_path, demo_dir, tiny_timm_backbone, monkeypatch
):
    """For each task type, the export's check against the torch model on its verify images, and the inference
    kernel's outputs (probabilities.csv) for all 360 test images against the torch model's own, both sides on the
    CPU in float32 (plain torch; TensorFlow); the submission in the template's columns and order, with the task's
    values."""
    import shutil

    import common.training.backends.torch_shared.export as torch_export

    # Each task's export writes its job folder as the training kernel's fold would; the three jobs then run in one
    # export child (EXPORT_JOBS), the product's own main for each.
    jobs = []
    monkeypatch.setattr(
        torch_export, "_run_child", lambda job: jobs.append(shutil.copytree(job, tmp_path / f"job{len(jobs)}"))
    )
    monkeypatch.setattr(torch_export, "read_card", lambda folder: None)
    exported, inference, answers_of = {}, [], {}
    for task in TASKS:
        competition, answers_of[task] = task_competition(demo_dir, tmp_path / task / "competition", task)
        exported[task] = export_untrained(task, competition, tiny_timm_backbone, tmp_path / task / "export" / "fold0")
        inference.append(inference_argv(task, tmp_path / task / "export", competition, tmp_path / task / "infer"))
    child = subprocess.run(
        [sys.executable, "-c", EXPORT_JOBS, *map(str, jobs)],
        cwd=REPO,
        env=torch_export.child_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-3000:]
    infer = run_inference_kernels(inference, blocked=("torch", "torch_xla", "timm", "keras_hub"))
    assert infer.returncode == 0, infer.stdout[-2000:] + infer.stderr[-2000:]

    for task, (model, scaling, thresholds) in exported.items():
        id_col, target_col = SHAPES[task][:2]
        export = tmp_path / task / "export" / "fold0"
        card = json.loads((export / "model_card.json").read_text())
        assert card["task"] == task and card["complete"]
        difference = card["verification"]["max_abs_diff"]["float32"]  # relative to the values' scale (regression)
        # The model trained nowhere but the CPU: its "device" outputs are the reference's own computation.
        assert card["verification"]["device"] == "cpu (plain torch, float32)"
        assert card["verification"]["device_max_abs_diff"] == 0.0
        with np.load(export / "verify_batch.npz") as verify:
            spread = float(np.ptp(verify["predictions"]) / max(1.0, np.abs(verify["predictions"]).max()))
        ids = [a["id"] for a in answers_of[task]]
        expected = torch_predictions(
            model, image_array(tmp_path / task / "competition" / "test" / f"{i}.png" for i in ids), scaling
        )
        saved = read_csv(tmp_path / task / "infer" / "probabilities.csv")
        assert [r[id_col] for r in saved] == ids  # the template's rows, in its order
        outputs = np.array([[float(v) for k, v in r.items() if k != id_col] for r in saved])
        gap = float(np.max(np.abs(outputs - expected)) / max(1.0, np.abs(expected).max()))
        print(
            f"{task} on the torch_xla route's export: verify batch within {difference:.1e} of the torch model on "
            f"the CPU (its outputs spread over {spread:.2f}); the TF-only kernel's {len(ids)} outputs within "
            f"{gap:.1e}"
        )
        assert (
            card["output"]["shape"]
            == [None, expected.shape[1]]
            == [None, {"binary": 1, "multilabel": 4, "regression": 1}[task]]
        )
        assert difference <= 1e-4 and gap <= 1e-4
        assert spread > 0.3  # measured 0.8-1.8: a model whose outputs vary, not one the check cannot tell apart

        submission = read_csv(tmp_path / task / "infer" / "submission.csv")
        assert list(submission[0]) == [id_col, target_col] and [r[id_col] for r in submission] == ids
        values = [r[target_col] for r in submission]
        if task == "multilabel":  # the labels over the card's thresholds, where no output sits on its threshold
            clear = np.all(np.abs(expected - np.array(thresholds)) > 1e-4, axis=1)
            wanted = [
                " ".join(n for n, on in zip(card["class_names"], row >= thresholds, strict=True) if on)
                for row in expected
            ]
            assert [v for v, c in zip(values, clear, strict=True) if c] == [
                w for w, c in zip(wanted, clear, strict=True) if c
            ]
            assert clear.mean() > 0.95
        else:  # P(1), or the value
            np.testing.assert_allclose(
                [float(v) for v in values], expected[:, 0], rtol=0, atol=1e-4 * max(1.0, np.abs(expected).max())
            )
