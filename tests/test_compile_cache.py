"""Compile once: the compile cache of the routes that compile (common/training/compile_cache.py), never a reason to
fail. The folder's checks on made-up entries first (each kind of bad entry one line, the good ones kept); then Keras 3
on JAX in this process: a second fold and a resumed fold take their programs from the cache, and a damaged, a foreign
and an unwritable cache each cost a compile and one line, never the fold. The torch_xla route's resumed run says why its
XLA CPU devices use no cache (tests/test_timm_export.py)."""

import json
import re
import time

from common.core.config import load_config
from common.data.records import record_set
from common.training.compile_cache import LEDGER, CompileCache

import pytest

from builders import says

VERSIONS = {"jax": "0.7.2", "platform": "cpu"}


def entries(folder):
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("tpu2gpu-"))


def test_the_folder_keeps_what_it_vouched_for_and_removes_every_other_entry_with_one_line_a_kind(tmp_path, capsys):
    folder = tmp_path / "cache"
    cache = CompileCache.open(folder, "keras_jax", VERSIONS)
    for name in ("good-cache", "cut-cache", "damaged-cache"):
        (folder / name).write_bytes(name.encode() * 1000)
    cache.vouch()
    ledger = json.loads((folder / LEDGER).read_text())
    assert ledger["versions"] == VERSIONS and sorted(ledger["entries"]) == ["cut-cache", "damaged-cache", "good-cache"]
    (folder / "cut-cache").write_bytes((folder / "cut-cache").read_bytes()[:100])  # a write cut short
    damaged = bytearray((folder / "damaged-cache").read_bytes())
    damaged[500] ^= 0xFF  # one byte flipped, the size unchanged
    (folder / "damaged-cache").write_bytes(bytes(damaged))
    (folder / "unknown-cache").write_bytes(b"written by a run killed before its checkpoint")
    capsys.readouterr()

    reopened = CompileCache.open(folder, "keras_jax", VERSIONS)
    (line,) = capsys.readouterr().out.splitlines()
    says(line, "[keras_jax]", "3 entries", str(folder), "cut-cache, damaged-cache, unknown-cache", "compiled again")
    assert entries(folder) == ["good-cache"] and list(reopened.known) == ["good-cache"]
    assert list(json.loads((folder / LEDGER).read_text())["entries"]) == ["good-cache"]

    # Another version or platform: none of its entries is this run's, all removed, one line.
    CompileCache.open(folder, "keras_jax", {"jax": "0.7.2", "platform": "tpu"})
    (line,) = capsys.readouterr().out.splitlines()
    says(
        line,
        "[keras_jax]",
        "1 program(s)",
        str(folder),
        "jax 0.7.2, platform cpu",
        "jax 0.7.2, platform tpu",
        "removed",
    )
    assert entries(folder) == []
    assert json.loads((folder / LEDGER).read_text())["versions"] == {"jax": "0.7.2", "platform": "tpu"}


def test_a_folder_that_cannot_be_written_or_is_off_is_no_cache_and_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("not a folder")
    assert CompileCache.open(tmp_path / "a-file" / "cache", "torch_xla", VERSIONS) is None
    assert CompileCache.open(None, "torch_xla", VERSIONS) is None
    unwritable, off = capsys.readouterr().out.splitlines()
    says(
        unwritable,
        "[torch_xla]",
        str(tmp_path / "a-file" / "cache"),
        "cannot be written (Not a directory)",
        "Fix: runtime.compile_cache=<a writable folder>, or off",
    )
    says(off, "[torch_xla] compile cache off", "runtime.compile_cache=off")


def test_a_damaged_ledger_vouches_for_nothing(tmp_path, capsys):
    folder = tmp_path / "cache"
    cache = CompileCache.open(folder, "keras_jax", VERSIONS)
    (folder / "entry-cache").write_bytes(b"x" * 100)
    cache.vouch()
    (folder / LEDGER).write_text('{"versions": {"jax": "0.7.2", "platf')  # a ledger cut short
    CompileCache.open(folder, "keras_jax", VERSIONS)
    assert "1 entry in" in capsys.readouterr().out and entries(folder) == []


def test_where_the_cache_lives_and_the_words_that_would_be_a_folder(tmp_path, monkeypatch):
    """In a Kaggle kernel /kaggle/temp/compile-cache (kept out of the kernel's output), locally beside the output,
    $TPU2GPU_COMPILE_CACHE over both, a folder named, off; a gs:// URL, YAML's false and the words a user means as
    off ("no", "None") are one named error, never a folder made of them."""
    from common.core.errors import ConfigError, DataPathError
    from common.core.paths import COMPILE_CACHE_ENV, KAGGLE_ROOT_ENV, compile_cache_dir

    def folder(*settings):
        return compile_cache_dir(load_config(None, list(settings)).runtime)

    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    assert folder(f"runtime.output_dir={tmp_path / 'out'}") == tmp_path / "out" / "compile-cache"
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    monkeypatch.setenv(KAGGLE_ROOT_ENV, str(tmp_path / "kaggle"))
    assert folder() == tmp_path / "kaggle" / "temp" / "compile-cache"
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "shared"))
    assert folder() == tmp_path / "shared"
    assert folder(f"runtime.compile_cache={tmp_path / 'mine'}") == tmp_path / "mine"
    assert folder("runtime.compile_cache=off") is None
    with pytest.raises(DataPathError, match=r"runtime.compile_cache='gs://b/c' is a URL"):
        folder("runtime.compile_cache=gs://b/c")
    with pytest.raises(ConfigError, match=r"config key 'runtime.compile_cache' must be str, got False \(bool\)"):
        folder("runtime.compile_cache=false")  # YAML's false: the config itself refuses it by name
    for word in ("no", "None", "disabled"):
        with pytest.raises(
            ConfigError,
            match=rf"runtime.compile_cache='{word}' would be a folder named '{word}'\. "
            rf"Fix: runtime.compile_cache=off to compile without a cache, or "
            rf"\./{word} for that folder",
        ):
            folder(f"runtime.compile_cache={word}")


# ------------------------------------------------------------------------------------------- Keras 3 on JAX, here
def jax_fold(settings, records_dir, work_dir, fold=0, seconds=600.0):
    """One fold trained in this process by a backend of its own (a new model: its programs traced anew), within
    `seconds` (a few: the budget stops it after its first epoch, as a kill would, its checkpoint kept)."""
    from common.training.backends.registry import start_backend
    from common.training.fold import train_fold

    cfg = load_config(None, settings)
    backend = start_backend(cfg)
    return train_fold(
        cfg, backend, record_set(str(records_dir), cfg.data, fold), work_dir, deadline=time.monotonic() + seconds
    )


def jax_settings(tiny_keras_backbone, cache, *extra):
    return [
        "train.framework=keras_jax",
        "model.backbone=keras",
        f"model.keras_backbone={tiny_keras_backbone}",
        "data.image_size=16",
        "train.steps_per_epoch=3",
        "train.steps_per_execution=3",
        "train.batch_size_per_replica=8",
        "train.export_float16=false",
        f"runtime.compile_cache={cache}",
        *extra,
    ]


@pytest.mark.e2e
def test_keras_jax_folds_and_a_resumed_fold_take_their_programs_from_the_cache_and_a_bad_cache_costs_a_compile(
    demo_records, tiny_keras_backbone, tmp_path, capsys
):
    records_dir, _ = demo_records
    cache = tmp_path / "cache"
    settings = jax_settings(tiny_keras_backbone, cache, "train.epochs=2")

    first = jax_fold(settings, records_dir, tmp_path / "fold0", seconds=0.0)  # stopped after epoch 1
    assert first.epochs_done == 1 and first.cut
    assert first.compiles.programs > 0 and first.compiles.from_cache == 0  # a new cache: everything compiles
    log = capsys.readouterr().out
    assert f"[keras_jax] compile cache: {cache / 'keras_jax'} (0 program(s) in it)" in log
    assert re.search(
        r"\[train\] epoch 1: step 3, all in the first execution; val_macro_f1 [\d.]+ \(best [\d.]+ at "
        r"epoch 1\); [\d.]+ s: first execution [\d.]+ s \(3 step\(s\)\), training [\d.]+ s, "
        r"compile [\d.]+ s \(\d+ program\(s\), 0 from the cache\), "
        r"validation [\d.]+ s, best-epoch save [\d.]+ s, checkpoint [\d.]+ s$",
        log,
        re.M,
    ), log
    assert f"[train] the fold compiled {first.compiles.programs} program(s) in " in log

    # Another fold, and fold 0 resumed for its second epoch, each with a model of its own: every program the fold
    # compiles comes from the cache (the training and prediction steps).
    second = jax_fold(settings, records_dir, tmp_path / "fold1", fold=1)
    resumed = jax_fold(settings, records_dir, tmp_path / "fold0")
    for result in (second, resumed):
        assert result.compiles.programs > 0 and result.compiles.from_cache == result.compiles.programs
    assert resumed.epochs_done == 2
    print(
        f"keras_jax: fold 1 compiled {first.compiles.describe()}; another fold {second.compiles.describe()}; "
        f"resumed {resumed.compiles.describe()}"
    )

    # A damaged entry: skipped and removed, one line; the fold compiles it again and trains.
    folder = cache / "keras_jax"
    train_step = next(p for p in folder.iterdir() if "train_step" in p.name)  # Keras' training step
    train_step.write_bytes(train_step.read_bytes()[:-100])
    capsys.readouterr()
    again = jax_fold(settings, records_dir, tmp_path / "again", fold=1)  # 288 validation records, as fold 0
    log = capsys.readouterr().out
    says(log, "[keras_jax] compile cache: 1 entry", str(folder), "damaged")
    assert again.compiles.programs - again.compiles.from_cache == 1 and again.epochs_done == 2

    # Written by another JAX: all removed, one line; everything compiles.
    ledger = json.loads((folder / LEDGER).read_text())
    (folder / LEDGER).write_text(json.dumps({**ledger, "versions": {**ledger["versions"], "jax": "0.4.35"}}))
    foreign = jax_fold(settings, records_dir, tmp_path / "foreign", fold=1)
    log = capsys.readouterr().out
    assert re.search(
        rf"\[keras_jax\] compile cache: the \d+ program\(s\) in {folder} were compiled by jax 0\.4\.35, ", log
    ), log
    assert foreign.compiles.from_cache == 0 and foreign.epochs_done == 2

    # A cache that cannot be written: the fold trains without one (the path runtime.compile_cache=off takes too).
    (tmp_path / "a-file").write_text("")
    without = jax_fold(
        [*settings, f"runtime.compile_cache={tmp_path / 'a-file'}"], records_dir, tmp_path / "without", fold=1
    )
    assert without.compiles.from_cache == 0 and without.epochs_done == 2
    says(capsys.readouterr().out, str(tmp_path / "a-file"), "cannot be written (Not a directory)")
