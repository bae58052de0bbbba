import json

from common.core.config import Config, load_config, parse_override, save_config
from common.core.errors import ConfigError

import pytest

from builders import says


def test_defaults_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  epochs: 7\n  learning_rate: 3e-4\ndata:\n  image_size: 64\n")
    cfg = load_config(path, ["train.epochs=3", "runtime.strategy=mirrored", "data.class_names=[a, b]"])
    assert cfg.train.epochs == 3  # the override wins over the file
    assert cfg.train.learning_rate == pytest.approx(3e-4)  # YAML 1.1 reads 3e-4 as a string: coerced to float
    assert cfg.data.image_size == 64
    assert cfg.runtime.strategy == "mirrored"
    assert cfg.data.class_names == ("a", "b")
    assert cfg.train.batch_size_per_replica == Config().train.batch_size_per_replica  # untouched default


def test_json_round_trip(tmp_path):
    cfg = load_config(None, ["train.epochs=2", "data.class_names=x,y,z", "model.dropout=0.5"])
    save_config(cfg, tmp_path / "config.json")
    again = load_config(tmp_path / "config.json")
    assert again == cfg
    assert json.loads((tmp_path / "config.json").read_text())["data"]["class_names"] == ["x", "y", "z"]


@pytest.mark.parametrize(
    ("override", "parts"),
    [
        ("train.epoch=3", ("key 'train.epoch'", "'epochs'")),
        ("trian.epochs=3", ("section 'trian'", "'train'")),
        ("train.epochs=three", ("'train.epochs'", "int", "'three'")),
        ("train.epochs=2.5", ("'train.epochs'", "int", "2.5")),
        ("train.epochs=true", ("'train.epochs'", "int", "True")),
        ("model.trainable=yes please", ("'model.trainable'", "bool")),
        ("runtime.strategy=gpu", ("'runtime.strategy'", "['auto', 'tpu', 'mirrored', 'default']")),
        ("epochs=3", ("'epochs=3'", "section.key=value")),
    ],
)
def test_bad_overrides_name_the_key(override, parts):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    says(str(err.value), *parts)


def test_unknown_key_in_file_is_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"data": {"image_size": 32, "lable_column": "y"}}))
    with pytest.raises(ConfigError, match=r"unknown config key 'data.lable_column' \(did you mean 'label_column'\?\)"):
        load_config(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_parse_override_reads_yaml_values():
    assert parse_override("train.epochs=3") == ("train", "epochs", 3)
    assert parse_override("model.hub_handle=https://x/y=1") == ("model", "hub_handle", "https://x/y=1")
    assert parse_override("runtime.output_dir=") == ("runtime", "output_dir", "")


def test_string_and_choice_settings_take_the_word_as_written(tmp_path):
    """YAML 1.1 reads off, no, on, yes as booleans and null as None; a string or choice setting keeps the word (in an
    override and in a file), a bool setting reads those words as booleans, and a wrong type is still named."""
    words = [
        "infer.check_images=off",
        "data.label_column=no",
        "data.id_column=yes",
        "kaggle.owner=null",
        "model.hub_handle=on",
        "model.trainable=off",
        "infer.xla=yes",
        "kaggle.private=no",
    ]
    cfg = load_config(None, words)
    assert (
        cfg.infer.check_images,
        cfg.data.label_column,
        cfg.data.id_column,
        cfg.kaggle.owner,
        cfg.model.hub_handle,
    ) == ("off", "no", "yes", "null", "on")
    assert (cfg.model.trainable, cfg.infer.xla, cfg.kaggle.private) == (False, True, False)
    path = tmp_path / "words.yaml"
    path.write_text("infer:\n  check_images: off\n  xla: on\ndata:\n  label_column: null\nruntime:\n  tfrecords:\n")
    from_file = load_config(path)
    assert (
        from_file.infer.check_images,
        from_file.infer.xla,
        from_file.data.label_column,
        from_file.runtime.tfrecords,
    ) == ("off", True, "null", "")
    for override, parts in [
        ("infer.check_images=3", ("'infer.check_images'", "['warn', 'strict', 'off']", "3")),
        ("train.epochs=off", ("'train.epochs'", "int", "'off'")),
        ("model.trainable=maybe", ("'model.trainable'", "bool", "'maybe'")),
        ("data.label_column=[a, b]", ("'data.label_column'", "str")),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        says(str(err.value), *parts)


@pytest.mark.parametrize(
    ("override", "parts"),
    [
        ("train.epochs=0", ("'train.epochs'", " 0,", "[1, inf)")),
        ("train.steps_per_execution=0", ("'train.steps_per_execution'", " 0,", "[1, inf)")),
        ("model.dropout=1", ("'model.dropout'", " 1.0,", "[0, 1)")),
        ("infer.batch_size=0", ("'infer.batch_size'", " 0,", "[1, inf)")),
        ("data.image_size=0", ("'data.image_size'", " 0,", "[8, 4096]")),
        ("train.learning_rate=0", ("'train.learning_rate'", " 0.0,", "(0, inf)")),
        ("infer.tta=[flip, transpose]", ("'infer.tta'", "unknown views ['flip']")),
    ],
)
def test_values_out_of_range_are_named_with_the_range(override, parts):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    says(str(err.value), *parts)


def test_integer_class_names_are_read_as_names():
    assert load_config(None, ["data.class_names=[0, 1, 2, 3]"]).data.class_names == ("0", "1", "2", "3")
    with pytest.raises(ConfigError, match=r"data.class_names\[0\]' must be str"):
        load_config(None, ["data.class_names=[true, false]"])


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("entry", "override"),
    [
        ("train", "train.epochs=0"),
        ("train", "train.steps_per_execution=0"),
        ("train", "model.dropout=1"),
        ("infer", "infer.batch_size=0"),
    ],
)
def test_entry_points_exit_2_naming_the_key(entry, override):
    import subprocess
    import sys

    module = "train_tpu.train" if entry == "train" else "infer_gpu.infer"
    run = subprocess.run([sys.executable, "-m", module, "--set", override], capture_output=True, text=True)
    assert run.returncode == 2
    assert f"config key '{override.split('=')[0]}' is" in run.stderr and "Traceback" not in run.stderr


def test_every_number_declares_its_range_on_its_field():
    """A new int or float key without a range (or an explicit "(-inf, inf)") would go unchecked: name it here."""
    import dataclasses
    import typing

    from common.core.fields import in_range

    undeclared, outside = [], []
    for section in dataclasses.fields(Config):
        types = typing.get_type_hints(section.default_factory)
        for f in dataclasses.fields(section.default_factory):
            if types[f.name] in (int, float):
                key = f"{section.name}.{f.name}"
                if "range" not in f.metadata:
                    undeclared.append(key)
                elif not in_range(f.default, f.metadata["range"]):
                    outside.append(f"{key}={f.default} {f.metadata['range']}")
    assert not undeclared, f"numeric config keys without a range (within(default, '[low, high]')): {undeclared}"
    assert not outside, f"defaults outside their own range: {outside}"


def test_ranges_are_read_as_written():
    from common.core.fields import in_range, within

    assert in_range(0, "[0, 1)") and not in_range(1, "[0, 1)") and not in_range(0, "(0, 1]") and in_range(1, "(0, 1]")
    assert in_range(float("inf"), "[0, inf)") and in_range(-5, "(-inf, inf)") and not in_range(-2, "[-1, inf)")
    assert load_config(None, ["train.time_budget_hours=.inf"]).train.time_budget_hours == float("inf")  # no bound
    with pytest.raises(ValueError, match="must look like"):
        within(1, "1..10")


def test_task_choices_are_the_tasks_known_when_the_value_is_set(monkeypatch):
    from common.tasks.types import TASKS

    with pytest.raises(
        ConfigError,
        match=r"config key 'data.task' must be one of \['multiclass', 'binary', "
        r"'multilabel', 'regression'\], got 'ordinal'",
    ):
        load_config(None, ["data.task=ordinal"])
    monkeypatch.setitem(TASKS, "ordinal", TASKS["regression"])  # a fifth task, added at run time
    assert load_config(None, ["data.task=ordinal"]).data.task == "ordinal"
    with pytest.raises(ConfigError, match=r"must be one of \[.*'regression', 'ordinal'\], got 'x'"):
        load_config(None, ["data.task=x"])


def test_every_key_has_its_help_in_a_docstring_after_the_field():
    """The reference (docs/config.md) is read from the string right after each field: one without it is an error."""
    import dataclasses

    from common.core.config import TrainConfig, field_help

    for section in dataclasses.fields(Config):
        helps = field_help(section.default_factory)  # raises where a field has no help
        assert list(helps) == [f.name for f in dataclasses.fields(section.default_factory)]
    assert (
        field_help(TrainConfig)["seed"] == "shuffling seed and the initial weights of what is not pretrained (the head)"
    )

    @dataclasses.dataclass
    class Documented:
        wrapped: int = 1
        """what it does, on a line that goes on
        to a second line"""

    assert field_help(Documented) == {"wrapped": "what it does, on a line that goes on to a second line"}

    @dataclasses.dataclass
    class Undocumented:
        documented: int = 1
        """what it does"""
        bare: int = 2  # a trailing comment is not help
        # nor is a comment on its own line
        also_bare: str = ""

    with pytest.raises(ValueError, match=r"Undocumented: no help for bare, also_bare: write a docstring right after"):
        field_help(Undocumented)
