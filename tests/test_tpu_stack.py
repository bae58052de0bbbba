"""The training kernel's runtime needs, checked before TensorFlow loads: the TPU stack install
(common/launch/tpu_stack.py) and the missing tf-keras error, run through real pip and the built kernel script.

The install is exercised with small stand-in wheels (a `tensorflow` package per TensorFlow distribution, so the
real file collision between tensorflow-cpu, tensorflow and tensorflow-tpu happens in a throwaway venv). The same code
on the real wheels, in Python 3.12 with tensorflow-cpu 2.20.0 like Kaggle's TPU image, is the `tpu_image` test at the
end (downloads about 650 MB; `./dev test -m tpu_image`).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from common.core.config import load_config
from common.launch.tpu_stack import TpuStackError, check_wheels, parse_pins, pin_mismatches

import pytest

from tpu2gpu.build import build

from builders import says, set_args
from fake_kaggle import offline
from fake_tpu import FAKE_TPU_PINS as PINS
from fake_tpu import fake_wheel, tensorflow_wheel, tpu_wheels

REPO = Path(__file__).resolve().parents[1]
PROJECT = [
    "kaggle.owner=tester",
    "kaggle.competition=digit-comp",
    "kaggle.tpu_wheels=tpu-wheels",
    "kaggle.model_sources=[tpu2gpu/tiny-backbone/tensorflow2/demo/1]",
    "model.hub_handle=tpu2gpu/tiny-backbone/tensorflow2/demo/1",
    f"kaggle.tpu_packages=[{','.join(PINS)}]",
]


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory):
    """A throwaway venv in the state `pip install tensorflow-cpu==2.20.0 tensorflow_hub` leaves (docs/kaggle-facts.md):
    two TensorFlow distributions writing one `tensorflow` package, and tf-keras 2.21."""
    root = tmp_path_factory.mktemp("image")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    image = root / "image-wheels"
    tensorflow_wheel(image, "tensorflow-cpu", "2.20.0")
    tensorflow_wheel(image, "tensorflow", "2.21.0")
    fake_wheel(image, "tf-keras", "2.21.0", {"tf_keras/__init__.py": ""}, requires=["tensorflow>=2.21"])
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *sorted(image.glob("*.whl"))], check=True
    )
    # The image's numpy (the kernel imports it before TensorFlow): this project's, same interpreter.
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    venv_site = next((root / "venv" / "lib").glob("python3*/site-packages"))
    for entry in site.iterdir():
        if entry.name == "numpy" or entry.name.startswith(("numpy-", "numpy.libs")):
            (venv_site / entry.name).symlink_to(entry)
    return python


def fresh_copy(image_venv: Path, tmp_path: Path) -> Path:
    """The image venv copied, so each test starts from the image's state. A venv finds its site-packages from where
    its interpreter link lies; only its entry scripts name the old path, and pip runs as `python -m pip` here."""
    copy = tmp_path / "venv"
    shutil.copytree(image_venv.parents[1], copy, symlinks=True)
    return copy / "bin" / "python"


def run_in(python: Path, code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    environment.pop("VIRTUAL_ENV", None)
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=environment)


def distributions(python: Path) -> dict[str, str]:
    out = run_in(
        python, "from common.launch.tpu_stack import installed_versions as v; import json; print(json.dumps(v()))"
    )
    assert out.returncode == 0, out.stderr
    import json

    return {
        k: v
        for k, v in json.loads(out.stdout).items()
        if k in {"tensorflow", "tensorflow-cpu", "tensorflow-tpu", "libtpu", "tf-keras", "tensorflow-hub"}
    }


# ------------------------------------------------------------------------------------------------------ pure checks
def test_pins_are_exact_and_name_the_stack():
    assert parse_pins(PINS) == {
        "tensorflow-tpu": "2.20.0",
        "libtpu": "0.0.21",
        "tf-keras": "2.20.1",
        "tensorflow-hub": "0.16.1",
    }
    assert parse_pins(["TF_Keras==2.20.1", "tensorflow_tpu==2.20.0", "libtpu==0.0.21"])["tf-keras"] == "2.20.1"
    with pytest.raises(TpuStackError, match=r"'tensorflow-tpu>=2\.20' must be an exact pin name==version"):
        parse_pins(["tensorflow-tpu>=2.20"])
    with pytest.raises(TpuStackError, match=r"lacks \['libtpu'\]"):
        parse_pins(["tensorflow-tpu==2.20.0", "tf-keras==2.20.1"])


def test_the_environment_is_compared_with_the_pins():
    pins = parse_pins(PINS)
    kaggle_image = {
        "tensorflow-cpu": "2.20.0",
        "tensorflow": "2.21.0",
        "tf-keras": "2.21.0",
        "keras": "3.11.0",
        "tensorflow-hub": "0.16.1",
    }
    assert pin_mismatches(pins, kaggle_image) == [
        "tensorflow-tpu not installed (pinned 2.20.0)",
        "libtpu not installed (pinned 0.0.21)",
        "tf-keras 2.21.0 (pinned 2.20.1)",
        "tensorflow 2.21.0 (shares the `tensorflow` package; must go)",
        "tensorflow-cpu 2.20.0 (shares the `tensorflow` package; must go)",
    ]
    stack = {"tensorflow-tpu": "2.20.0", "libtpu": "0.0.21", "tf-keras": "2.20.1", "tensorflow-hub": "0.16.1"}
    assert pin_mismatches(pins, stack) == []
    assert pin_mismatches(parse_pins(["tensorflow-tpu==2.20", "libtpu==0.0.21", "tf-keras==2.20.1"]), stack) == []
    assert pin_mismatches(pins, {**stack, "libtpu": "0.0.17"}) == ["libtpu 0.0.17 (pinned 0.0.21)"]


def test_wheel_folder_checks_name_the_missing_and_the_corrupt(tmp_path):
    folder = tpu_wheels(tmp_path / "wheels")
    assert len(check_wheels(parse_pins(PINS), folder)) == 4
    assert len(check_wheels(parse_pins(["tensorflow-tpu==2.20", "libtpu==0.0.21", "tf-keras==2.20.1"]), folder)) == 3
    (folder / "libtpu-0.0.21-py3-none-any.whl").unlink()
    with pytest.raises(TpuStackError, match=r"lack \['libtpu==0\.0\.21'\] \(it holds \['tensorflow_hub"):
        check_wheels(parse_pins(PINS), folder)
    fake_wheel(folder, "libtpu", "0.0.21", {"libtpu/__init__.py": ""})
    hub = folder / "tensorflow_hub-0.16.1-py3-none-any.whl"
    hub.write_bytes(hub.read_bytes()[:-40])  # a truncated download
    with pytest.raises(TpuStackError, match=r"corrupt wheel .*tensorflow_hub-0\.16\.1-py3-none-any\.whl"):
        check_wheels(parse_pins(PINS), folder)


# ------------------------------------------------------------------------------------------- real pip, fake wheels
@pytest.mark.e2e
def test_install_replaces_every_tensorflow_with_the_tpu_build(image_venv, tmp_path):
    python = fresh_copy(image_venv, tmp_path)
    assert distributions(python) == {"tensorflow": "2.21.0", "tensorflow-cpu": "2.20.0", "tf-keras": "2.21.0"}
    wheels = tmp_path / "wheels"
    tpu_wheels(wheels / "nested" / "deeper")  # a dataset made from a zip may hold its files in sub-folders
    out = run_in(
        python,
        f"from common.launch.tpu_stack import install_from, parse_pins; "
        f"print(install_from({str(wheels)!r}, parse_pins({list(PINS)!r})))",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['tensorflow 2.21.0', 'tensorflow-cpu 2.20.0', 'tf-keras 2.21.0']"
    assert distributions(python) == {
        "tensorflow-tpu": "2.20.0",
        "libtpu": "0.0.21",
        "tf-keras": "2.20.1",
        "tensorflow-hub": "0.16.1",
    }  # tf-keras did not pull `tensorflow` back
    built = run_in(python, "import tensorflow, tf_keras, tensorflow_hub, libtpu; print(tensorflow.BUILD)")
    assert built.stdout.strip() == "tensorflow-tpu"  # the TPU build's files survived the removal of the others


@pytest.mark.e2e
@pytest.mark.parametrize("damage", ["missing", "corrupt", "other-python"])
def test_a_bad_wheels_folder_leaves_the_image_untouched(image_venv, tmp_path, damage):
    python = fresh_copy(image_venv, tmp_path)
    wheels = tpu_wheels(tmp_path / "wheels")
    keras = wheels / "tf_keras-2.20.1-py3-none-any.whl"
    if damage == "missing":
        keras.unlink()
        expected = r"lack \['tf-keras==2\.20\.1'\]"
    elif damage == "corrupt":
        keras.write_bytes(b"not a zip")
        expected = r"corrupt wheel .*tf_keras-2\.20\.1"
    else:  # built for another Python and platform only: pip's dry run refuses it before anything is removed
        keras.unlink()
        fake_wheel(wheels, "tf-keras", "2.20.1", {"tf_keras/__init__.py": ""}, tag="cp399-cp399-manylinux_2_17_x86_64")
        expected = r"checking the wheels .* failed .*no wheel of tf-keras==2\.20\.1 fits Python"
    before = distributions(python)
    out = run_in(
        python,
        f"from common.launch.tpu_stack import install_from, parse_pins; "
        f"install_from({str(wheels)!r}, parse_pins({list(PINS)!r}))",
    )
    assert out.returncode == 1 and "TpuStackError" in out.stderr
    import re

    assert re.search(expected, out.stderr, flags=re.S), out.stderr[-1500:]
    assert distributions(python) == before


@pytest.mark.e2e
def test_the_kernel_installs_from_the_attached_wheels_and_runs_once_more(image_venv, tmp_path):
    """ensure_tpu_stack as the built kernel calls it: wheels found in the simulated /kaggle/input, installed, then
    the re-run interpreter (marked by the environment) checks the pins instead of installing again."""
    python = fresh_copy(image_venv, tmp_path)
    tpu_wheels(tmp_path / "kaggle" / "input" / "datasets" / "tester" / "tpu-wheels")
    code = f"""
import json, subprocess, sys
from types import SimpleNamespace
from common.launch.negotiation import ensure_tpu_stack
cfg = SimpleNamespace(tpu_packages={list(PINS)!r}, tpu_wheels="tpu-wheels", train_internet=False, tpu_find_links="",
                      owner="tester", tpu_probe_seconds=60)
def rerun(env):
    check = "from common.launch.negotiation import ensure_tpu_stack as e; import sys, json; " \\
            "cfg = json.loads(sys.argv[1]); from types import SimpleNamespace as N; " \\
            "print('rerun:', e(N(**cfg), None))"
    return subprocess.run([sys.executable, "-c", check, json.dumps(vars(cfg))], env={{**__import__('os').environ,
                          **env}}).returncode
print("exit", ensure_tpu_stack(cfg, rerun))
"""
    out = run_in(python, code, {"TPU2GPU_KAGGLE_ROOT": str(tmp_path / "kaggle")})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    says(
        lines[0],
        "[tpu] installing the TPU stack",
        "tensorflow-tpu not installed",
        "2.20.0",
        "libtpu not installed",
        "0.0.21",
        "tf-keras 2.21.0",
        "2.20.1",
        "tensorflow-hub not installed",
        "0.16.1",
        "tensorflow 2.21.0",
        "must go",
        "tensorflow-cpu 2.20.0",
        "must go",
    )
    says(
        lines[1],
        "[tpu] installed",
        "tensorflow-tpu==2.20.0, libtpu==0.0.21, tf-keras==2.20.1, tensorflow-hub==0.16.1",
        "tpu-wheels",
        "removed",
        "tensorflow 2.21.0, tensorflow-cpu 2.20.0, tf-keras 2.21.0",
    )
    # Probed in a child interpreter (the stand-in TPU answers), then the kernel runs again with that stack.
    says(lines[2], "[tpu] try 1/1", "probing", "tensorflow-tpu 2.20.0 + libtpu 0.0.21 (StreamExecutor)", "60 s")
    says(
        lines[3],
        "[tpu] try 1/1",
        "tensorflow-tpu 2.20.0 + libtpu 0.0.21 (StreamExecutor)",
        "answered",
        "8 TPU devices",
        "TensorFlow 2.20.0",
    )
    assert lines[4:] == ["[tpu] running the kernel again in a fresh interpreter", "rerun: None", "exit 0"]
    # A re-run that finds the stack not as pinned stops instead of installing again (no loop).
    tensorflow_wheel(tmp_path / "more", "tensorflow-cpu", "2.20.0")
    run_in(
        python,
        f"import subprocess, sys; subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', "
        f"'--no-deps', {str(next((tmp_path / 'more').glob('*.whl')))!r}], check=True)",
    )
    again = run_in(
        python,
        code.replace('print("exit", ensure_tpu_stack(cfg, rerun))', "ensure_tpu_stack(cfg, None)"),
        {"TPU2GPU_TPU_STACK_INSTALLED": "1"},
    )
    says(again.stderr, "TPU stack was installed", "tensorflow-cpu 2.20.0", "must go")


@pytest.mark.e2e
def test_the_online_route_downloads_the_pins_and_names_one_the_index_lacks(image_venv, tmp_path):
    """kaggle.train_internet=true and nothing attached: pip downloads exactly the pins (here from a local index,
    PIP_NO_INDEX + PIP_FIND_LINKS, the same pip code path as the package index), then installs as offline."""
    python = fresh_copy(image_venv, tmp_path)
    index = tpu_wheels(tmp_path / "index")
    code = f"""
from types import SimpleNamespace
from common.launch.negotiation import ensure_tpu_stack
cfg = SimpleNamespace(tpu_packages={list(PINS)!r}, tpu_wheels="", train_internet=True, tpu_find_links="",
                      owner="tester", tpu_probe_seconds=60)
print("exit", ensure_tpu_stack(cfg, lambda env: 0))
"""
    env = {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(index),
        "TMPDIR": str(tmp_path),
        "TPU2GPU_KAGGLE_ROOT": str(tmp_path / "kaggle"),
    }
    (index / "libtpu-0.0.21-py3-none-any.whl").rename(tmp_path / "aside.whl")
    before = distributions(python)
    missing = run_in(python, code, env)
    assert "downloading tensorflow-tpu==2.20.0" in missing.stdout
    says(
        missing.stderr,
        "TpuStackError: ",
        "none of the 1 TensorFlow TPU stacks",
        "1. tensorflow-tpu 2.20.0 + libtpu 0.0.21 (StreamExecutor)",
        "not installed",
        "tensorflow-tpu==2.20.0, libtpu==0.0.21",
    )
    assert "no wheel of libtpu==0.0.21 fits Python" in missing.stderr
    assert distributions(python) == before  # nothing removed
    (tmp_path / "aside.whl").rename(index / "libtpu-0.0.21-py3-none-any.whl")
    done = run_in(python, code, env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "from the package index in" in done.stdout and done.stdout.strip().endswith("exit 0")
    assert distributions(python)["tensorflow-tpu"] == "2.20.0"


# --------------------------------------------------------------------------------------- the built kernel script
def simulated_kaggle(tmp_path: Path, script: Path) -> tuple[Path, dict]:
    kaggle = tmp_path / "kaggle"
    (kaggle / "working").mkdir(parents=True)
    (kaggle / "input").mkdir()
    shutil.copyfile(script, kaggle / "working" / "__script__.py")
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_USE_LEGACY_KERAS", "VIRTUAL_ENV")}
    env.update(
        TPU2GPU_KAGGLE_ROOT=str(kaggle),
        KAGGLE_KERNEL_RUN_TYPE="Batch",
        TMPDIR=str(tmp_path / "tmp"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    return kaggle, env


@pytest.mark.e2e
def test_tpu_kernel_without_a_route_names_both_before_reading_data(tmp_path):
    cfg = load_config(None, [*PROJECT, "kaggle.tpu_runtime=image"])  # builds; the kernel then finds no TPU build
    folders = build(cfg, tmp_path / "build")
    kaggle, env = simulated_kaggle(tmp_path, folders["train"] / "train.py")
    env["ISTPUVM"] = "1"
    config = kaggle / "working" / "__script__.py"
    config.write_text(
        config.read_text()
        .replace('"tpu_runtime": "image"', '"tpu_runtime": "install"')
        .replace('"tpu_wheels": "tpu-wheels"', '"tpu_wheels": ""')
    )
    run = subprocess.run(
        [sys.executable, "__script__.py"], cwd=kaggle / "working", env=env, capture_output=True, text=True
    )
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    says(
        run.stderr,
        "train: error: ",
        "TPU stack",
        "tensorflow 2.21.0",
        "tensorflow-tpu==2.20.0, libtpu==0.0.21, tf-keras==2.20.1, tensorflow-hub==0.16.1",
        "kaggle.tpu_wheels is empty",
        "kaggle.train_internet is false",
        "Fix:",
        "`tpu2gpu wheels",
        "kaggle.train_internet=true",
    )
    assert "Traceback" not in run.stderr and "=== environment ===" not in run.stdout  # before TensorFlow and data


@pytest.mark.e2e
def test_missing_tf_keras_is_named_by_the_built_kernel(tmp_path):
    """A real environment with TensorFlow (and Keras 3) but no tf-keras: this project's packages minus tf_keras,
    seen by a bare venv through a .pth file."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    without = tmp_path / "site-without-tf-keras"
    without.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(("tf_keras", "tf-keras", "__editable__", "tpu2gpu")):
            (without / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    venv_site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (venv_site / "image.pth").write_text(str(without) + "\n")
    python = tmp_path / "venv" / "bin" / "python"
    probe = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util as u; print(bool(u.find_spec('tensorflow')), "
            "bool(u.find_spec('tf_keras')), bool(u.find_spec('common')))",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert probe.stdout.split() == ["True", "False", "False"]  # TensorFlow yes, tf_keras no, this repository no

    folders = build(load_config(None, PROJECT), tmp_path / "build")
    kaggle, env = simulated_kaggle(tmp_path, folders["train"] / "train.py")
    run = subprocess.run([python, "__script__.py"], cwd=kaggle / "working", env=env, capture_output=True, text=True)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    says(
        run.stderr, "train: error: ", "tf_keras", "tensorflow 2.21.0", "Fix:", "pip install --no-deps tf-keras==2.21.*"
    )
    assert "Traceback" not in run.stderr and "Keras cannot be imported" not in run.stderr


# ------------------------------------------------------------------------------ the real stack on the image's state
PYTHON_312 = os.environ.get("TPU2GPU_PYTHON312") or next(
    (str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))), shutil.which("python3.12")
)


@pytest.mark.e2e
@pytest.mark.tpu_image
def test_the_real_tpu_stack_replaces_the_images_tensorflow_and_the_kernel_runs_again(tmp_path, demo_dir):
    """Kaggle's TPU image as far as it can exist here: Python 3.12 with tensorflow-cpu 2.20.0 (docker-python
    tpu/requirements.in), no network for the kernel, ISTPUVM=1, the wheels of every default candidate stack that
    `tpu2gpu wheels` downloads attached as a dataset. The built train.py installs each candidate in turn and probes
    it with the real TensorFlow; there is no TPU here, so every probe must say so and the kernel must end with one
    error listing the four tries (and the environment must hold exactly one TensorFlow, which imports)."""
    if not PYTHON_312 or not Path(PYTHON_312).is_file():
        pytest.fail(f"Python 3.12 is needed (not found at {PYTHON_312}); set TPU2GPU_PYTHON312")
    kaggle = tmp_path / "kaggle"
    wheels = kaggle / "input" / "datasets" / "tester" / "tpu-wheels"
    project = [*PROJECT[:-1], "kaggle.tpu_probe_seconds=180"]  # the default kaggle.tpu_packages
    settings = set_args(*project)
    made = subprocess.run(
        [sys.executable, "-m", "tpu2gpu.cli", "wheels", "--out", str(wheels), *settings],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    print(made.stdout)

    venv = tmp_path / "tpu-image"
    subprocess.run([PYTHON_312, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "tensorflow-cpu==2.20.0"], check=True)

    folders = build(load_config(None, project), tmp_path / "build")
    shutil.copytree(demo_dir, kaggle / "input" / "competitions" / "digit-comp")
    (kaggle / "working").mkdir()
    shutil.copyfile(folders["train"] / "train.py", kaggle / "working" / "__script__.py")
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_USE_LEGACY_KERAS", "VIRTUAL_ENV")}
    env.update(
        TPU2GPU_KAGGLE_ROOT=str(kaggle),
        KAGGLE_KERNEL_RUN_TYPE="Batch",
        ISTPUVM="1",
        TMPDIR=str(tmp_path / "tmp"),
        TPU_SKIP_MDS_QUERY="1",
    )  # else libtpu asks the GCE metadata server 30x
    run = subprocess.run(
        offline([str(python), "__script__.py"]), cwd=kaggle / "working", env=env, capture_output=True, text=True
    )
    print("\n".join(line for line in run.stdout.splitlines() if line.startswith(("[bundle]", "[tpu]"))))
    print(run.stderr[-3000:])
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert "train: error: none of the 4 TensorFlow TPU stacks tried answered:" in run.stderr
    tries = [line for line in run.stdout.splitlines() if re.match(r"\[tpu\] try \d/4: (?!probing)", line)]
    assert len(tries) == 4 and not any("answered:" in line for line in tries), tries
    assert run.stdout.count("[tpu] installed tensorflow-tpu==2.19.1, libtpu==0.0.10,") >= 1
    assert "removed tensorflow-cpu 2.20.0" in run.stdout and "Traceback" not in run.stderr.split("train: error:")[-1]

    check = (
        "import importlib.metadata as m, tensorflow as tf, tf_keras, tensorflow_hub as hub; "
        "names = sorted(d.metadata['Name'].lower().replace('_', '-') for d in m.distributions()); "
        "print([n for n in names if n.startswith(('tensorflow', 'tf-'))]); print(tf.__version__)"
    )
    after = subprocess.run(
        [python, "-c", check],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**env, "TF_USE_LEGACY_KERAS": "1", "TPU_LOAD_LIBRARY": "0"},
    )
    print(after.stdout)
    assert after.returncode == 0, after.stderr[-2000:]
    listed = after.stdout.strip().splitlines()[-2]
    assert listed.startswith("['tensorflow-hub', ") and "tensorflow-tpu" in listed and "tensorflow-cpu" not in listed


@pytest.mark.e2e
@pytest.mark.parametrize("second_interpreter", ["exit", "abort"])
def test_the_built_kernel_installs_and_hands_over_to_its_second_interpreter(image_venv, tmp_path, second_interpreter):
    """The built train.py on a simulated TPU VM: it installs the attached (stand-in) stack, runs itself again, and
    passes the second interpreter's output and exit code through; a second interpreter killed by a signal (what an
    unfit libtpu does at `import tensorflow`) is a named error."""
    python = fresh_copy(image_venv, tmp_path)
    folders = build(load_config(None, PROJECT), tmp_path / "build")
    kaggle, env = simulated_kaggle(tmp_path, folders["train"] / "train.py")
    tpu_wheels(kaggle / "input" / "datasets" / "tester" / "tpu-wheels")
    env.update(ISTPUVM="1", FAKE_TENSORFLOW=second_interpreter)
    run = subprocess.run([python, "__script__.py"], cwd=kaggle / "working", env=env, capture_output=True, text=True)
    installs = [line for line in run.stdout.splitlines() if line.startswith("[tpu] installed")]
    assert len(installs) == 1, run.stdout + run.stderr
    says(installs[0], "tensorflow-tpu==2.20.0, libtpu==0.0.21, tf-keras==2.20.1, tensorflow-hub==0.16.1", "tpu-wheels")
    if second_interpreter == "exit":
        assert run.returncode == 1  # the second interpreter's own exit code
        assert "tensorflow-tpu imported by the kernel's second interpreter" in run.stderr
    else:
        assert run.returncode == 2
        says(
            run.stderr,
            "train: error: ",
            "second interpreter",
            "TPU stack install",
            "signal 6",
            "libtpu",
            "0.0.14-0.0.31",
            "kaggle.tpu_packages",
        )


# ------------------------------------------------------------------------------------------- stack negotiation
CANDIDATES = (("2.19.1", "0.0.10", "2.19.0"), ("2.20.0", "0.0.14", "2.20.1"), ("2.20.0", "0.0.17", "2.20.1"))


def candidate_wheels(folder: Path) -> list[str]:
    """Stand-in wheels of three PJRT candidates (real names, versions and dependencies) in one wheels dataset, and
    the kaggle.tpu_packages entries that name them."""
    entries = []
    for tensorflow, libtpu, keras in CANDIDATES:
        tensorflow_wheel(folder, "tensorflow-tpu", tensorflow)
        fake_wheel(folder, "libtpu", libtpu, {"libtpu/__init__.py": "", "libtpu/libtpu.so": ""})
        minor = ".".join(keras.split(".")[:2])
        fake_wheel(
            folder,
            "tf-keras",
            keras,
            {"tf_keras/__init__.py": ""},
            requires=[f"tensorflow<{minor[:2]}{int(minor[2:]) + 1},>={minor}"],
        )
        entries.append(f"pjrt: tensorflow-tpu=={tensorflow} libtpu=={libtpu} tf-keras=={keras} tensorflow-hub==0.16.1")
    fake_wheel(folder, "tensorflow-hub", "0.16.1", {"tensorflow_hub/__init__.py": ""}, requires=["tf-keras>=2.14.1"])
    return entries


@pytest.mark.e2e
def test_the_kernel_runs_on_the_first_tpu_stack_that_answers_and_names_every_try(image_venv, tmp_path):
    """The built train.py on a simulated TPU VM (ISTPUVM=1, no network): each candidate is installed from the attached
    wheels by real pip and probed in a child interpreter by the real probe (common/launch/probe_child.py). Only the
    stand-in TensorFlow's answer is simulated, by its libtpu: 0.0.10 fails as a libtpu that finds no TPU does, 0.0.14
    hangs past the time limit (killed), 0.0.17 answers. The kernel then runs on the third with its PJRT environment."""
    import json

    python = fresh_copy(image_venv, tmp_path)
    entries = candidate_wheels(tmp_path / "wheels")
    cfg = load_config(None, [*PROJECT, f"kaggle.tpu_packages={json.dumps(entries)}", "kaggle.tpu_probe_seconds=4"])
    kaggle, env = simulated_kaggle(tmp_path, build(cfg, tmp_path / "build")["train"] / "train.py")
    shutil.copytree(tmp_path / "wheels", kaggle / "input" / "datasets" / "tester" / "tpu-wheels")
    env.update(
        ISTPUVM="1",
        FAKE_TENSORFLOW="exit",
        FAKE_TPU_PROBE=json.dumps({"0.0.10": "fail", "0.0.14": "hang", "0.0.17": "answer"}),
    )
    run = subprocess.run(
        offline([python, "__script__.py"]), cwd=kaggle / "working", env=env, capture_output=True, text=True
    )
    print("\n".join(line for line in run.stdout.splitlines() if line.startswith("[tpu]")))
    tries = [line for line in run.stdout.splitlines() if line.startswith("[tpu] try") and "probing" not in line]
    assert len(tries) == 3, run.stdout + run.stderr
    says(
        tries[0],
        "[tpu] try 1/3",
        "tensorflow-tpu 2.19.1 + libtpu 0.0.10 (PJRT)",
        "RuntimeError: No TPU platform registered (libtpu 0.0.10)",
    )
    says(tries[1], "[tpu] try 2/3", "tensorflow-tpu 2.20.0 + libtpu 0.0.14 (PJRT)", "no answer", "4 s", "killed")
    says(
        tries[2],
        "[tpu] try 3/3",
        "tensorflow-tpu 2.20.0 + libtpu 0.0.17 (PJRT)",
        "answered",
        "8 TPU devices",
        "TensorFlow 2.20.0",
    )
    assert "[tpu] running the kernel again in a fresh interpreter" in run.stdout
    # The second interpreter got the stack that answered, with its PJRT environment and the record of every try.
    assert run.returncode == 1
    said = run.stderr.strip().splitlines()[-1]
    assert said.startswith("tensorflow-tpu imported by the kernel's second interpreter with PJRT_DEVICE=TPU and {")
    record = json.loads(said.split(" and ", 1)[1])
    assert record["stack"] == "tensorflow-tpu 2.20.0 + libtpu 0.0.17 (PJRT)" and record["runtime"] == "pjrt"
    assert record["pins"]["libtpu"] == "0.0.17" and [t["answered"] for t in record["tries"]] == [False, False, True]
    assert distributions(python)["libtpu"] == "0.0.17"

    # None answers: one error lists every try and says what to change.
    env["FAKE_TPU_PROBE"] = json.dumps(dict.fromkeys(("0.0.10", "0.0.14", "0.0.17"), "fail"))
    again = subprocess.run(
        offline([python, "__script__.py"]), cwd=kaggle / "working", env=env, capture_output=True, text=True
    )
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert "Traceback" not in again.stderr
    # ... and names the route that needs no TensorFlow TPU build, with the exact change, and why auto did not take it.
    says(
        again.stderr,
        "train: error: ",
        "none of the 3 TensorFlow TPU stacks",
        "1. tensorflow-tpu 2.19.1 + libtpu 0.0.10 (PJRT): RuntimeError: No TPU platform registered (libtpu 0.0.10)",
        "3. tensorflow-tpu 2.20.0 + libtpu 0.0.17 (PJRT): RuntimeError: No TPU platform registered (libtpu 0.0.17)",
        "Fix:",
        "kaggle.tpu_packages",
        "Keras 3 on JAX",
        "--set train.framework=keras_jax",
        "model.backbone=efficientnet",
        "model.backbone=keras",
        "model.keras_backbone",
        "rebuild",
        "train.framework=auto",
        "model.backbone=hub",
    )


def test_a_failed_probe_is_named_by_its_exception_not_by_tensorflows_node_noise():
    from common.launch.negotiation import failure_reason

    # The end of a real probe's stderr here: tensorflow-tpu 2.19.1 + libtpu 0.0.10 under PJRT on a machine with no TPU.
    stderr = """I0000 pjrt_api.cc:145] The PJRT plugin has PJRT API version 0.67.
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
tensorflow.python.framework.errors_impl.UnknownError: Graph execution error:

Detected at node configure_tpu_host/_2 defined at (most recent call last):
<stack traces unavailable>
TPU initialization failed: No ba16c7433 device found.
\t [[{{node configure_tpu_host/_2}}]] [Op:__inference__tpu_init_fn_4]
"""
    assert failure_reason(stderr) == "UnknownError: TPU initialization failed: No ba16c7433 device found."
    assert (
        failure_reason("Traceback ...\nRuntimeError: No TPU platform registered\n")
        == "RuntimeError: No TPU platform registered"
    )
    assert (
        failure_reason("I1123 starting\nF1123 12:00:01 tpu.cc:1] Check failed: chips found\nRAW: signal 6\n")
        == "F1123 12:00:01 tpu.cc:1] Check failed: chips found"
    )
    assert failure_reason("") == "no output"


def test_candidates_parse_in_order_and_the_older_form_is_one_stack():
    from common.launch.negotiation import FIRST_IMPORTED, PJRT, STREAM_EXECUTOR, every_pin, parse_candidates

    candidates = parse_candidates(load_config().kaggle.tpu_packages)
    assert [c.label() for c in candidates] == [
        "tensorflow-tpu 2.19.1 + libtpu 0.0.10 (PJRT)",
        "tensorflow-tpu 2.20.0 + libtpu 0.0.14 (PJRT)",
        "tensorflow-tpu 2.20.0 + libtpu 0.0.17 (PJRT)",
        "the first import (StreamExecutor)",
    ]
    assert candidates[0].runtime == PJRT and candidates[3].runtime == STREAM_EXECUTOR and FIRST_IMPORTED == "*"
    assert [p["libtpu"] for p in every_pin(candidates)] == ["0.0.10", "0.0.14", "0.0.17"]  # what `wheels` fetches
    (older,) = parse_candidates(PINS)
    assert older.runtime == STREAM_EXECUTOR and older.pins["tensorflow-tpu"] == "2.20.0"
    with pytest.raises(TpuStackError, match="must be 'pjrt: PIN PIN ...'"):
        parse_candidates(["gpu: tensorflow-tpu==2.20.0 libtpu==0.0.17 tf-keras==2.20.1"])
    with pytest.raises(TpuStackError, match="starts with 'streamexecutor: \\*', which repeats an earlier candidate"):
        parse_candidates(["streamexecutor: *"])


@pytest.mark.e2e
def test_the_pjrt_environment_points_at_the_installed_libtpu_and_a_stale_lock_is_removed(tmp_path):
    from common.launch.negotiation import clear_stale_lock

    (tmp_path / "libtpu").mkdir()
    (tmp_path / "libtpu" / "__init__.py").write_text("")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from common.launch.negotiation import pjrt_environment as p; import json; print(json.dumps(p()))",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
    )
    import json

    assert json.loads(out.stdout) == {
        "PJRT_DEVICE": "TPU",
        "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
        "TF_XLA_FLAGS": "--tf_mlir_enable_mlir_bridge=true",
        "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": str(tmp_path / "libtpu" / "libtpu.so"),
    }
    lock = tmp_path / "libtpu_lockfile"
    lock.write_text("")
    assert clear_stale_lock(lock) and not lock.exists() and not clear_stale_lock(lock)


@pytest.mark.e2e
def test_the_jax_route_gets_the_images_libtpu_back_after_the_tensorflow_tries(image_venv, tmp_path):
    """Under train.framework=auto a failed negotiation leaves the last try's libtpu installed; JAX needs the image's
    own, so the fallback puts it back from the attached wheels (real pip, --no-deps), and says so."""
    python = fresh_copy(image_venv, tmp_path)
    wheels = tmp_path / "kaggle" / "input" / "datasets" / "tester" / "tpu-wheels"
    for version in ("0.0.10", "0.0.17"):
        fake_wheel(wheels, "libtpu", version, {"libtpu/__init__.py": "", "libtpu/libtpu.so": ""})
    run_in(
        python,
        f"import subprocess, sys; subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', "
        f"'--no-deps', {str(next(wheels.glob('libtpu-0.0.10-*.whl')))!r}], check=True)",
    )
    assert distributions(python)["libtpu"] == "0.0.10"  # what a TensorFlow try left
    code = """
from types import SimpleNamespace
from common.launch.fallback import restore_image_package
cfg = SimpleNamespace(tpu_wheels="tpu-wheels", owner="tester", train_internet=False, tpu_find_links="")
restore_image_package("libtpu", "0.0.17", cfg)
restore_image_package("libtpu", "0.0.17", cfg)  # already the image's: nothing to do
"""
    out = run_in(python, code, {"TPU2GPU_KAGGLE_ROOT": str(tmp_path / "kaggle")})
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()
    says(line, "[tpu]", "libtpu 0.0.17", "JAX")
    assert distributions(python)["libtpu"] == "0.0.17"
    shutil.rmtree(wheels)  # no wheels and no internet: the error names the setting that avoids the tries
    run_in(
        python,
        "import subprocess, sys; subprocess.run([sys.executable, '-m', 'pip', 'uninstall', '-y', '-q', "
        "'libtpu'], check=True)",
    )
    failed = run_in(python, code, {"TPU2GPU_KAGGLE_ROOT": str(tmp_path / "kaggle")})
    assert failed.returncode == 1
    says(failed.stderr, "libtpu 0.0.17", "JAX", "Fix: --set train.framework=keras_jax")


@pytest.mark.e2e
def test_auto_trains_on_keras_jax_in_a_fresh_interpreter_when_no_installed_stack_answers(image_venv, tmp_path):
    """train.framework=auto with a Keras 3 backbone, on a simulated TPU VM whose image holds Keras 3 and JAX (stand-ins
    here: their metadata is what the kernel reads first): every TensorFlow candidate is installed and fails its probe,
    so the kernel says it takes the Keras 3 on JAX route and runs again in a fresh interpreter (its packages changed)
    with keras_jax, KERAS_BACKEND=jax and TensorFlow kept off the TPU; the tries travel with it for the card."""
    import json

    python = fresh_copy(image_venv, tmp_path)
    entries = candidate_wheels(tmp_path / "wheels")
    image = tmp_path / "keras-jax"
    fake_wheel(image, "keras", "3.15.1", {"keras/__init__.py": ""})
    fake_wheel(image, "jax", "0.7.2", {"jax/__init__.py": ""})
    run_in(
        python,
        f"import subprocess, sys; subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', "
        f"'--no-index', '--no-deps', *{[str(w) for w in image.glob('*.whl')]!r}], check=True)",
    )
    cfg = load_config(
        None,
        [
            *PROJECT,
            f"kaggle.tpu_packages={json.dumps(entries)}",
            "kaggle.tpu_probe_seconds=4",
            "model.backbone=efficientnet",
            "model.efficientnet_weights=none",
        ],
    )
    kaggle, env = simulated_kaggle(tmp_path, build(cfg, tmp_path / "build")["train"] / "train.py")
    shutil.copytree(tmp_path / "wheels", kaggle / "input" / "datasets" / "tester" / "tpu-wheels")
    env.update(
        ISTPUVM="1",
        FAKE_TENSORFLOW="exit",
        FAKE_TPU_PROBE=json.dumps(dict.fromkeys(("0.0.10", "0.0.14", "0.0.17"), "fail")),
    )
    run = subprocess.run(
        offline([python, "__script__.py"]), cwd=kaggle / "working", env=env, capture_output=True, text=True
    )
    tpu = [line for line in run.stdout.splitlines() if line.startswith("[tpu]")]
    print("\n".join(tpu))
    assert len(tpu) >= 3, run.stdout + run.stderr
    says(tpu[-3], "[tpu] none of the 3 TensorFlow TPU stacks")
    says(tpu[-2], "[tpu] train.framework=auto", "Keras 3 on JAX", "JAX owns the TPU")
    assert tpu[-1] == "[tpu] running the kernel again in a fresh interpreter"
    assert run.returncode == 1  # the stand-in TensorFlow ends the second interpreter, which got this far
    assert "second interpreter: TPU2GPU_FRAMEWORK=keras_jax, KERAS_BACKEND=jax, TPU_LOAD_LIBRARY=0" in run.stderr
    said = run.stderr.strip().splitlines()[-1]
    assert said.startswith("tensorflow-tpu imported by the kernel's second interpreter with PJRT_DEVICE=unset and")
