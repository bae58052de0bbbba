"""Training that outlives a session: a chain of training kernels, each link continuing the one before
(common/training/chain.py, `tpu2gpu continue`), on a simulated /kaggle with the real kaggle CLI against the loopback
Kaggle."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from common.core.config import load_config

import pytest

from builders import says, set_args
from fake_kaggle import MODEL_HANDLE, PROJECT, loopback_kaggle, offline

FOLDS = 3
CHAIN = [
    *PROJECT,
    "kaggle.dataset_sources=[tester/digits-tfrec]",
    "runtime.tfrecords=tester/digits-tfrec",
    "train.fold=-1",
    "train.epochs=3",
]


def simulated_kaggle(root: Path, records: Path, demo_dir: Path, tiny_backbone: Path) -> Path:
    """A fresh /kaggle: the records, the competition and the backbone attached in the newer layout, /kaggle/working
    empty."""
    shutil.copytree(records, root / "input" / "datasets" / "tester" / "digits-tfrec")
    shutil.copytree(demo_dir, root / "input" / "competitions" / "digit-comp")
    shutil.copytree(tiny_backbone, root / "input" / "models" / MODEL_HANDLE.replace("tensorflow2", "TensorFlow2"))
    (root / "working").mkdir()
    return root


def kaggle_env(root: Path, tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_USE_LEGACY_KERAS")}
    tmp.mkdir(exist_ok=True)
    return {
        **env,
        "TPU2GPU_KAGGLE_ROOT": str(root),
        "KAGGLE_KERNEL_RUN_TYPE": "Batch",
        "PYTHONDONTWRITEBYTECODE": "1",
        "TMPDIR": str(tmp),
    }


def run_script(script: Path, root: Path, tmp: Path, gpus: str = "") -> subprocess.CompletedProcess:
    """A built kernel as Kaggle runs it: its script alone in /kaggle/working, no network; `gpus` as
    CUDA_VISIBLE_DEVICES (a T4 x2 session's "0,1"), none by default."""
    shutil.copyfile(script, root / "working" / "__script__.py")
    return subprocess.run(
        offline([sys.executable, "__script__.py"]),
        cwd=root / "working",
        env={**kaggle_env(root, tmp), **({"CUDA_VISIBLE_DEVICES": gpus} if gpus else {})},
        capture_output=True,
        text=True,
        timeout=1800,
    )


def fold_section(log: str, fold: int) -> str:
    return log.split(f"=== fold {fold} ===", 1)[1].split("=== fold", 1)[0]


@pytest.mark.e2e
def test_a_chain_link_resumes_the_cut_fold_trains_the_rest_carries_the_done_and_one_dataset_scores_them(
    tmp_path, demo_dir, tiny_backbone, monkeypatch, capsys
):
    """Link 1 (the training kernel's code on a simulated TPU session) trains fold 0 whole, is cut by its budget after
    fold 1's first epoch and does not start fold 2; `tpu2gpu continue` pushes link 2 attaching link 1; link 2, its
    built script run as Kaggle runs it with link 1's output mounted at /kaggle/input/notebooks/<owner>/<slug>/,
    resumes fold 1 at epoch 2, trains fold 2 and carries fold 0; the three folds are published as one model dataset
    and the inference kernel scores them. Link 1's budget decisions are forced here (their arithmetic is
    test_training's subject): fold 1 is cut after its first epoch, and fold 2 is refused."""
    from common.data.conversion import convert_competition
    from common.training import epoch as epoch_module
    from common.training import run as run_module

    from infer_gpu.infer import main as infer_main
    from tpu2gpu.build import build, kernel_config
    from tpu2gpu.cli import main as cli
    from tpu2gpu.workflow import WorkflowError, one_ensemble
    from train_tpu.train import main as train_main

    cfg = load_config(None, CHAIN)
    convert_competition(demo_dir, tmp_path / "records", load_config(None, [f"data.folds={FOLDS}"]).data)
    build_dir, fetched = tmp_path / "build", tmp_path / "fetched"
    build(cfg, build_dir)

    # ---- link 1: the training kernel's code in this process, on a simulated Kaggle session
    first = simulated_kaggle(tmp_path / "kaggle1", tmp_path / "records", demo_dir, tiny_backbone)
    config_file = tmp_path / "link1.json"
    config_file.write_text(json.dumps(kernel_config(cfg, "train")))
    cuts = iter([False, False, False, True])  # fold 0's three epochs, then fold 1's first
    real_should_start = run_module.should_start
    with monkeypatch.context() as session:
        for name, value in kaggle_env(first, tmp_path / "tmp1").items():
            session.setenv(name, value)
        session.setattr(epoch_module, "cuts_after", lambda *args: next(cuts))
        session.setattr(
            run_module,
            "should_start",
            lambda fold, left, estimate: real_should_start(fold, left if fold < 2 else -1.0, estimate),
        )
        assert train_main(["--config", str(config_file)]) == 0
    log = capsys.readouterr().out
    assert "stopping after epoch 1 (the budget cuts this fold)" in fold_section(log, 1)
    assert "fold 2 not started" in log and "=== fold 2 ===" not in log
    says(log, "left for a later run: fold 1 (cut after epoch 1 of 3), fold 2 (not started)", "continue")
    working = first / "working"
    assert sorted(p.name for p in working.iterdir()) == ["export", "work"]  # the cut fold's work kept in the output
    assert sorted(p.name for p in (working / "work").iterdir()) == ["fold1"]
    progress = json.loads((working / "work" / "fold1" / "checkpoints" / "progress.json").read_text())
    assert progress["epochs_done"] == 1
    assert progress["trained_in"] == [{"run": "tester/tpu2gpu-train", "epochs": [1, 1]}]
    report = json.loads((working / "export" / "training_report.json").read_text())
    assert (report["cut"], report["not_started"], sorted(report["folds"])) == ([1], [2], ["fold0", "fold1"])

    # ---- fetch link 1's output, and `tpu2gpu continue`: link 2 built and pushed, attaching link 1
    link1_files = {str(p.relative_to(working)): p.read_bytes() for p in working.rglob("*") if p.is_file()}
    flags = set_args(*CHAIN)
    with loopback_kaggle(monkeypatch, tmp_path) as recorder:  # held around the Kaggle calls alone
        recorder.kernel_outputs = link1_files
        assert cli(["fetch", "--build", str(build_dir), "--out", str(fetched), *flags]) == 0
        built = (build_dir / "train" / "train.py").read_text()
        recorder.requests.clear()
        assert cli(["continue", "--dry-run", "--build", str(build_dir), "--out", str(fetched), *flags]) == 0
        says(
            capsys.readouterr().out, "tester/tpu2gpu-train-2", "would be built", f"$ kaggle kernels push -p {build_dir}"
        )
        assert (build_dir / "train" / "train.py").read_text() == built and recorder.requests == []  # nothing changed
        assert cli(["continue", "--build", str(build_dir), "--out", str(fetched), *flags]) == 0
        out = capsys.readouterr().out
        says(out, "tester/tpu2gpu-train-2 continues tester/tpu2gpu-train", "fold 1 (cut), fold 2 left")
        pushed = [body for path, body in recorder.requests if path.endswith("SaveKernel")]
        assert len(pushed) == 1, recorder.requests
        assert (pushed[0]["slug"], pushed[0]["newTitle"]) == ("tester/tpu2gpu-train-2", "tpu2gpu train 2")
        assert pushed[0]["kernelDataSources"] == ["tester/tpu2gpu-train"]  # link 1's output, attached
        metadata = json.loads((build_dir / "train" / "kernel-metadata.json").read_text())
        assert (metadata["id"], metadata["title"]) == ("tester/tpu2gpu-train-2", "tpu2gpu train 2")
        assert metadata["kernel_sources"] == ["tester/tpu2gpu-train"]
        assert cli(["continue", "--build", str(build_dir), "--out", str(fetched), *flags]) == 0  # again: no new push
        says(capsys.readouterr().out, "tester/tpu2gpu-train-2 is built and pushed already")
        assert len([path for path, _ in recorder.requests if path.endswith("SaveKernel")]) == 1
    # Link 1's folds alone are not the ensemble its report planned: fold 2 is missing.
    with pytest.raises(WorkflowError) as refused:
        one_ensemble([fetched / "export"])
    says(str(refused.value), "fold 2 is missing (planned, not exported", "--allow-missing")
    assert len(one_ensemble([fetched / "export"], allow_missing=True)) == 2

    # ---- link 2, as Kaggle runs it: link 1's output mounted in the newer layout
    second = simulated_kaggle(tmp_path / "kaggle2", tmp_path / "records", demo_dir, tiny_backbone)
    shutil.copytree(fetched, second / "input" / "notebooks" / "tester" / "tpu2gpu-train")
    run = run_script(build_dir / "train" / "train.py", second, tmp_path / "tmp2")
    log = run.stdout
    assert run.returncode == 0, log[-3000:] + run.stderr[-3000:]
    says(log, "fold0: carried from", "notebooks/tester/tpu2gpu-train")
    says(log, "fold1: its checkpoint after epoch 1 taken from")
    says(log, "fold 1: the time budget cut it after epoch 1", "resuming it")
    resumed = fold_section(log, 1)
    assert "resuming from the checkpoint after epoch 1" in resumed and "[train] epoch 1:" not in resumed
    assert re.search(r"\[train\] epoch 2: step 8,", resumed) and re.search(r"\[train\] epoch 3: step 12,", resumed)
    assert "=== fold 0 ===" not in log and "fold 0: already exported" in log
    export = second / "working" / "export"
    cards = {k: json.loads((export / f"fold{k}" / "model_card.json").read_text()) for k in range(FOLDS)}
    link1_card = json.loads((working / "export" / "fold0" / "model_card.json").read_text())
    assert cards[0] == link1_card  # carried as it was
    assert cards[1]["trained_in"] == [
        {"run": "tester/tpu2gpu-train", "epochs": [1, 1]},
        {"run": "tester/tpu2gpu-train-2", "epochs": [2, 3]},
    ]
    assert cards[1]["metrics"]["optimizer_steps"] == 3 * 4 and not cards[1]["time_budget"]["cut"]
    assert cards[2]["trained_in"] == [{"run": "tester/tpu2gpu-train-2", "epochs": [1, 3]}]
    report = json.loads((export / "training_report.json").read_text())
    assert (report["cut"], report["not_started"], sorted(report["folds"])) == ([], [], ["fold0", "fold1", "fold2"])
    splits = json.loads((tmp_path / "records" / "manifest.json").read_text())["splits"]
    assert report["out_of_fold"]["unique_ids"] == sum(splits[f"fold{k}"]["count"] for k in range(FOLDS)) == 1437
    assert sorted(p.name for p in (second / "working").iterdir()) == ["__script__.py", "export"]  # nothing left

    # ---- one model dataset of the three folds; and `tpu2gpu workflow` runs the same chain: link 1 pushed, waited for
    # and fetched, link 2 continued, pushed, waited for and fetched, then the three folds published and the inference
    # kernel pushed
    with loopback_kaggle(monkeypatch, tmp_path) as recorder:
        assert cli(["publish", "--build", str(build_dir), "--export", str(export), *flags]) == 0
        assert {"fold0.zip", "fold1.zip", "fold2.zip"} <= {name for name, _ in recorder.uploads}
        link2_files = {str(p.relative_to(second / "working")): p.read_bytes() for p in export.rglob("*") if p.is_file()}
        recorder.outputs_of = {"tester/tpu2gpu-train": link1_files, "tester/tpu2gpu-train-2": link2_files}
        recorder.requests.clear()
        loop = ["workflow", "--interval", "0", "--build", str(tmp_path / "build-loop"), "--out", str(tmp_path / "loop")]
        assert cli([*loop, *flags]) == 0
        calls = [
            (path.rsplit("/", 1)[-1], body.get("slug") or body.get("kernelSlug"))
            for path, body in recorder.requests
            if "Kernel" in path
        ]
        calls = [call for i, call in enumerate(calls) if not i or call != calls[i - 1]]  # an output's pages as one
        assert calls == [
            ("SaveKernel", "tester/tpu2gpu-train"),
            ("GetKernelSessionStatus", "tpu2gpu-train"),
            ("ListKernelSessionOutput", "tpu2gpu-train"),
            ("SaveKernel", "tester/tpu2gpu-train-2"),
            ("GetKernelSessionStatus", "tpu2gpu-train-2"),
            ("ListKernelSessionOutput", "tpu2gpu-train-2"),
            ("SaveKernel", "tester/tpu2gpu-infer"),
            ("GetKernelSessionStatus", "tpu2gpu-infer"),
        ], calls
        recorded = json.loads((tmp_path / "build-loop" / "train" / "links.json").read_text())
        assert recorded == [
            {"kernel": "tester/tpu2gpu-train", "version": 1},
            {"kernel": "tester/tpu2gpu-train-2", "version": 1},
        ]
        assert sorted(p.name for p in (tmp_path / "loop" / "export").iterdir()) == [
            "dataset-metadata.json",
            "fold0",
            "fold1",
            "fold2",
            "training_report.json",
        ]
        short = [
            "workflow",
            "--interval",
            "0",
            "--build",
            str(tmp_path / "build-short"),
            "--out",
            str(tmp_path / "short"),
        ]
        assert cli([*short, *flags, *set_args("kaggle.max_links=1")]) == 2
        says(
            capsys.readouterr().err,
            "folds are still left after kaggle.max_links=1 links",
            "build-short/train",
            "tpu2gpu continue",
        )

    # ---- the inference kernel scores the three folds
    infer_out = tmp_path / "infer"
    inference = set_args(f"infer.exports=[{export}]", f"runtime.competition_dir={demo_dir}")
    assert infer_main([*inference, *set_args(f"runtime.output_dir={infer_out}")]) == 0
    log = capsys.readouterr().out
    assert all(f"{export / f'fold{k}'}" in log for k in range(FOLDS))
    assert len((infer_out / "submission.csv").read_text().splitlines()) == 361

    # ---- the older mount layout (/kaggle/input/<slug>): link 2 takes the same
    from common.training.chain import previous_run, take_previous_run

    third = tmp_path / "kaggle3"
    shutil.copytree(fetched, third / "input" / "tpu2gpu-train")
    monkeypatch.setenv("TPU2GPU_KAGGLE_ROOT", str(third))
    previous = previous_run("tester/tpu2gpu-train")
    assert previous == third / "input" / "tpu2gpu-train"
    link = load_config(None, [*CHAIN, "kaggle.train_kernel=tpu2gpu-train-2"])
    take_previous_run(previous, link, third / "working", third / "temp")
    assert sorted(p.name for p in (third / "working" / "export").iterdir()) == ["fold0", "fold1"]
    assert json.loads((third / "temp" / "work" / "fold1" / "checkpoints" / "progress.json").read_text()) == progress


def test_a_link_whose_source_is_missing_stops_before_training_in_one_line(tmp_path, demo_dir, tiny_backbone):
    """The link's kernel with nothing of the previous link attached (a wrong slug, a source Kaggle dropped): one
    line naming both layouts it looked in, exit 2, nothing written."""
    from tpu2gpu.build import build

    link = ["kaggle.train_kernel=tpu2gpu-train-2", "runtime.continue_from=tester/tpu2gpu-train"]
    cfg = load_config(None, [*CHAIN, *link])
    build(cfg, tmp_path / "build")
    root = tmp_path / "kaggle"
    (root / "input" / "datasets").mkdir(parents=True)
    (root / "working").mkdir()
    run = run_script(tmp_path / "build" / "train" / "train.py", root, tmp_path / "tmp")
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert len(run.stderr.splitlines()) == 1, run.stderr
    says(
        run.stderr,
        "runtime.continue_from='tester/tpu2gpu-train': no such input",
        f"{root / 'input' / 'notebooks' / 'tester' / 'tpu2gpu-train'}",
        f"{root / 'input' / 'tpu2gpu-train'}",
        "Nothing was trained",
        "kernel_sources",
        "COMPLETE",
    )
    assert "=== fold" not in run.stdout
    assert sorted(p.name for p in (root / "working").iterdir()) == ["__script__.py"]


def fetched_run(folder: Path, train_kernel: str, cut: list[int], not_started: list[int]) -> Path:
    """What `tpu2gpu fetch` leaves of a link: its training report (the rest is not read by `continue`)."""
    (folder / "export").mkdir(parents=True)
    config = {"kaggle": {"train_kernel": train_kernel}}
    report = {"folds": {"fold0": {}}, "cut": cut, "not_started": not_started, "config": config}
    (folder / "export" / "training_report.json").write_text(json.dumps(report))
    return folder


def test_continue_numbers_the_links_of_one_chain_and_stops_where_nothing_is_left(tmp_path):
    from tpu2gpu.workflow import WorkflowError, next_link

    cfg = load_config(None, CHAIN)
    link, _ = next_link(cfg, fetched_run(tmp_path / "one", "tpu2gpu-train", [1], [2]))
    assert (link.kaggle.train_kernel, link.kaggle.train_title) == ("tpu2gpu-train-2", "tpu2gpu train 2")
    assert link.runtime.continue_from == "tester/tpu2gpu-train"
    link, _ = next_link(cfg, fetched_run(tmp_path / "two", "tpu2gpu-train-2", [], [2]))
    assert (link.kaggle.train_kernel, link.runtime.continue_from) == ("tpu2gpu-train-3", "tester/tpu2gpu-train-2")
    assert next_link(cfg, fetched_run(tmp_path / "done", "tpu2gpu-train-3", [], []))[0] is None
    with pytest.raises(WorkflowError) as refused:
        next_link(cfg, fetched_run(tmp_path / "other", "someone-elses-train", [1], []))
    says(str(refused.value), "'someone-elses-train'", "no link of 'tpu2gpu-train'", "Fix")
    with pytest.raises(WorkflowError) as refused:
        next_link(cfg, tmp_path / "nothing")
    says(str(refused.value), "no export/training_report.json", "tpu2gpu fetch", "COMPLETE")


def test_a_kernel_that_attaches_its_own_output_is_refused_at_build(tmp_path):
    from tpu2gpu.build import MetadataError, build

    with pytest.raises(MetadataError) as refused:
        build(load_config(None, [*CHAIN, "runtime.continue_from=tester/tpu2gpu-train"]), tmp_path / "build")
    says(str(refused.value), "'tester/tpu2gpu-train' is this kernel itself", "own output", "tpu2gpu continue")


def test_a_push_over_kaggles_concurrent_session_limit_is_one_line_naming_it(tmp_path, recorder):
    """Two training kernels on T4 x2 sessions pushed; Kaggle answers the third GPU push (the inference kernel) with
    its limit, which the CLI prints and exits 0 on."""
    from tpu2gpu.build import build
    from tpu2gpu.workflow import WorkflowError, push

    parts = "kaggle.train_parts=['0,1,2@NvidiaTeslaT4', '3,4@NvidiaTeslaT4']"
    build(load_config(None, [*CHAIN, parts]), tmp_path / "build")
    assert (push(tmp_path / "build", "train-p1"), push(tmp_path / "build", "train-p2")) == (1, 1)
    recorder.save_kernel_extra = {"error": "Maximum batch GPU session count of 2 reached"}
    with pytest.raises(WorkflowError) as refused:
        push(tmp_path / "build", "infer")
    message = str(refused.value)
    assert len(message.splitlines()) == 1, message
    says(message, "at most 2 GPU batch session(s)", "Maximum batch GPU session count of 2 reached", "tpu2gpu wait")
    says(message, f"pushed from {tmp_path / 'build'} since its build: train-p1, train-p2")
    assert not (tmp_path / "build" / "infer" / "pushed.json").exists()


TIMM_PART = (
    "2@NvidiaTeslaT4 train.framework=torch model.backbone=timm model.timm_model=/kaggle/input/tiny-timm/tiny_timm "
    "kaggle.dataset_sources=[tester/digits-tfrec,tester/tiny-timm/1] data.image_size=24 data.augment_on=device "
    "data.rotation=15 data.brightness=0.1 data.cutout=1"
)


@pytest.mark.e2e
def test_folds_split_over_a_tpu_kernel_and_a_gpu_kernel_gather_into_one_dataset_the_inference_kernel_scores(
    tmp_path, demo_dir, tiny_backbone, tiny_timm_backbone, monkeypatch, capsys
):
    """kaggle.train_parts: folds 0 and 1 on the TPU kernel (tf_keras, a TF Hub backbone, 16 px), fold 2 on a T4 x2
    kernel (torch, a timm model, 24 px), each built script run as Kaggle runs it; `fetch` downloads each kernel's
    output into a folder of its own, `publish` gathers the three folds into one model dataset, and the inference
    kernel scores the mixed ensemble. Two exports of one fold, and an export of other class names, are refused in
    one message.
    The T4 x2 kernel sees two GPUs (CUDA_VISIBLE_DEVICES=0,1): it starts torchrun with one process each, which train
    here on the CPU over gloo (this machine has no CUDA) with the augmentations on the device (a GPU session's two
    cores cannot feed two GPUs), within the T4 session's budget."""
    from common.data.conversion import convert_competition

    from infer_gpu.infer import main as infer_main
    from tpu2gpu import workflow
    from tpu2gpu.build import build
    from tpu2gpu.cli import main as cli

    settings = [*CHAIN, f"data.folds={FOLDS}", f"kaggle.train_parts=['0,1@TpuV5E8', '{TIMM_PART}']", "train.epochs=1"]
    cfg = load_config(None, settings)
    convert_competition(demo_dir, tmp_path / "records", cfg.data)
    build_dir, fetched = tmp_path / "build", tmp_path / "fetched"
    folders = build(cfg, build_dir)
    assert sorted(folders) == ["dataset", "infer", "train-p1", "train-p2"]
    metadata = {k: json.loads((folders[k] / "kernel-metadata.json").read_text()) for k in ("train-p1", "train-p2")}
    assert [(m["id"], m["machine_shape"], m["enable_gpu"]) for m in metadata.values()] == [
        ("tester/tpu2gpu-train-p1", "TpuV5E8", False),
        ("tester/tpu2gpu-train-p2", "NvidiaTeslaT4", True),
    ]

    outputs = {}
    for part, folder in (("p1", "train-p1"), ("p2", "train-p2")):
        root = simulated_kaggle(tmp_path / f"kaggle-{part}", tmp_path / "records", demo_dir, tiny_backbone)
        shutil.copytree(tiny_timm_backbone, root / "input" / "tiny-timm" / "tiny_timm")
        run = run_script(build_dir / folder / "train.py", root, tmp_path / f"tmp-{part}", "0,1" if part == "p2" else "")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert sorted(p.name for p in (root / "working").iterdir()) == ["__script__.py", "export"]
        if part == "p2":
            log = run.stdout + run.stderr
            says(log, "[train] 2 GPUs: torchrun starts the training kernel once per GPU (DistributedDataParallel)")
            says(log, "processes     2 (this is process 1, on cpu); collectives: gloo")
            # The T4 x2 session's budget: 12 h less the export's margin, not the TPU session's 8.25 h.
            says(log, "[train] time budget: 11.25 h", "train.time_budget_hours=0", "NvidiaTeslaT4")
            assert re.search(r"\[torch\] epoch 1: the step waited for input \d+% of \d+ ms a step", log), log[-3000:]
            card = json.loads((root / "working" / "export" / "fold2" / "model_card.json").read_text())
            assert card["complete"] and card["runtime"]["processes"] == 2
            assert card["config"]["data"]["augment_on"] == "device" and card["time_budget"]["budget_hours"] == 11.25
        working = root / "working" / "export"
        outputs[f"tester/tpu2gpu-train-{part}"] = {
            f"export/{p.relative_to(working)}": p.read_bytes() for p in working.rglob("*") if p.is_file()
        }
    with loopback_kaggle(monkeypatch, tmp_path) as recorder:  # held around the Kaggle calls alone
        recorder.outputs_of = outputs
        flags = set_args(*settings)
        assert cli(["fetch", "--build", str(build_dir), "--out", str(fetched), *flags]) == 0
        frameworks = {
            fold: json.loads((fetched / part / "export" / fold / "model_card.json").read_text())["runtime"]["framework"]
            for part, fold in (("train-p1", "fold0"), ("train-p1", "fold1"), ("train-p2", "fold2"))
        }
        assert frameworks == {"fold0": "tf_keras", "fold1": "tf_keras", "fold2": "torch"}
        sizes = [
            json.loads((fetched / p / "export" / f / "model_card.json").read_text())["image_size"]
            for p, f in (("train-p1", "fold0"), ("train-p2", "fold2"))
        ]
        assert sizes == [16, 24]  # mixed routes and image sizes in one ensemble

        assert cli(["publish", "--build", str(build_dir), "--out", str(fetched), *flags]) == 0
        dataset = fetched / "model-dataset"
        assert sorted(p.name for p in dataset.iterdir()) == [
            "dataset-metadata.json",
            "fold0",
            "fold1",
            "fold2",
            "gathered.json",
        ]
        assert {"fold0.zip", "fold1.zip", "fold2.zip"} <= {name for name, _ in recorder.uploads}
    capsys.readouterr()
    inference = set_args(f"infer.exports=[{dataset}]", f"runtime.competition_dir={demo_dir}")
    assert infer_main([*inference, *set_args(f"runtime.output_dir={tmp_path / 'infer'}")]) == 0
    log = capsys.readouterr().out
    assert all(f"{dataset / f'fold{k}'}" in log for k in range(FOLDS)), log
    assert len((tmp_path / "infer" / "submission.csv").read_text().splitlines()) == 361

    # Two exports of one fold, and other class names: one message naming each.
    other = tmp_path / "other" / "export"
    shutil.copytree(fetched / "train-p2" / "export", other)
    card = json.loads((other / "fold2" / "model_card.json").read_text())
    card["class_names"] = [f"c{k}" for k in range(len(card["class_names"]))]
    (other / "fold2" / "model_card.json").write_text(json.dumps(card))
    with pytest.raises(workflow.WorkflowError) as refused:
        workflow.one_ensemble([fetched / "train-p1" / "export", fetched / "train-p2" / "export", other])
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    says(message, "do not make one ensemble", f"{other / 'fold2'} has other class names than", "fold 2 is exported")
    says(message, f"fold 2 is exported twice ({fetched / 'train-p2' / 'export' / 'fold2'} and {other / 'fold2'})")


def test_a_split_that_trains_a_fold_twice_or_never_or_overfills_kaggles_sessions_is_one_error():
    from common.core.errors import ConfigError

    from tpu2gpu.parts import training_kernels

    base = [*CHAIN, f"data.folds={FOLDS}"]
    parts = training_kernels(load_config(None, [*base, f"kaggle.train_parts=['0,1@TpuV5E8', '{TIMM_PART}']"]))
    assert [(p.folder, p.cfg.kaggle.train_kernel, p.cfg.train.folds) for p in parts] == [
        ("train-p1", "tpu2gpu-train-p1", (0, 1)),
        ("train-p2", "tpu2gpu-train-p2", (2,)),
    ]
    assert (parts[1].cfg.train.framework, parts[1].cfg.kaggle.train_accelerator) == ("torch", "NvidiaTeslaT4")
    wrong = "kaggle.train_parts=['0,1@TpuV5E8', '1@TpuV5E8']"
    with pytest.raises(ConfigError) as refused:
        training_kernels(load_config(None, [*base, wrong]))
    says(str(refused.value), "fold 1 in tpu2gpu-train-p1 and tpu2gpu-train-p2", "fold 2 in none", "2 parts on a TPU")
    with pytest.raises(ConfigError) as refused:
        training_kernels(load_config(None, [*base, "kaggle.train_parts=['TpuV5E8']"]))
    says(str(refused.value), "kaggle.train_parts[0]='TpuV5E8'", "FOLDS@ACCELERATOR")


@pytest.mark.e2e
def test_a_cut_folds_checkpoint_outlives_its_scratch_folder_and_a_run_that_cannot_start_it(
    train_argv, tmp_path, monkeypatch, capsys
):
    """runtime.scratch_dir apart from the output: the budget cuts fold 0 after epoch 1 (forced), and its work folder is
    kept in the output. The scratch folder is lost (another machine); a run whose budget cannot start the fold puts the
    checkpoint back, keeps it and reports the fold cut; the next run resumes it at epoch 2 and ends it at epoch 3."""
    from common.training import epoch as epoch_module
    from common.training import run as run_module

    from train_tpu.train import main as train_main

    argv = train_argv("train.epochs=3", f"runtime.scratch_dir={tmp_path / 'scratch'}")
    out = tmp_path / "out"
    with monkeypatch.context() as session:
        session.setattr(epoch_module, "cuts_after", lambda done, *args: done == 1)
        assert train_main(argv) == 0
    says(capsys.readouterr().out, "stopping after epoch 1", f"kept in {out / 'work' / 'fold0'}")
    shutil.rmtree(tmp_path / "scratch")
    with monkeypatch.context() as session:
        session.setattr(run_module, "should_start", lambda fold, left, estimate: (False, f"fold {fold} not started"))
        assert train_main(argv) == 0
    log = capsys.readouterr().out
    says(log, "fold0: its checkpoint after epoch 1 put back from", "fold 0: the time budget cut it after epoch 1")
    says(log, "fold 0 not started", "left for a later run: fold 0 (cut after epoch 1 of 3)")
    assert json.loads((out / "export" / "training_report.json").read_text())["cut"] == [0]
    assert train_main(argv) == 0
    log = capsys.readouterr().out
    assert "resuming from the checkpoint after epoch 1" in log and "[train] epoch 1:" not in log
    assert re.search(r"\[train\] epoch 3: step 12,", log), log[-2000:]
    report = json.loads((out / "export" / "training_report.json").read_text())
    assert report["cut"] == [] and not (out / "work" / "fold0" / "checkpoints").exists()
