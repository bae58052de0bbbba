"""The code stays easy to change: no monster functions or files, and task behaviour in one place (common/tasks/).

Guards, not targets (tests/ are exempt): no function over 80 lines, no file over 600 lines, no function taking more
than six parameters (self and cls aside: more go into a small parameter object) in the shipped packages. A module is
split where its concern splits, never to meet a number.
"""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "train_tpu", "infer_gpu", "tpu2gpu")
MAX_FUNCTION_LINES, MAX_FILE_LINES, MAX_PARAMETERS = 80, 600, 6
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
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


def too_many_parameters(tree: ast.AST) -> list[tuple[int, str, int]]:
    """(line, name, parameters) of every def taking more than MAX_PARAMETERS: positional-only, positional and
    keyword-only parameters, not a method's self or cls, nor *args and **kwargs."""
    methods = {
        id(f)
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, FUNCTIONS) and "staticmethod" not in {getattr(d, "id", None) for d in f.decorator_list}
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, FUNCTIONS):
            named = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            count = len(named) - (id(node) in methods and bool(named) and named[0].arg in ("self", "cls"))
            if count > MAX_PARAMETERS:
                found.append((node.lineno, node.name, count))
    return found


def test_no_function_takes_more_than_six_parameters():
    offenders = [
        f"{path.relative_to(REPO)}:{line} {name}: {count} parameters"
        for path in sources()
        for line, name, count in too_many_parameters(ast.parse(path.read_text()))
    ]
    assert not offenders, "more than six parameters (group them in a parameter object):\n" + "\n".join(offenders)


def test_the_parameter_count_finds_what_it_is_for():
    source = (
        "def seven(a, b, c, d, e, f, *, g): pass\n"
        "def six(a, b, /, c, d, *args, e, f, **kwargs): pass\n"
        "class Holder:\n"
        "    def six(self, a, b, /, c, d, *args, e, f, **kwargs): pass\n"
        "    @classmethod\n"
        "    def also_six(cls, a, b, c, d, e, f): pass\n"
        "    @staticmethod\n"
        "    def seven(self, a, b, c, d, e, f): pass\n"
    )
    assert too_many_parameters(ast.parse(source)) == [(1, "seven", 7), (8, "seven", 7)]


def test_only_the_tasks_module_branches_on_a_task_type():
    assert len(sources()) > 30  # the walk found the packages
    branches = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sources()
        if (REPO / "common" / "tasks") not in path.parents
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if TASK_BRANCH.search(line.split("#")[0]) and not line.strip().startswith(('f"', '"', "raise"))
    ]
    assert not branches, "branch on the task type outside common/tasks/types.py:\n" + "\n".join(branches)


def test_the_branch_pattern_finds_what_it_is_for():
    for line in (
        'if task.name == "binary":',
        "x = 1 if task.name in ('a', 'b') else 2",
        'if cfg.data.task != "regression":',
        "elif data_cfg.task == 'multilabel':",
    ):
        assert TASK_BRANCH.search(line), line
    for line in ("task = get_task(cfg.data.task)", 'print(f"{task.name} model")', "card.task == first.card.task"):
        assert not TASK_BRANCH.search(line), line
