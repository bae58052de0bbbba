"""An optional library that does not import (missing, a companion missing or mismatched, a broken install) is one
line naming the package and the fix (common/core/packages.py), and a library's nested error reaches the user with
its innermost cause's words (common/core/errors.py root_cause)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from common.core.config import load_config
from common.core.errors import ConfigError, root_cause

import pytest

from builders import says

REPO = Path(__file__).resolve().parents[1]


def test_the_innermost_cause_is_named_through_raise_from_and_errors_raised_while_handling_another():
    try:
        try:
            try:
                raise ImportError("Foo requires `tensorflow-text`.\n\nRun `pip install tensorflow-text`.")
            except ImportError as inner:
                raise TypeError(
                    f"Error when deserializing class 'Foo' using config={{}}.\n\nException encountered: {inner}"
                ) from None
        except TypeError as middle:
            raise ValueError("could not load the preset") from middle
    except ValueError as outer:
        # from None hides the ImportError: the TypeError is the innermost, and its words are those after Keras's marker
        assert root_cause(outer) == ("TypeError: Foo requires `tensorflow-text`. Run `pip install tensorflow-text`.")
    quoted = ValueError(
        "Exception encountered when calling Foo.call(). Exception encountered: ''the 'x' input is wrong''"
    )
    assert root_cause(quoted) == "ValueError: the 'x' input is wrong"  # Keras's quotes off, the words' own kept
    long = RuntimeError("x" * 400)
    assert root_cause(long) == "RuntimeError: " + "x" * 297 + "..." and root_cause(KeyError()) == "KeyError"


def test_keras_nested_deserialization_error_reaches_the_user_with_the_inner_layers_words():
    """Keras's own nesting, two levels deep: a layer whose constructor raises (as KerasHub's preprocessing layers do
    without tensorflow-text) inside a model being deserialized."""
    import keras

    @keras.saving.register_keras_serializable(package="tpu2gpu_test")
    class NeedsText(keras.layers.Layer):
        def __init__(self, ready=True, **kwargs):
            if not ready:
                raise ImportError("NeedsText requires `tensorflow` and `tensorflow-text` for text processing.")
            super().__init__(**kwargs)

        def get_config(self):
            return {**super().get_config(), "ready": False}

    config = keras.saving.serialize_keras_object(NeedsText())
    with pytest.raises(TypeError) as raised:
        keras.saving.deserialize_keras_object(config)
    assert "could not be deserialized properly" in str(raised.value).splitlines()[0]  # the outermost words
    assert root_cause(raised.value) == (
        "ImportError: NeedsText requires `tensorflow` and `tensorflow-text` for text processing."
    )


def product_line(tmp_path: Path, prelude: str) -> subprocess.CompletedProcess:
    """The keras_jax route's model built from a KerasHub preset folder in a fresh interpreter, after `prelude` (which
    breaks what keras_hub imports); the product's guarded entry, as the training kernel ends."""
    (tmp_path / "preset").mkdir(exist_ok=True)
    script = textwrap.dedent(f"""
        import os, sys
        os.environ["KERAS_BACKEND"] = "jax"
        {prelude}
        import common
        from common.core.config import load_config
        from common.core.errors import guarded
        from common.training.backends.keras_jax.model import build_keras_model
        cfg = load_config(None, ["model.backbone=keras", "model.keras_backbone={tmp_path / "preset"}"])
        sys.exit(guarded("train", build_keras_model, cfg.model, 4, 32))
        """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def fake_package(site: Path, name: str, body: str) -> str:
    """A package of `name` in `site` (a site-packages folder put first on sys.path), whose import runs `body`."""
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(body)
    return f"sys.path.insert(0, {str(site)!r})"


@pytest.mark.e2e
def test_import_keras_hub_failing_with_recursion_oserror_or_a_missing_companion_is_one_line_naming_the_package(
    tmp_path,
):
    """Three broken images, each as a user met one or could: tensorflow_text installed without tf_keras under
    TF_USE_LEGACY_KERAS=1 (import keras_hub recursed about 950 frames deep on a lent GPU machine), a tensorflow_text
    whose shared library does not match TensorFlow (an OSError keras_hub does not catch), and keras_hub's own
    requirement `regex` missing. Each ends in exit 2 and one line naming the package and the fix."""

    def one_line(run):
        assert run.returncode == 2, run.stderr[-3000:]
        lines = [line for line in run.stderr.splitlines() if line.startswith("train: error:")]
        assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
        return lines[0]

    preset = (
        f"model.keras_backbone={str(tmp_path / 'preset')!r} (a KerasHub preset) needs keras_hub, and `import "
        "keras_hub` failed"
    )
    recursion = one_line(product_line(tmp_path, "sys.modules['tf_keras'] = None  # not installed"))
    says(
        recursion,
        "train: error: ",
        preset,
        "keras_hub -> tensorflow_text -> tensorflow (RecursionError)",
        "TF_USE_LEGACY_KERAS=1",
        "Fix: pip install 'tf-keras~=2.21.0'",
    )

    site = tmp_path / "broken" / "site-packages"
    broken_text = fake_package(
        site,
        "tensorflow_text",
        "raise OSError('/usr/lib/tensorflow_text/_ops.so: undefined symbol: _ZN10tensorflow8OpKernel')\n",
    )
    mismatched = one_line(product_line(tmp_path, broken_text))
    says(
        mismatched,
        "train: error: ",
        preset,
        "keras_hub -> tensorflow_text (OSError: /usr/lib/tensorflow_text/_ops.so: undefined symbol",
        "Fix: pip install --force-reinstall tensorflow-text",
        "pip uninstall tensorflow-text",
    )

    missing = one_line(product_line(tmp_path, "sys.modules['regex'] = None  # not installed"))
    says(missing, "train: error: ", preset, "regex", "not installed", "Fix: pip install regex")


def test_a_package_that_is_not_installed_is_named_with_its_pip_name():
    from common.core.errors import PackageError
    from common.core.packages import installed, optional_import

    with pytest.raises(
        PackageError,
        match=r"^the test needs tpu2gpu_no_such_module, which is not installed here\. "
        r"Fix: pip install tpu2gpu_no_such_module$",
    ):
        optional_import("tpu2gpu_no_such_module", "the test")
    assert installed("json") and not installed("tpu2gpu_no_such_module")


def copy_config_only(preset: Path, to: Path, **change) -> Path:
    """The preset's JSON files with `change` made to config.json's config (its weights left out)."""
    to.mkdir()
    for name in ("config.json", "metadata.json", "image_converter.json", "preprocessor.json"):
        if (preset / name).is_file():
            shutil.copyfile(preset / name, to / name)
    config = json.loads((to / "config.json").read_text())
    config["config"].update(change)
    (to / "config.json").write_text(json.dumps(config))
    return to


def test_a_preset_keras_cannot_rebuild_names_the_innermost_cause(real_weights, tmp_path):
    """config.json whose stackwise_num_repeats is null: the backbone's constructor fails, and Keras wraps that in its
    "could not be deserialized properly ... Exception encountered:" TypeError; the line carries the inner words."""
    from common.training.backends.keras_jax.model import build_keras_model

    folder = copy_config_only(real_weights / "keras_hub", tmp_path / "damaged", stackwise_num_repeats=None)
    cfg = load_config(None, ["model.backbone=keras", f"model.keras_backbone={folder}"])
    with pytest.raises(ConfigError) as raised:
        build_keras_model(cfg.model, 4, 32)
    line = str(raised.value)
    says(
        line,
        f"model.keras_backbone='{folder}'",
        "KerasHub image preset",
        "TypeError: 'NoneType' object is not iterable",
        "Fix: attach the whole preset folder",
    )
