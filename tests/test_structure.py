"""The code stays easy to change: small functions and files, and task behaviour in one place (common/tasks/).

Limits (tests/ are exempt): no function over 50 lines, no file over 350 lines in the shipped packages.
"""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "train_tpu", "infer_gpu", "tpu2gpu")
MAX_FUNCTION_LINES, MAX_FILE_LINES = 50, 350
# A branch on what a task is called: `task.name == ...`, `task.name in (...)`, `cfg.data.task != "regression"`.
TASK_BRANCH = re.compile(r"\btask\.name\s*(==|!=|\bin\b|\bnot in\b)|\.task\s*(==|!=|\bin\b)\s*[\"'(\[]")


def sources():
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def test_no_long_function_and_no_long_file():
    offenders = []
    for path in sources():
        text = path.read_text()
        name = path.relative_to(REPO)
        if len(text.splitlines()) > MAX_FILE_LINES:
            offenders.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    offenders.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not offenders, "over the limits:\n" + "\n".join(offenders)


def test_only_the_tasks_module_branches_on_a_task_type():
    assert len(sources()) > 30  # the walk found the packages
    branches = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
                for path in sources() if (REPO / "common" / "tasks") not in path.parents
                for number, line in enumerate(path.read_text().splitlines(), start=1)
                if TASK_BRANCH.search(line.split("#")[0]) and not line.strip().startswith(("f\"", "\"", "raise"))]
    assert not branches, "branch on the task type outside common/tasks/types.py:\n" + "\n".join(branches)


def test_the_branch_pattern_finds_what_it_is_for():
    for line in ('if task.name == "binary":', "x = 1 if task.name in ('a', 'b') else 2",
                 'if cfg.data.task != "regression":', "elif data_cfg.task == 'multilabel':"):
        assert TASK_BRANCH.search(line), line
    for line in ("task = get_task(cfg.data.task)", 'print(f"{task.name} model")', "card.task == first.card.task"):
        assert not TASK_BRANCH.search(line), line
