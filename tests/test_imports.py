"""Imports run one way: no cycle among the product's modules, each package imports only the floors below it (core
nothing above common.core; the GPU side nothing of the TPU launcher), function-local and relative imports included,
and the code that runs before TensorFlow (common/__init__.py and common/launch/) imports the standard library only.

Each check is a function over a folder, and each has a test showing that it finds what it is for, on a small tree
made here."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "train_tpu", "infer_gpu", "tpu2gpu")
# The floors (docs/design.md, "Floors"): each package and what of the product it may import besides itself. `common`
# is the environment bootstrap (common/__init__.py alone), which the entry points import first; core names nothing of
# common but itself. A module on no floor here is one error until it is given one.
FLOORS = {
    "common": (),
    "common.core": (),
    "common.tasks": ("common", "common.core"),
    "common.export": ("common", "common.core"),
    "common.launch": ("common", "common.core"),
    "common.data": ("common", "common.core", "common.tasks"),
    "common.training": ("common", "common.core", "common.tasks", "common.export", "common.launch", "common.data"),
    "common.inference": ("common", "common.core", "common.tasks", "common.export", "common.data"),
    "train_tpu": (
        "common",
        "common.core",
        "common.tasks",
        "common.export",
        "common.launch",
        "common.data",
        "common.training",
    ),
    "infer_gpu": ("common", "common.core", "common.tasks", "common.export", "common.data", "common.inference"),
    "tpu2gpu": (
        "common",
        "common.core",
        "common.tasks",
        "common.export",
        "common.launch",
        "common.data",
        "common.training",
        "common.inference",
        "train_tpu",
        "infer_gpu",
    ),
}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages) -> dict[str, set[str]]:
    """module -> the product modules it imports anywhere in its code (a `from a import b` where a.b is a module
    counts as importing a.b)."""
    modules = {module_name(root, p): p for package in packages for p in (root / package).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from .y import z
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.add(base)
                targets |= {f"{base}.{alias.name}" for alias in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def floor_of(module: str, floors) -> str | None:
    """The floor a module stands on: the longest package of `floors` that is it or holds it (`common` holds only
    itself, the bootstrap: a new subpackage of common is on no floor until it is given one)."""
    held = [name for name in floors if module == name or (name != "common" and module.startswith(name + "."))]
    return max(held, key=len, default=None)


def climbing_imports(graph: dict[str, set[str]], floors) -> list[str]:
    """'a -> b' for each import of a module on a floor that a's floor may not import (import_graph's edges: every
    import in a's code, function-local and relative ones too)."""
    found = []
    for module, targets in sorted(graph.items()):
        here = floor_of(module, floors)
        if here is None:
            found.append(f"{module} is on no floor")
            continue
        found += [
            f"{module} -> {target}"
            for target in sorted(targets)
            if floor_of(target, floors) not in (here, *floors[here])
        ]
    return found


def non_stdlib_imports(root: Path, modules: list[str]) -> list[str]:
    """Top-level packages other than the standard library's and `common` that importing `modules` loads, in a fresh
    interpreter with only root on the path."""
    code = textwrap.dedent(f"""
        import importlib, sys, sysconfig
        before = set(sys.modules)
        for name in {modules!r}:
            importlib.import_module(name)
        installed = {{sysconfig.get_paths()[k] for k in ("purelib", "platlib")}}
        loaded = {{m.split('.')[0] for m in set(sys.modules) - before}}
        def installed_package(name):  # its file lies in site-packages (the standard library's and ours do not)
            origin = getattr(sys.modules[name], "__file__", None) or ""
            return any(origin.startswith(path) for path in installed)
        print(sorted(m for m in loaded if installed_package(m)))
    """)
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


def launch_modules(root: Path) -> list[str]:
    return ["common", *sorted(module_name(root, p) for p in (root / "common" / "launch").rglob("*.py"))]


def test_the_product_has_no_import_cycle():
    graph = import_graph(REPO, PACKAGES)
    assert len(graph) > 40 and "common.launch.kernel" in graph  # the walk found the packages
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (tmp_path / "pkg" / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.c"] == {"pkg", "pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path, ["pkg"])) is None


def test_each_floor_imports_only_the_floors_below_it():
    graph = import_graph(REPO, PACKAGES)
    # The two rules the floors were drawn for, each in its own words: core stands on nothing above it, and the GPU
    # kernel's code (its entry point, inference, the export it loads) never reaches the TPU launcher.
    core = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.startswith("common.core")
        for t in targets
        if not t.startswith("common.core")
    )
    assert not core, "common/core imports what stands above it: " + ", ".join(core)
    gpu_side = ("infer_gpu", "common.inference", "common.export")
    launcher = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.startswith(gpu_side)
        for t in targets
        if t.startswith("common.launch")
    )
    assert not launcher, "the GPU side imports the TPU launcher (common/launch): " + ", ".join(launcher)
    assert {floor_of(module, FLOORS) for module in graph} == set(FLOORS)  # every module on a floor, none empty
    climbing = climbing_imports(graph, FLOORS)
    assert not climbing, "imports that climb (docs/design.md, Floors; FLOORS above):\n" + "\n".join(climbing)


def test_the_floor_check_finds_an_import_that_climbs(tmp_path):
    files = {
        "common/__init__.py": "import os\n",
        "common/core/__init__.py": "",
        "common/core/config.py": "from common.core import errors\n\n\ndef names():\n"
        "    from common.tasks.types import TASKS  # hidden in a function\n    return TASKS\n",
        "common/core/errors.py": "from .. import launch  # relative, two levels up\n",
        "common/tasks/__init__.py": "",
        "common/tasks/types.py": "from common.core.config import names\nTASKS = {}\n",
        "common/launch/__init__.py": "",
        "common/export/__init__.py": "import common.core.errors\n",
        "common/export/card.py": "def f():\n    import common.launch\n",
        "infer_gpu/__init__.py": "",
        "infer_gpu/infer.py": "import common\nfrom common.launch import kernel\n",
        "common/launch/kernel.py": "from common.core.errors import *  # noqa\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    floors = {
        name: FLOORS[name]
        for name in ("common", "common.core", "common.tasks", "common.export", "common.launch", "infer_gpu")
    }
    graph = import_graph(tmp_path, ["common", "infer_gpu"])
    assert climbing_imports(graph, floors) == [
        "common.core.config -> common.tasks.types",  # in a function
        "common.core.errors -> common",
        "common.core.errors -> common.launch",  # relative
        "common.export.card -> common.launch",
        "infer_gpu.infer -> common.launch",
        "infer_gpu.infer -> common.launch.kernel",
    ]
    (tmp_path / "common/core/config.py").write_text("from common.core import errors\n")
    (tmp_path / "common/core/errors.py").write_text("import sys\n")
    (tmp_path / "common/export/card.py").write_text("from common.core.errors import UserError\n")
    (tmp_path / "infer_gpu/infer.py").write_text("import common\nfrom common.core.errors import guarded\n")
    assert climbing_imports(import_graph(tmp_path, ["common", "infer_gpu"]), floors) == []
    (tmp_path / "common/stray.py").write_text("")
    assert climbing_imports(import_graph(tmp_path, ["common", "infer_gpu"]), floors) == ["common.stray is on no floor"]


# A config each owner refuses: a task tasks does not know, a route launch does not have, a backbone its route does
# not train.
OWNED = {
    "data.task": ["data.task=ordinal"],
    "train.framework": ["train.framework=keras_tf"],
    "model.backbone": ["model.backbone=timm", "train.framework=tf_keras"],
}


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("entry", "keys"),
    [
        ("train_tpu.train", ("data.task", "train.framework", "model.backbone")),
        ("tpu2gpu.cli", ("data.task", "train.framework", "model.backbone")),
        # A built kernel's first reading, before its runtime is ready: the routes (standard library), not the tasks
        # (NumPy, which the TPU stack install may replace); the entry point reads the config again with both.
        ("common.launch.kernel", ("train.framework", "model.backbone")),
    ],
)
def test_an_entry_point_imports_the_owners_of_the_keys_it_reads(entry, keys):
    """What data.task, train.framework and model.backbone mean reaches the config only from their owners, on import
    (common/core/fields.py): an entry point that reads a config imports them first, or a wrong value goes on."""
    code = textwrap.dedent(f"""
        import {entry}
        from common.core.config import load_config
        from common.core.errors import ConfigError
        for key, settings in {OWNED!r}.items():
            try:
                load_config(None, settings)
                print(key, "taken")
            except ConfigError:
                print(key, "refused")
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [word for key in OWNED for word in (key, "refused" if key in keys else "taken")]


@pytest.mark.e2e
def test_the_code_before_tensorflow_imports_the_standard_library_only():
    modules = launch_modules(REPO)
    assert "common.launch.kernel" in modules and "common.launch.negotiation" in modules
    assert non_stdlib_imports(REPO, modules) == []


@pytest.mark.e2e
def test_the_standard_library_check_finds_a_third_party_import(tmp_path):
    (tmp_path / "common" / "launch").mkdir(parents=True)
    (tmp_path / "common" / "__init__.py").write_text("import os\n")
    (tmp_path / "common" / "launch" / "__init__.py").write_text("")
    (tmp_path / "common" / "launch" / "kernel.py").write_text("import json\nfrom common.launch import helper\n")
    (tmp_path / "common" / "launch" / "helper.py").write_text("import yaml\n")
    assert non_stdlib_imports(tmp_path, launch_modules(tmp_path)) == ["yaml"]
