"""Imports run one way: no cycle among the product's modules (function-local imports included), and the code that
runs before TensorFlow (common/__init__.py and common/launch/) imports the standard library only.

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
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
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
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


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
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                            env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
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
