"""The backend seam holds: a third training backend, defined in this file alone, trains a fold through the real
training kernel and exports the contract that the inference kernel loads, without a change to any product module.

The third backend is Keras 3 on its TensorFlow backend (train.framework=keras_tf): the keras_jax backend's Keras 3
code (model, .npz checkpoints, EMA swap, export child) with its own devices, runtime record and exact float32 (the
export's reference, on the host CPU). It is added to
the route table at run time (common/launch/routes.py ROUTES) in a child interpreter, since Keras picks its backend
once per process and this one runs Keras 3 on JAX.
"""

import json
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

from common.launch.routes import ROUTES, Route, framework_choices
from common.training.backends.base import Backend
from common.training.plan import whole_executions

import pytest

from builders import read_csv, set_args

REPO = Path(__file__).resolve().parents[1]

THIRD_BACKEND = textwrap.dedent('''
    import os
    import sys

    import common
    from common.launch import backbones, routes


    def prepare():
        os.environ["KERAS_BACKEND"] = "tensorflow"  # before keras is first imported


    def start(cfg):
        import keras

        from common.tasks.parts import keras_ops
        from common.training.backends.base import Backend
        from common.training.backends.keras_jax.backend import JaxBackend

        class KerasOnTensorFlow(JaxBackend):
            """Keras 3 on its TensorFlow backend, one device: the Keras 3 route's code, its own hardware."""

            name = "keras_tf"
            abilities = frozenset({"step_memory"})  # keras_jax's step weighing; its compiles are not counted

            def __init__(self, cfg):
                self.cfg, self.ops, self.model = cfg, keras_ops(), None
                self.devices, self.platform, self.policy = ["cpu"], "cpu", "float32"

            @property
            def replicas(self):
                return 1

            def runtime(self):
                return {"framework": self.name, "keras": keras.__version__, "keras_backend": keras.backend.backend(),
                        "steps_per_execution": self.steps_per_execution}

            def device_memory(self):
                return None, "Keras 3 on TensorFlow's CPU reports no memory size"  # JaxBackend's asks JAX's devices

            def float32_outputs(self, images, on_host):
                """Its own framework's exact float32 on the host: TensorFlow's /CPU:0 with TF32 off."""
                import contextlib

                from common.export.writer import exact_float32_on_host, tensorflow_outputs

                copy = self._build("float32")
                copy.set_weights(self.model.get_weights())
                with exact_float32_on_host() if on_host else contextlib.nullcontext():
                    return tensorflow_outputs(copy, images)

        backend = KerasOnTensorFlow(cfg)
        assert isinstance(backend, Backend)
        print(f"framework     Keras {keras.__version__} on {keras.backend.backend()} (train.framework=keras_tf)")
        return backend


    # One entry in the route table, and the backbone family it trains told which builder serves it.
    routes.ROUTES["keras_tf"] = routes.Route(
        "keras_tf", lambda cfg: prepare(), list, "__main__:start", ("gpu", "cpu"), "one", routes.DemoSetup("keras")
    )
    backbones.BACKBONES["keras"].builders["keras_tf"] = "common.training.backends.keras_jax.model:file_features"
    from common.core.errors import run_entry
    from train_tpu.train import main

    run_entry("train_tpu", main, sys.argv[1:])
''')


def backend_class(route):
    """The Backend class of a route: the class in its start's module named as the route."""
    import importlib

    module, _ = route.start.split(":")
    classes = vars(importlib.import_module(module)).values()
    return next(c for c in classes if isinstance(c, type) and getattr(c, "name", None) == route.name)


BACKEND_MEMBERS = {name for name in dir(Backend) if not name.startswith("_")} | set(Backend.__annotations__)
# A child that starts the route's framework first, then checks its backend class here.
CHILD_CHECK = (
    "import common.core.config as c, common.launch.routes as r; from test_backends import protocol_gaps; "
    "r.ROUTES[{name!r}].prepare(c.load_config(None, ['model.backbone=timm'])); print(protocol_gaps(r.ROUTES[{name!r}]))"
)


def protocol_gaps(route) -> list[str]:
    """What the route's backend class lacks of Backend (ops and hosts are set per instance) and of the protocols of
    the abilities it declares."""
    from common.training.backends.base import ABILITIES

    backend = backend_class(route)
    gaps = sorted(BACKEND_MEMBERS - {"ops", "hosts"} - set(dir(backend)))
    gaps += [f"ability {a} undeclared" for a in sorted(backend.abilities - set(ABILITIES))]
    unmet = [a for a in backend.abilities & set(ABILITIES) if not isinstance(backend.__new__(backend), ABILITIES[a])]
    return gaps + [f"ability {a} unmet" for a in sorted(unmet)]


def test_each_route_s_backend_meets_the_protocol_and_the_abilities_it_declares():
    """Every member of Backend on each backend class, and each declared ability's protocol met; an ability nobody
    declared is an error, not a guess. A route whose framework must come before TensorFlow is checked in a child."""
    import os

    from common.training.backends.base import has

    assert {"abilities", "release", "peak_memory", "export"} <= BACKEND_MEMBERS
    for route in ROUTES.values():
        if not route.before_tensorflow:
            assert protocol_gaps(route) == [], route.name
            continue
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
        code = CHILD_CHECK.format(name=route.name)
        child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert child.stdout.splitlines()[-1:] == ["[]"], (route.name, child.stdout[-2000:], child.stderr[-2000:])
    assert framework_choices() == ("auto", *ROUTES)
    with pytest.raises(KeyError, match="'compiles' is not a backend ability: compile_count, step_memory"):
        has(backend_class(ROUTES["tf_keras"]), "compiles")


@pytest.mark.e2e
def test_a_third_backend_defined_in_the_tests_builds_trains_and_its_export_feeds_the_inference_kernel(
    demo_dir, demo_records, tiny_keras_backbone, tmp_path, monkeypatch
):
    from common.core.config import load_config
    from common.launch.backbones import BACKBONES
    from common.launch.routes import DemoSetup

    from infer_gpu.infer import main as infer_main
    from tpu2gpu.build import build

    from fake_kaggle import PROJECT

    # The same entry here: `tpu2gpu build` takes the route, and its kernel's config names it.
    monkeypatch.setitem(
        ROUTES,
        "keras_tf",
        Route("keras_tf", print, list, "third_backend:start", ("gpu", "cpu"), "one", DemoSetup("keras")),
    )
    monkeypatch.setitem(
        BACKBONES["keras"].builders, "keras_tf", "common.training.backends.keras_jax.model:file_features"
    )
    attached = ["kaggle.train_accelerator=NvidiaTeslaT4", "model.keras_backbone=/kaggle/input/extra-data/tiny.keras"]
    cfg = load_config(None, [*PROJECT, "train.framework=keras_tf", "model.backbone=keras", *attached])
    script = next(build(cfg, tmp_path / "build")["train"].glob("*.py")).read_text()
    assert '"framework": "keras_tf"' in script

    records_dir, _ = demo_records
    script = tmp_path / "third_backend.py"
    script.write_text(THIRD_BACKEND)
    settings = [
        "train.framework=keras_tf",
        "model.backbone=keras",
        f"model.keras_backbone={tiny_keras_backbone}",
        "data.image_size=16",
        "data.flip_left_right=false",
        "train.fold=0",
        "train.epochs=4",
        "train.batch_size_per_replica=64",
        "train.learning_rate=0.2",
        "train.export_float16=false",
        f"runtime.tfrecords={records_dir}",
        f"runtime.output_dir={tmp_path / 'train'}",
    ]
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as conftest sets it: Keras 3 on TensorFlow jit-compiles
    run = subprocess.run(
        [sys.executable, str(script), *set_args(*settings)],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "framework     Keras 3.15.1 on tensorflow (train.framework=keras_tf)" in run.stdout
    export = tmp_path / "train" / "export"
    card = json.loads((export / "fold0" / "model_card.json").read_text())
    print(
        f"keras_tf: validation macro_f1 {card['metrics']['macro_f1']:.4f}, export max abs difference "
        f"{card['verification']['max_abs_diff']['float32']:.1e}, {card['metrics']['optimizer_steps']} steps"
    )
    # train.steps_per_execution is 32; executions are the largest divisor of the epoch not above it
    assert card["runtime"] == {
        "framework": "keras_tf",
        "keras": "3.15.1",
        "keras_backend": "tensorflow",
        "steps_per_execution": whole_executions(32, card["metrics"]["steps_per_epoch"]),
    }
    assert card["complete"] is True and card["verification"]["max_abs_diff"]["float32"] < 1e-5
    # Its own exact float32 on the host is the reference; its device is this CPU, whose float32 is exact: no gap.
    assert card["verification"]["device"] == "/job:localhost/replica:0/task:0/device:CPU:0 with TF32 on"
    assert card["verification"]["device_max_abs_diff"] == 0.0
    assert card["metrics"]["optimizer_steps"] == 4 * card["metrics"]["steps_per_epoch"]
    assert card["metrics"]["macro_f1"] >= 0.5  # 4 epochs from scratch on 16 px digits; chance is 0.1

    assert (
        infer_main(
            set_args(
                f"infer.exports=[{export}]",
                f"runtime.competition_dir={demo_dir}",
                f"runtime.output_dir={tmp_path / 'infer'}",
                "data.image_size=16",
            )
        )
        == 0
    )
    rows = read_csv(tmp_path / "infer" / "submission.csv")
    solution = {r["id"]: r["label"] for r in read_csv(demo_dir / "solution.csv")}
    accuracy = sum(r["label"] == solution[r["id"]] for r in rows) / len(rows)
    print(f"keras_tf export through the inference kernel: accuracy {accuracy:.3f} on {len(rows)} test images")
    assert len(rows) == len(solution) and accuracy >= 0.5


def test_the_input_wait_is_the_share_of_the_steps_time_spent_asking_for_batches(monkeypatch):
    """InputWait on a clock of its own: each batch takes 3 s to come and each step 1 s to run; timed from the
    epoch's first step on, the step waited 75% of 4 s a step; before start() or without steps there is no line."""
    from common.training.backends import base

    now = [0.0]
    monkeypatch.setattr(base.time, "perf_counter", lambda: now[0])

    def slow_batches():
        while True:
            now[0] += 3.0
            yield "batch"

    wait = base.InputWait(slow_batches())
    assert wait.text(5) == ""
    next(wait)
    now[0] += 1.0  # the first step
    wait.start()
    for _ in range(4):
        next(wait)
        now[0] += 1.0
    assert wait.text(4) == "the step waited for input 75% of 4000 ms a step"
    assert wait.text(4) == ""  # the stretch is spent: the next epoch starts its own


MISTYPED = {  # route: (settings, names the line must give)
    "tf_keras": (["model.backbone=efficientnet", "model.efficientnet_variant=B9"], ["B0", "B7"]),
    "keras_jax": (["model.backbone=efficientnet", "model.efficientnet_variant=V2X"], ["B0", "V2S", "V2L"]),
    "torch_xla": (["model.backbone=timm", "model.timm_model=resnet5O"], ["resnet50", "resnet50d"]),  # the nearest
    "torch": (["model.backbone=timm", "model.timm_model=efficientnet-b0"], ["efficientnet_b0", "efficientnet_b7"]),
}


@pytest.mark.parametrize("route", sorted(MISTYPED))
def test_an_unknown_family_or_model_name_is_one_line_naming_the_known_ones_from_build_and_the_training_kernel(
    route, tmp_path, capsys
):
    """Checked where the config is read, before any framework is imported: `tpu2gpu build` and the training kernel
    each end with exit 2 and one line, which names the mistyped value and the ones the route knows."""
    from common.core.errors import guarded

    from tpu2gpu.cli import main as cli_main
    from train_tpu.train import main as train_main

    mistyped, names = MISTYPED[route]
    for settings, expected in (
        (["model.backbone=effnet"], ["'effnet'", "'hub'", "'efficientnet'", "'keras'", "'timm'"]),
        (mistyped, [mistyped[-1].split("=")[1], *names]),
    ):
        argv = set_args(f"train.framework={route}", *settings)
        for entry in (
            partial(guarded, "train_tpu", train_main, argv),
            partial(cli_main, ["build", "--out", str(tmp_path / "build"), *argv]),
        ):
            assert entry() == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and all(name in lines[0] for name in expected), (route, lines)
    assert not (tmp_path / "build").exists()
