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


def names_tested(tree: ast.AST, names: set[str], subject: str = "") -> list[tuple[int, str]]:
    """(line, name) of every test of a name in `names`: a comparison with it (==, !=, in, not in, alone or in a
    tuple, list or set) or a lookup by it (`ROUTES["keras_jax"]`); with `subject`, only comparisons of an attribute
    of that name (`cfg.model.backbone == "hub"`). A package's name asked of sys.modules is not a route's."""

    def named(node) -> list[str]:
        if isinstance(node, ast.Constant) and node.value in names:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [n for element in node.elts for n in named(element)]
        return []

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "modules" for s in sides):
                continue
            if subject and not any(isinstance(s, ast.Attribute) and s.attr == subject for s in sides):
                continue
            found += [(node.lineno, n) for side in sides for n in named(side)]
        elif isinstance(node, ast.Subscript) and not subject:
            found += [(node.lineno, n) for n in named(node.slice)]
    return sorted(found)


def test_only_the_route_table_tests_a_route_s_name_and_only_the_backbone_registry_a_family_s():
    """Launch, build, reachability, the demo and the CLI ask the route table (common/launch/routes.py) what a route
    does, and the backbone registry (common/launch/backbones.py) what a family is; a route's own folder under
    common/training/backends/ may name itself."""
    from common.launch.backbones import BACKBONES
    from common.launch.routes import ROUTES

    tables = {REPO / "common" / "launch" / "routes.py", REPO / "common" / "launch" / "backbones.py"}
    backends = REPO / "common" / "training" / "backends"
    offenders = []
    for path in sources():
        if path in tables or any(backends / name in path.parents for name in ROUTES):
            continue
        tree = ast.parse(path.read_text())
        tested = names_tested(tree, set(ROUTES)) + names_tested(tree, set(BACKBONES), subject="backbone")
        offenders += [f"{path.relative_to(REPO)}:{line}: {name}" for line, name in tested]
    assert not offenders, "a route or backbone family tested by name outside its table:\n" + "\n".join(offenders)


def test_the_name_finder_finds_what_it_is_for():
    source = (
        'if framework == "torch": pass\n'
        'x = 1 if name in ("keras_jax", "torch") else 2\n'
        'route = ROUTES["tf_keras"]\n'
        'if cfg.model.backbone != "hub": pass\n'
        'versions = {"torch": 1}\n'
        'optional_import("torch", "why")\n'
        'if module == "hub": pass\n'
        'if "torch" in sys.modules: pass\n'
    )
    tree = ast.parse(source)
    routes = {"tf_keras", "keras_jax", "torch"}
    assert names_tested(tree, routes) == [(1, "torch"), (2, "keras_jax"), (2, "torch"), (3, "tf_keras")]
    assert names_tested(tree, {"hub"}, subject="backbone") == [(4, "hub")]


def test_every_backend_folder_is_a_route_or_shared_and_names_its_modules_from_one_list():
    from common.launch.routes import ROUTES
    from common.training.backends import MODULES, SHARED

    backends = REPO / "common" / "training" / "backends"
    folders = sorted(p.name for p in backends.iterdir() if (p / "__init__.py").is_file())
    assert [f for f in folders if f not in ROUTES and not f.endswith(SHARED)] == []
    assert [name for name in ROUTES if not (backends / name / "backend.py").is_file()] == []
    strays = [
        f"{folder}/{module.name}"
        for folder in folders
        for module in (backends / folder).glob("*.py")
        if module.stem != "__init__" and module.stem not in MODULES
    ]
    assert strays == [], f"module names outside common/training/backends MODULES: {strays}"
