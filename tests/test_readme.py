"""The README's and docs/' commands run as written, from the repository root, in the order a reader meets them; the
README opens with the map of the code; the config reference in docs/ is the config's own.

Three kinds are adapted, and each adaptation is checked for what it can show here: `./dev test` is this very suite
(only its presence in `dev` is checked); the Kaggle steps (push, wait, fetch, publish, submit, workflow) talk to
kaggle.com (and `wheels` downloads 400 MB), so they run with --dry-run, which builds and prints every kaggle CLI
command (tests/test_kaggle.py runs those commands for real against a loopback Kaggle); the benchmarks take minutes
each, so they run with --help (tests/test_bench.py runs them all with --smoke; their figures are recorded in
bench/README.md).
"""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from builders import checkout_copy

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((REPO / "docs").glob("*.md"))}
KAGGLE_STEPS = {"push", "wait", "fetch", "publish", "submit", "workflow", "wheels", "publish-wheels"}


def bash_commands(text: str) -> list[str]:
    commands = []
    for block in re.findall(r"^ *```bash\n(.*?)^ *```", text, flags=re.S | re.M):
        lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
        commands += [line for line in lines if line and not line.startswith("#")]
    return commands


def test_quickstart_opens_with_the_demo_and_the_test_command():
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    first_block = re.search(r"```bash\n(.*?)```", quickstart, flags=re.S).group(1)
    assert first_block.strip().splitlines() == ["./dev demo", "./dev test"]
    assert (REPO / ".ci" / "run").read_text().strip().endswith("./dev test")
    assert "test)" in (REPO / "dev").read_text()


def test_the_readme_opens_with_the_tree_and_the_data_flow():
    """Within its first 80 lines: every subpackage of common/ in the tree, each top-level folder, and the data flow
    from the competition folder to submission.csv."""
    opening = "\n".join(README.splitlines()[:80])
    subpackages = sorted(p.parent.name for p in (REPO / "common").glob("*/__init__.py"))
    assert len(subpackages) >= 7, subpackages
    for name in [*(f"  {s}/" for s in subpackages), "train_tpu/", "infer_gpu/", "tpu2gpu/", "kernel-metadata/"]:
        assert f"\n{name}" in opening, f"{name.strip()} is not in the README's opening tree"
    assert "competition folder (CSV + images)" in opening and "-> submission.csv" in opening


@pytest.mark.e2e
def test_every_readme_command_runs_as_written(tmp_path):
    """In a copy of the checkout (its .venv linked): the demo and the build write runs/ and build/ there, so the
    suite leaves the user's own runs/ (a later `./dev demo` trains anew) and build/ alone."""
    checkout = checkout_copy(tmp_path / "checkout", link_venv=True)
    commands = [c for text in [README, *DOCS.values()] for c in bash_commands(text)]
    assert len(commands) >= 20
    ran = set()
    for command in commands:
        argv = shlex.split(command, comments=True)
        if argv[:2] == ["./dev", "test"] or tuple(argv) in ran:
            continue  # this suite; a command shown twice (the demo: README and docs/training.md) runs once
        ran.add(tuple(argv))
        if argv[0] == "./dev" and len(argv) > 1 and argv[1] in KAGGLE_STEPS:
            argv.append("--dry-run")
        if any(arg.startswith("bench/") for arg in argv):
            argv = [*argv, "--help"]
        run = subprocess.run(argv, cwd=checkout, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"README command failed: {command}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
        if argv[:2] == ["./dev", "demo"]:
            assert re.search(r"macro-F1\s+0\.9\d+ on the held-out test set", run.stdout), run.stdout[-1500:]


def test_config_reference_in_the_docs_is_current():
    import dataclasses

    from common.core.config import Config, config_reference

    table = DOCS["config.md"].split("<!-- config-reference:start -->\n", 1)[1]
    table = table.split("\n<!-- config-reference:end -->", 1)[0]
    assert table == config_reference()
    rows = table.splitlines()[2:]
    keys = sum(len(dataclasses.fields(section.default_factory)) for section in dataclasses.fields(Config))
    assert len(rows) == keys  # one row per key, each with its comment
    assert all(row.count(" | ") == 2 and row.rsplit(" | ", 1)[1].strip(" |") for row in rows)


def test_task_type_configs_in_the_docs_are_valid():
    """Each competition's `section: {...}` snippets in docs/training.md's Task types section load as a config."""
    from common.core.config import config_from_dict, load_config
    from common.tasks.types import get_task

    import yaml

    section = re.sub(r"\s*\n\s*", " ", DOCS["training.md"].split("## Task types", 1)[1].split("\n## ", 1)[0])
    items = re.findall(r"- \*\*(.+?)\*\*(.*?)(?= - \*\*|$)", section.split("does not fit the task", 1)[1].strip())
    assert [name for name, _ in items] == [
        "SIIM-ISIC Melanoma",
        "Plant Pathology 2021",
        "PetFinder Pawpularity",
        "Cassava Leaf Disease",
        "Plant Seedlings Classification",
    ]
    for _, text in items:
        raw = {}
        for snippet in re.findall(r"`((?:data|train|kaggle): \{[^`]*\})`", text):
            raw.update(yaml.safe_load("{" + snippet + "}"))
        assert raw, text  # each recipe names its settings
        cfg = config_from_dict(raw, load_config())
        get_task(cfg.data.task).competition_metric(cfg.train.metric)


# What the guide names that the reader makes or mistypes on purpose: their own config file, and the misspelt key whose
# error README shows.
NOT_IN_THE_REPOSITORY = {"configs/my.yaml"}
SHOWN_MISSPELT = {"data.fold"}
FILE_SUFFIXES = ("py", "csv", "json", "yaml", "md", "safetensors", "keras", "h5", "npz", "com")


def named_paths_and_keys() -> dict[str, tuple[set[str], set[str]]]:
    """{document: (repository paths, config keys)} named in README, docs/ and the two kernels' docstrings. A key is a
    setting (`train.optimizer=adamw`) or a quoted key (`train.optimizer`); the card's own runtime block shares the
    word runtime, so a quoted runtime.* is read as the card's."""
    import ast
    import dataclasses

    from common.core.config import Config

    sections = [s.name for s in dataclasses.fields(Config)]
    setting = re.compile(rf"(?<![\w./-])((?:{'|'.join(sections)})\.[a-z_][a-z0-9_]*)=")
    quoted = re.compile(rf"`((?:{'|'.join(s for s in sections if s != 'runtime')})\.[a-z_][a-z0-9_]*)`")
    path = re.compile(
        r"(?<![\w./-])((?:common|train_tpu|infer_gpu|tpu2gpu|tests|bench|configs|docs|kernel-metadata)/[\w./-]*\w)"
    )
    texts = {"README.md": README, **{f"docs/{name}": text for name, text in DOCS.items()}}
    for kernel in ("train_tpu/train.py", "infer_gpu/infer.py"):
        texts[kernel] = ast.get_docstring(ast.parse((REPO / kernel).read_text()))
    named = {}
    for name, text in texts.items():
        keys = {m.group(1) for pattern in (setting, quoted) for m in pattern.finditer(text)}
        named[name] = (
            {m.group(1) for m in path.finditer(text)},
            {k for k in keys if k.rsplit(".", 1)[1] not in FILE_SUFFIXES},
        )
    return named


def test_every_path_and_config_key_the_guide_names_exists():
    import dataclasses

    import common.launch.routes  # noqa: F401  (the routes and tasks supply their keys' choices)
    from common.core.config import Config, load_config
    from common.core.errors import ConfigError

    keys = {f"{s.name}.{f.name}" for s in dataclasses.fields(Config) for f in dataclasses.fields(s.default_factory)}
    named = named_paths_and_keys()
    missing = [
        f"{document}: {item}"
        for document, (paths, settings) in named.items()
        for item in sorted(paths - NOT_IN_THE_REPOSITORY)
        if not (REPO / item).exists()
    ]
    missing += [
        f"{document}: {key}"
        for document, (paths, settings) in named.items()
        for key in sorted(settings - SHOWN_MISSPELT)
        if key not in keys
    ]
    assert missing == [], "named in the guide, absent from the repository or the config:\n" + "\n".join(missing)
    assert sum(len(paths) + len(settings) for paths, settings in named.values()) > 300  # the reader found them
    for key in SHOWN_MISSPELT:
        assert key in named["README.md"][1]
        with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
            load_config(None, [f"{key}=2"])
