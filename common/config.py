"""One config for a run: typed defaults in code, a YAML/JSON file over them, `--set section.key=value` over that.

    cfg = load_config("configs/demo.yaml", ["train.epochs=3", "data.image_size=64"])
    print(format_config(cfg))            # logged first by every entry point
    save_config(cfg, "export/config.json")  # and saved with the results; load_config() reads it back

An unknown section or key, or a value of the wrong type, raises ConfigError naming the key (with a close match).
Sections follow the Model Garden split: what to learn (data, model, train, infer) apart from where it runs (runtime).
Model and data code never read `runtime`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.errors import ConfigError

import yaml


@dataclass
class DataConfig:
    # Kaggle-style competition folder layout (read by `tpu2gpu tfrecords` and the training kernel).
    train_csv: str = "train.csv"
    train_images: str = "train"
    test_images: str = "test"
    test_csv: str = "sample_submission.csv"  # gives the test ids (and their order); missing -> list test_images
    id_column: str = "id"
    label_column: str = "label"
    # TFRecord schema: feature names inside each tf.train.Example. Flowers with TPUs: label_feature=class.
    image_feature: str = "image"
    label_feature: str = "label"
    id_feature: str = "id"
    # Only for TFRecords without a tpu2gpu manifest (e.g. Kaggle's Flowers records): the class list in label-index
    # order, and file patterns relative to runtime.tfrecords.
    class_names: tuple[str, ...] = ()
    train_files: str = "train/*.tfrec"
    val_files: str = "val/*.tfrec"
    test_files: str = "test/*.tfrec"
    image_size: int = 224  # pixels, square; images are resized to this in the pipeline
    # Conversion to TFRecords.
    folds: int = 5  # >= 2: stratified K folds; 0 or 1: one stratified hold-out split of val_fraction
    val_fraction: float = 0.2
    shard_target_mb: float = 100.0  # Kaggle guidance: 10-100 files of 10-100 MB
    convert_size: int = 0  # > 0: resize to convert_size x convert_size and re-encode while converting
    reencode: Literal["keep", "jpeg", "png"] = "keep"  # keep = store the original file bytes, checked by decoding
    jpeg_quality: int = 95
    workers: int = 0  # image preparation threads; 0 = one per core
    split_seed: int = 42
    # Training-time augmentation (never applied to validation or test data).
    shuffle_buffer: int = 2048
    augment: bool = True
    flip_left_right: bool = True
    flip_up_down: bool = False
    rotate90: bool = False
    brightness: float = 0.0  # max delta, in [0, 1] image units
    contrast: float = 0.0  # max relative change, e.g. 0.2 -> factor in [0.8, 1.2]


@dataclass
class ModelConfig:
    backbone: Literal["hub", "efficientnet"] = "hub"
    # A TF Hub / Kaggle Models handle or a local SavedModel directory (e.g. an attached /kaggle/input/... model).
    hub_handle: str = "https://www.kaggle.com/models/google/efficientnet-v2/TensorFlow2/imagenet21k-b0-feature-vector/1"
    efficientnet_variant: str = "B0"
    efficientnet_weights: str = "imagenet"  # none | imagenet | noisy-student | path to a weights file
    trainable: bool = True
    dropout: float = 0.2
    num_classes: int = 0  # 0 = from the data manifest


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size_per_replica: int = 16  # global batch = this x replicas (8 TPU cores -> 128)
    batch_size: int = 0  # > 0: the global batch instead; must divide over the replicas
    steps_per_epoch: int = 0  # 0 = one pass over the training records; > 0 caps it (quick local runs)
    learning_rate: float = 1e-3  # for a global batch of lr_reference_batch; scaled linearly with the global batch
    lr_reference_batch: int = 256
    warmup_epochs: float = 1.0
    steps_per_execution: int = 32
    loop: Literal["fit", "custom"] = "fit"
    label_smoothing: float = 0.0
    fold: int = 0  # -1 = every fold in turn
    precision: Literal["auto", "float32", "mixed_bfloat16", "mixed_float16"] = "auto"
    time_budget_hours: float = 8.25  # a 9 h Kaggle session minus time to export and write outputs
    export_float16: bool = True  # add a float16 signature to the export (T4 tensor cores); doubles its size
    seed: int = 42


@dataclass
class InferConfig:
    # Export folders (paths or attached Kaggle dataset names); each may hold several fold exports. Empty = every
    # export found under /kaggle/input.
    exports: tuple[str, ...] = ()
    batch_size: int = 128  # global
    tta: tuple[str, ...] = ()  # extra views, e.g. [flip_left_right]; averaged with the original image's
    xla: bool = False  # compile the prediction step with XLA
    precision: Literal["auto", "float32", "float16"] = "auto"  # auto: float16 on tensor-core GPUs when exported
    check_images: bool = True  # refuse test images whose size or colour mode differ from the training images
    save_probabilities: bool = True  # probabilities.csv beside submission.csv, for blending
    submission: str = "submission.csv"


@dataclass
class RuntimeConfig:
    strategy: Literal["auto", "tpu", "mirrored", "default"] = "auto"
    tpu_address: str = ""  # "" = Kaggle's own (local on a TPU VM, $TPU_NAME on a TPU Node)
    cpu_devices: int = 1  # > 1 splits the CPU into logical devices (MirroredStrategy without a GPU)
    competition_dir: str = ""  # a Kaggle-style folder (CSV + images); a path or an attached Kaggle input name
    tfrecords: str = ""  # folder of TFRecords + manifest: a path, gs:// URL or an attached Kaggle dataset name
    private_dataset: bool = False  # read through GCS with the kernel's gcloud credential (TPU Node only)
    output_dir: str = ""  # "" = /kaggle/working on Kaggle, ./runs/<train|infer> locally


@dataclass
class KaggleConfig:
    """What `tpu2gpu build` writes into kernel-metadata.json / dataset-metadata.json (kernels never read it)."""

    owner: str = ""  # your Kaggle username
    competition: str = ""  # the competition slug, e.g. tpu-getting-started
    code_competition: bool = True  # submissions come from a kernel with the internet off
    train_kernel: str = "tpu2gpu-train"
    infer_kernel: str = "tpu2gpu-infer"
    model_dataset: str = "tpu2gpu-model"  # the training export, published as a dataset
    # Titles; "" = the slug's words ("tpu2gpu train"). Kaggle derives the URL from the title, so it must slugify to
    # the slug.
    train_title: str = ""
    infer_title: str = ""
    dataset_title: str = ""
    dataset_version: int = 0  # model dataset version the inference kernel attaches; 0 = the latest
    dataset_sources: tuple[str, ...] = ()  # extra inputs of the training kernel, e.g. owner/my-tfrecords
    model_sources: tuple[str, ...] = ()  # owner/model/framework/variation/version, e.g. a Kaggle Models EfficientNet
    train_accelerator: str = "TpuV5E8"
    infer_accelerator: str = "NvidiaTeslaT4"
    train_internet: bool = False
    infer_internet: bool = False  # must stay false for a code competition
    private: bool = True


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    infer: InferConfig = field(default_factory=InferConfig)
    kaggle: KaggleConfig = field(default_factory=KaggleConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


def _did_you_mean(name: str, known: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Return `value` as the field type, or raise ConfigError naming `key`."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"config key '{key}' must be one of {list(choices)}, got {value!r}")
        return value
    if origin is tuple:
        (item_type, _) = typing.get_args(annotation)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        return tuple(_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value))
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config type {annotation} for '{key}'")
    raise ConfigError(f"config key '{key}' must be {annotation.__name__}, got {value!r} ({type(value).__name__})")


def _section_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}'{_did_you_mean(section, sections)}; "
                          f"sections are {list(sections)}")
    target = getattr(cfg, section)
    types = _section_types(type(target))
    if key not in types:
        raise ConfigError(f"unknown config key '{section}.{key}'{_did_you_mean(key, types)}; "
                          f"keys of '{section}' are {sorted(types)}")
    setattr(target, key, _coerce(value, types[key], f"{section}.{key}"))


def config_from_dict(raw: dict[str, Any], base: Config | None = None) -> Config:
    cfg = base if base is not None else Config()
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{section}' must be a mapping of keys, got {values!r}")
        for key, value in values.items():
            _apply(cfg, section, key, value)
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """'train.epochs=3' -> ('train', 'epochs', 3); the value is read as YAML (3, 0.5, true, [a, b], text)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. train.epochs=3")
    dotted, raw_value = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:
        value = raw_value
    if value is None:
        value = ""
    return section, key, value


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the file (YAML or JSON), then each `section.key=value` override, in that order."""
    cfg = Config()
    if path:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        text = path.read_text()
        try:
            raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise ConfigError(f"config file {path} is not valid {path.suffix.lstrip('.').upper()}: {err}") from err
        config_from_dict(raw or {}, cfg)
    for text in overrides:
        _apply(cfg, *parse_override(text))
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def format_config(cfg: Config) -> str:
    return json.dumps(config_to_dict(cfg), indent=2)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(format_config(cfg) + "\n")
