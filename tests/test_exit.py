"""A kernel ends with exit 0 once its work is written, whatever threads are still tearing down (common/core/process.py,
common/data/teardown.py): the entry points' ending (run_entry) against Python's own, on a kernel whose let-go
iterator is still waiting in TensorFlow's C++ when it returns and is released while the interpreter finalizes
(tests/held_teardown.py), which aborted every run of today's ending on CPython 3.11-3.13."""

import signal
import subprocess
import sys
from pathlib import Path

from common.core.errors import exit_status

import pytest

HELD = Path(__file__).with_name("held_teardown.py")


def run_kernel(tmp_path: Path, ending: str, *options: str) -> subprocess.CompletedProcess:
    """tests/held_teardown.py's kernel; the hour's timeout only stops a kernel that waits on a teardown never released
    (a wait is the defect: nothing here times the kernel)."""
    return subprocess.run(
        [sys.executable, str(HELD), "kernel", ending, str(tmp_path), *options],
        capture_output=True,
        text=True,
        timeout=3600,
    )


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14 hangs such a thread instead (gh-87135)")
def test_python_s_own_ending_aborts_a_kernel_whose_teardown_ends_while_the_interpreter_finalizes(tmp_path):
    """What the kernels' ending is for: sys.exit after the work, the teardown not waited for (EXIT_WAIT_SECONDS 0, as
    let_go was), and the process dies on SIGABRT with its output written."""
    run = run_kernel(tmp_path, "python", "--exit-wait", "0")
    assert run.returncode == -signal.SIGABRT, run.stderr[-2000:]
    assert "terminate called" in run.stderr  # then "FATAL: exception not rethrown" (3.11, 3.12) or not (3.13)
    assert (tmp_path / "output.txt").read_text() == "every row\n"


def test_the_entry_point_ends_with_exit_0_and_the_outputs_whole_without_waiting_for_the_teardown(tmp_path):
    """run_entry ends the process without finalizing: exit 0, the output whole, and the teardown (never released:
    its FIFO gets a writer only in a finalization that does not come) not waited for, EXIT_WAIT_SECONDS an hour."""
    run = run_kernel(tmp_path, "product", "--exit-wait", "3600")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == "kernel: work done\n"
    assert "terminate called" not in run.stderr
    assert (tmp_path / "output.txt").read_text() == "every row\n"


def test_an_interpreter_that_finalizes_first_joins_the_teardown_released_in_time(tmp_path):
    """Python's own ending, as in a notebook's kernel or the test suite: the teardown released a second after the
    kernel returns is joined before finalization (teardown.EXIT_WAIT_SECONDS), so the release at finalization finds
    nothing waiting and the process exits 0."""
    run = run_kernel(tmp_path, "python", "--release-after", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "terminate called" not in run.stderr
    assert (tmp_path / "output.txt").read_text() == "every row\n"


@pytest.mark.parametrize(
    ("code", "status", "printed"), [(None, 0, ""), (0, 0, ""), (3, 3, ""), ("fix the export", 1, "fix the export\n")]
)
def test_a_system_exit_s_code_is_the_status_python_gives_it(code, status, printed, capsys):
    assert exit_status(code) == status
    assert capsys.readouterr().err == printed


def test_in_a_notebook_s_kernel_the_process_is_left_running(monkeypatch):
    """Under IPython (a notebook's kernel, which outlives the script), end() ends nothing: 0 returns, as the script's
    last line would, and another code is raised as SystemExit, which IPython reports and the notebook fails on."""
    import types

    from common.core import process

    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: object()))
    assert process.end(0) is None
    with pytest.raises(SystemExit) as raised:
        process.end(2)
    assert raised.value.code == 2
