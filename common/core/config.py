"""One config for a run: typed defaults in code, a YAML/JSON file over them, `--set section.key=value` over that.

    cfg = load_config("configs/demo.yaml", ["train.epochs=3", "data.image_size=64"])
    print(format_config(cfg))            # logged first by every entry point
    save_config(cfg, "export/config.json")  # and saved with the results; load_config() reads it back

An unknown section or key, or a value of the wrong type, raises ConfigError naming the key (with a close match). Each
number declares its range and each name its choices on its own field (common/core/fields.py), checked as it is set;
a rule of two keys is checked where they meet (mixup_prob + cutmix_prob <= 1: common.data.pipeline.check_mixing).
What a floor above means by a key (data.task's tasks, train.framework's routes and the backbones each trains) its
owner supplies when it is imported (common/core/fields.py): this module imports nothing above common.core.
Each field's help is the docstring right after it (an attribute docstring, as Sphinx autodoc reads them): field_help()
reads them with `ast`, a field without one is an error, and config_reference() makes them the table in
docs/config.md (`tpu2gpu config --reference`).
Sections follow the Model Garden split: what to learn (data, model, train, infer) apart from where it runs (runtime):
model and data code never read `runtime`."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.core.candidates import TPU_PACKAGES
from common.core.errors import ConfigError, root_cause
from common.core.fields import duration, field_value, memory_size, one_of, supplied, supplied_checks, within

TTA_NAMES = ("identity", "flip_left_right", "flip_up_down", "rotate90", "rotate180", "rotate270", "transpose")


@dataclass
class DataConfig:
    task: str = one_of("multiclass", supplied("data.task"))
    """see common/tasks/types.py"""

    # Kaggle-style competition folder (read by `tpu2gpu tfrecords`, the training and the inference kernel).
    train_csv: str = "train.csv"
    """CSV of training ids and labels, in the competition folder"""
    train_images: str = "train"
    """folder of training images (JPEG/PNG named <id> or <id>.<ext>, or in one folder per class)"""
    layout: Literal["auto", "csv", "folders"] = "auto"
    """training labels: csv = train_csv; folders = train_images/<class>/<image> (the folder is the class, multiclass);
    auto = the CSV where it exists, else the folders"""
    test_images: str = "test"
    """folder of test images"""
    test_csv: str = "sample_submission.csv"
    """test ids, their order and the submission's columns"""
    id_column: str = "id"
    """id column of the CSVs"""
    label_column: str = "label"
    """label column of train.csv: class, 0/1, space-separated labels or a number by task"""
    label_columns: tuple[str, ...] = ()
    """multilabel given as one 0/1 column per class (instead of label_column)"""
    group_column: str = ""
    """e.g. patient id: folds keep each group whole (StratifiedGroupKFold)"""

    # TFRecord schema: feature names inside each tf.train.Example.
    image_feature: str = "image"
    """encoded JPEG/PNG bytes"""
    label_feature: str = "label"
    """class index / 0-1 (int64), multi-hot (int64 list) or value (float) by task"""
    id_feature: str = "id"
    """sample id bytes"""

    # Only for TFRecords without a tpu2gpu manifest (e.g. Kaggle's Flowers records).
    class_names: tuple[str, ...] = ()
    """class list in label-index order"""
    train_files: str = "train/*.tfrec"
    """training files, relative to runtime.tfrecords"""
    val_files: str = "val/*.tfrec"
    """validation files, relative to runtime.tfrecords"""
    test_files: str = "test/*.tfrec"
    """test files, relative to runtime.tfrecords"""
    image_size: int = within(224, "[8, 4096]")
    """pixels, square: images are resized to this in the pipeline and the model takes it"""

    # Conversion to TFRecords.
    folds: int = within(5, "[0, 100]")
    """>= 2: stratified K folds; 0 or 1: one stratified hold-out split of val_fraction"""
    val_fraction: float = within(0.2, "(0, 1)")
    """hold-out share when folds < 2"""
    shard_target_mb: float = within(100.0, "(0, inf)")
    """shard size (Kaggle guidance: 10-100 files of 10-100 MB)"""
    convert_size: int = within(0, "[0, 4096]")
    """> 0: resize to convert_size x convert_size while converting (then training skips it)"""
    reencode: Literal["keep", "jpeg", "png"] = "keep"
    """keep = store the original bytes, checked by decoding"""
    jpeg_quality: int = within(95, "[1, 100]")
    """JPEG quality when re-encoding"""
    on_bad_image: Literal["error", "skip"] = "error"
    """bad image: error lists all; skip omits them (bad_images.csv)"""
    verify_records: Literal["size", "full"] = "size"
    """before training: each shard's size against manifest.json (a stat each); full: also read every record's CRC"""
    workers: int = within(0, "[0, inf)")
    """image preparation threads; 0 = one per core"""
    split_seed: int = within(42, "[0, inf)")
    """seed of the fold split and of the shard order"""

    # Reading training records.
    deterministic: bool = False
    """read, decode and batch in a fixed order (slower): the same seed gives the same batches"""
    input_pipelines: int = within(0, "[0, 1024]")
    """keras_jax: pipelines per global batch, each reading its own files; 0 = one per process (set a multi-host job's
    count to feed one process its batches)"""

    # Training-time augmentation (never applied to validation or test data).
    shuffle_buffer: int = within(2048, "[0, inf)")
    """records shuffled before decoding"""
    augment: bool = True
    """apply the augmentations below"""
    augment_on: Literal["auto", "host", "device"] = "auto"
    """where the per-image augmentations run: host (the tf.data pipeline), device (on the batch inside the training
    step, on every route but torch_xla: where the host's cores cannot keep the GPUs fed), or auto: the device where
    the host's measured rate falls short (common/training/augment_side.py); MixUp and CutMix stay on the host"""
    flip_left_right: bool = True
    """random horizontal flip"""
    flip_up_down: bool = False
    """random vertical flip"""
    rotate90: bool = False
    """random multiple of 90 degrees"""
    brightness: float = within(0.0, "[0, 1]")
    """random brightness shift, max delta in [0, 1] image units"""
    contrast: float = within(0.0, "[0, 1)")
    """random contrast factor in [1 - contrast, 1 + contrast]"""
    hue: float = within(0.0, "[0, 0.5]")
    """random hue shift, max delta in [0, 0.5]"""
    saturation: float = within(0.0, "[0, 1]")
    """random saturation factor in [1 - saturation, 1 + saturation]"""
    crop_scale: float = within(0.0, "[0, 1]")
    """> 0: random resized crop keeping this minimum share of the area (e.g. 0.08 to 1)"""
    crop_ratio: float = within(1.333, "[1, 10]")
    """its aspect ratios in [1 / crop_ratio, crop_ratio]"""
    rotation: float = within(0.0, "[0, 180]")
    """affine: random rotation, max degrees"""
    shear: float = within(0.0, "[0, 80]")
    """affine: random shear, max degrees"""
    zoom: float = within(0.0, "[0, 1)")
    """affine: random zoom in [1 - zoom, 1 + zoom]"""
    shift: float = within(0.0, "[0, 1]")
    """affine: random shift, max share of the image size"""
    cutout: int = within(0, "[0, 64]")
    """coarse dropout: this many holes per image (filled with grey)"""
    cutout_size: float = within(0.2, "(0, 1]")
    """each hole's side, as a share of the image size"""
    mixup_prob: float = within(0.0, "[0, 1]")
    """share of batches mixed with MixUp (soft targets, every task)"""
    mixup_alpha: float = within(0.2, "[0, inf)")
    """MixUp's Beta(alpha, alpha)"""
    cutmix_prob: float = within(0.0, "[0, 1]")
    """share of batches mixed with CutMix (mixup_prob + cutmix_prob <= 1)"""
    cutmix_alpha: float = within(1.0, "[0, inf)")
    """CutMix's Beta(alpha, alpha)"""


@dataclass
class ModelConfig:
    backbone: str = one_of("hub", supplied("model.backbone"))
    """TF Hub model (tf_keras route); EfficientNet (efficientnet package on tf_keras, keras.applications on keras_jax);
    keras = model.keras_backbone (keras_jax); timm = model.timm_model (torch_xla, torch)"""

    # A TF Hub / Kaggle Models handle or a local SavedModel directory (e.g. an attached /kaggle/input/... model).
    hub_handle: str = "https://www.kaggle.com/models/google/efficientnet-v2/TensorFlow2/imagenet21k-b0-feature-vector/1"
    """feature-vector model: a handle, Kaggle Models handle or SavedModel path"""
    efficientnet_variant: str = "B0"
    """B0-B7 when backbone=efficientnet; V2B0-V2B3, V2S, V2M, V2L on keras_jax too"""
    efficientnet_weights: str = "imagenet"
    """none | imagenet | noisy-student (tf_keras) | path to a weights file (keras_jax: keras.applications' .h5)"""
    keras_backbone: str = ""
    """backbone=keras: a .keras feature extractor (images in [0, 1]) or a KerasHub preset folder (its image converter's
    scale and offset applied in the model)"""
    timm_model: str = "efficientnet_b0"
    """backbone=timm: a timm architecture name, or a folder as timm's save_for_hf writes it (config.json +
    model.safetensors)"""
    timm_weights: Literal["none", "pretrained"] = "pretrained"
    """a timm name's weights: pretrained (timm downloads them: the training kernel needs internet) or none; a folder
    brings its own"""
    trainable: bool = True
    """fine-tune the backbone (false: train the head only)"""
    dropout: float = within(0.2, "[0, 1)")
    """dropout before the classification layer"""
    num_classes: int = within(0, "[0, inf)")
    """0 = from the data; else must match it"""


@dataclass
class TrainConfig:
    epochs: int = within(10, "[1, inf)")
    """epochs per fold"""
    batch_size_per_replica: int | str = within(16, "[1, inf)", word="auto")
    """global batch = this x replicas (8 TPU cores -> 128); auto: the largest power of two up to 128 that fits the
    device's memory (docs/training.md)"""
    batch_size: int = within(0, "[0, inf)")
    """> 0: the global batch instead; must divide over the replicas"""
    steps_per_epoch: int = within(0, "[0, inf)")
    """0 = one pass over the training records; > 0 caps it (quick local runs)"""
    learning_rate: float = within(1e-3, "(0, inf)")
    """for a global batch of lr_reference_batch; scaled linearly with the global batch"""
    lr_reference_batch: int = within(256, "[1, inf)")
    """the global batch learning_rate is meant for"""
    warmup_epochs: float = within(1.0, "[0, inf)")
    """linear warm-up from 0 to the rate, then train.schedule"""
    schedule: Literal["cosine", "step", "constant"] = "cosine"
    """after the warm-up: cosine decay to zero, step (a tenth after each third of the rest), or constant"""
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    """Adam; AdamW (decoupled weight decay, train.weight_decay); SGD with train.momentum"""
    weight_decay: float = within(0.05, "[0, inf)")
    """AdamW's decoupled weight decay: each weight shrinks by rate x this a step (timm's default 0.05)"""
    momentum: float = within(0.9, "[0, 1)")
    """SGD's momentum"""
    steps_per_execution: int = within(32, "[1, inf)")
    """training steps per host round trip (tf.function call)"""
    framework: str = one_of("auto", supplied("train.framework"))
    """tf_keras under tf.distribute, Keras 3 on JAX, PyTorch/XLA (timm models, the TPU) or plain PyTorch (timm models,
    GPUs, DDP); auto: for model.backbone=timm torch where there are NVIDIA GPUs and torch_xla elsewhere, else tf_keras,
    and on a Kaggle TPU keras_jax when no TensorFlow TPU stack answers"""
    loop: Literal["fit", "custom"] = "fit"
    """Keras fit, or the custom strategy.run loop (tf_keras)"""
    torch_step: Literal["auto", "compiled", "lazy"] = "auto"
    """PyTorch routes: compiled (torch_xla: traced once under torch.compile(backend="openxla"); torch: torch.compile,
    eager where it cannot capture) or lazy (torch_xla: re-traced every step; torch: eager); auto: compiled, but eager on
    the torch route's CPU (inductor's compile outlasts a short run there)"""
    label_smoothing: float = within(0.0, "[0, 1)")
    """cross-entropy label smoothing"""
    class_weight: Literal["none", "balanced"] = "none"
    """balanced: weigh the loss by n / (classes x count) per class"""
    metric: str = ""
    """competition metric on the validation fold; "" = the task's default (common/tasks/types.py)"""
    keep: Literal["best", "last"] = "best"
    """export the epoch with the best train.metric, or the last epoch"""
    ema: float = within(0.0, "[0, 1)")
    """> 0: export the optimiser's moving average of the weights with this momentum (e.g. 0.999)"""
    early_stopping: int = within(0, "[0, inf)")
    """> 0: stop a fold after this many epochs without a better train.metric"""
    fold: int = within(0, "[-1, inf)")
    """fold to train; -1 = every fold in turn"""
    folds: tuple[int, ...] = ()
    """the folds to train, in turn (e.g. [0, 1, 2]: a part of kaggle.train_parts); empty = train.fold"""
    precision: Literal["auto", "float32", "mixed_bfloat16", "mixed_float16"] = "auto"
    """auto: bf16 TPU, fp16 GPU"""
    time_budget_hours: float = within(0.0, "[0, inf)")
    """training and exports end within this; 0 = the training accelerator's Kaggle session (kaggle.train_accelerator:
    9 h on a TPU, 12 h on a GPU) less 45 min"""
    fold_minutes: float = within(0.0, "[0, inf)")
    """a fold's time before one is measured: the first fold starts only if it fits"""
    export_minutes: float = within(5.0, "[0, inf)")
    """time a fold keeps for its export until one export has been measured"""
    export_float16: bool = True
    """add a float16 signature (T4 tensor cores) where the graph computes in float16 and holds 1e-2 of float32 as tensor
    cores compute it"""
    seed: int = within(42, "[0, inf)")
    """shuffling seed and the initial weights of what is not pretrained (the head)"""


@dataclass
class InferConfig:
    exports: tuple[str, ...] = ()
    """export folders, attached dataset names or gs:// folders; empty = /kaggle/input"""
    batch_size: int = within(128, "[1, inf)")
    """global inference batch"""
    tta: tuple[str, ...] = one_of((), TTA_NAMES, "views")
    """extra views, e.g. [flip_left_right]; averaged with the original image's"""
    xla: bool = False
    """compile the prediction step with XLA (for GPUs; slower on the CPU)"""
    precision: Literal["auto", "float32", "float16", "amp"] = "auto"
    """auto: float16 signature on tensor cores"""
    blend: str = "auto"
    """the runs' weights: auto = the blend.json `tpu2gpu blend` wrote, where one is among the exports; none = every
    export alike; or a blend.json's path"""
    cut_folds: Literal["weight", "exclude", "include"] = "weight"
    """folds the budget cut: by epochs, out, in full"""
    check_images: Literal["warn", "strict", "off"] = "warn"
    """test images unlike the training ones: count, refuse, skip"""
    on_bad_image: Literal["fallback", "error"] = "fallback"
    """a test image nothing can read: the mean prediction of the readable ones, named in bad_test_images.csv; or stop
    naming them all (local runs)"""
    save_probabilities: bool = True
    """probabilities.csv beside submission.csv, for blending"""
    submission: str = "submission.csv"
    """file name in the output folder"""
    time_limit: str = duration("9h")
    """the competition's run-time limit (9h, 2h30m, 45m, 90s), from the kernel's start: the ensemble sheds TTA views,
    then members, where its measured pace would pass it; none = no plan (docs/training.md, "The time limit")"""
    time_margin: float = within(0.1, "[0, 0.9]")
    """share of infer.time_limit left unplanned: the container's start before Python, the files written at the end, a
    pace that falls after the last look"""
    expected_test_images: int = within(0, "[0, inf)")
    """the hidden test set's size where the competition states it: the run projects its time against infer.time_limit; 0
    = unknown"""


@dataclass
class KaggleConfig:
    """What `tpu2gpu build` writes into kernel-metadata.json / dataset-metadata.json. Kernels read only the tpu_*
    keys and train_internet, before TensorFlow is imported (the TPU stack install)."""

    owner: str = ""
    """your Kaggle username"""
    competition: str = ""
    """the competition slug, e.g. tpu-getting-started"""
    code_competition: bool = True
    """submissions come from a kernel with the internet off"""
    train_kernel: str = "tpu2gpu-train"
    """training kernel slug"""
    infer_kernel: str = "tpu2gpu-infer"
    """inference kernel slug"""
    model_dataset: str = "tpu2gpu-model"
    """slug of the dataset the training export is published as"""
    train_title: str = ""
    """empty = the slug's words; Kaggle derives the URL from the title, so it must match"""
    infer_title: str = ""
    """empty = the slug's words"""
    dataset_title: str = ""
    """empty = the slug's words (6-50 characters)"""
    dataset_version: int = within(0, "[0, inf)")
    """model dataset version the inference kernel attaches; 0 = the latest"""
    dataset_sources: tuple[str, ...] = ()
    """extra inputs of the training kernel, e.g. owner/my-tfrecords"""
    model_sources: tuple[str, ...] = ()
    """owner/model/framework/variation/version, e.g. a Kaggle Models EfficientNet"""
    train_accelerator: str = "TpuV5E8"
    """machine_shape of the training kernel: TpuV5E8 (TPU v5e-8) or NvidiaTeslaT4 (GPU T4 x2); NvidiaTeslaP100 is
    refused"""
    infer_accelerator: str = "NvidiaTeslaT4"
    """machine_shape of the inference kernel: GPU T4 x2 (a P100 is refused)"""
    train_internet: bool = False
    """internet for the training kernel (also lets it pip-install the TPU stack)"""
    train_parts: tuple[str, ...] = ()
    """the folds split over training kernels that Kaggle runs at once, each 'FOLDS@ACCELERATOR' and settings of its
    own, e.g. ['0,1,2@TpuV5E8', '3@NvidiaTeslaT4 train.framework=torch model.backbone=timm']: kernel
    <train_kernel>-p1, -p2, ... (at most one TPU and two GPU sessions at once); empty = one training kernel"""
    max_links: int = within(4, "[1, 100]")
    """`tpu2gpu workflow`: links each training kernel's chain may have (`tpu2gpu continue`) before it publishes"""

    # TPU stack (common/launch/tpu_stack.py): Kaggle's TPU image ships tensorflow-cpu, which sees no TPU; the training
    # kernel installs these pins and runs itself again. install = whenever the image differs from them; image = trust
    # it.
    tpu_runtime: Literal["install", "image"] = "install"
    """install = make a TPU kernel hold tpu_packages; image = as is"""
    tpu_packages: tuple[str, ...] = TPU_PACKAGES
    """candidate TPU stacks in order, each "pjrt: PIN PIN ..." or "streamexecutor: ..."
    (common/launch/negotiation.py)"""
    tpu_probe_seconds: float = within(300.0, "(0, inf)")
    """time limit of each candidate's probe (import TensorFlow, connect, one op on the TPU)"""
    tpu_wheels: str = ""
    """wheels dataset (`tpu2gpu wheels`): a slug of kaggle.owner's, or owner/slug"""
    tpu_find_links: str = ""
    """extra pip --find-links for the online route (e.g. the libtpu release index)"""
    infer_internet: bool = False
    """must stay false for a code competition"""
    private: bool = True
    """kernels private"""


@dataclass
class RuntimeConfig:
    strategy: Literal["auto", "tpu", "mirrored", "default"] = "auto"
    """auto: TPU, else several GPUs, else default"""
    tpu_address: str = ""
    """empty = Kaggle's own (local on a TPU VM, $TPU_NAME on a TPU Node)"""
    cpu_devices: int = within(1, "[1, 64]")
    """> 1 splits the CPU into logical devices (MirroredStrategy without a GPU)"""
    competition_dir: str = ""
    """a Kaggle-style folder (CSV + images): a path or an attached Kaggle input name"""
    tfrecords: str = ""
    """TFRecords (+ manifest): a path, gs:// URL or an attached Kaggle dataset name"""
    private_dataset: bool = False
    """read through GCS with the kernel's gcloud credential (TPU Node only)"""
    output_dir: str = ""
    """empty = /kaggle/working on Kaggle, ./runs/train or ./runs/infer locally; training: gs:// too"""
    start_over: bool = False
    """true: the folds to train start from nothing, their exports and checkpoints removed first (a gs:// output's too);
    false: exported folds are skipped, checkpointed ones resume"""
    continue_from: str = ""
    """the output of a run this one continues (a kernel chain's previous link): its kernel's owner/slug attached as an
    input (`tpu2gpu continue` builds it so), or a local folder. Its exported folds are carried, a fold its time budget
    cut resumes from its checkpoint, the folds it did not start train"""
    scratch_dir: str = ""
    """records converted in-kernel, checkpoints (a gs:// output keeps those); "" = /kaggle/temp on Kaggle, else
    output_dir"""
    compile_cache: str = ""
    """compiled programs kept for later folds and runs (keras_jax, torch_xla): a local folder, off, or "" =
    $TPU2GPU_COMPILE_CACHE, else compile-cache/ in the scratch folder"""
    multihost: bool = False
    """a Cloud TPU VM pod slice (keras_jax): JAX's distributed runtime finds the other hosts; several GPU nodes set
    KERAS_DISTRIBUTION_* instead"""
    device_memory: str = memory_size()
    """memory of one device (a chip, a GPU), e.g. 16GB: what train.batch_size_per_replica=auto plans in, and what
    keras_jax checks its compiled step against; "" = what the device reports (none on the CPU)"""
    host_timeout_seconds: int = within(60, "[10, 3600]")
    """several processes: a host silent this long ends the job (JAX's coordination heartbeat)"""


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


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(
            f"unknown config section '{section}'{_did_you_mean(section, sections)}; sections are {list(sections)}"
        )
    target = getattr(cfg, section)
    types = typing.get_type_hints(type(target))
    if key not in types:
        raise ConfigError(
            f"unknown config key '{section}.{key}'{_did_you_mean(key, types)}; keys of '{section}' are {sorted(types)}"
        )
    spec = next(f for f in dataclasses.fields(target) if f.name == key)
    setattr(target, key, field_value(f"{section}.{key}", value, spec, types[key]))


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


def _yaml():
    """PyYAML, imported on first use: a built kernel reads its config as JSON and must not need it."""
    import yaml

    return yaml


def _read_yaml(text: str) -> Any:
    """YAML with the words as written: only true and false are booleans. YAML 1.1 (PyYAML) also reads off, no, on,
    yes as booleans and null, ~ and nothing as None, which turned infer.check_images=off into False; here they stay
    words, which a string field takes as they are and a bool field reads as booleans (common/core/fields.py)."""
    yaml = _yaml()

    class WordsLoader(yaml.SafeLoader):
        pass

    dropped = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:null")
    WordsLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in dropped]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    WordsLoader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
    )
    return yaml.load(text, Loader=WordsLoader)


def parse_override(text: str) -> tuple[str, str, Any]:
    """'train.epochs=3' -> ('train', 'epochs', 3); the value is read as YAML (3, 0.5, true, [a, b], off, text)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. train.epochs=3")
    dotted, raw_value = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = _read_yaml(raw_value) if raw_value.strip() else ""
    except _yaml().YAMLError:
        value = raw_value
    return section, key, value


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the file (YAML or JSON), then each `section.key=value` override, in that order."""
    cfg = Config()
    if path:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        text = path.read_text()
        errors = (json.JSONDecodeError,) if path.suffix == ".json" else (_yaml().YAMLError,)
        try:
            raw = json.loads(text) if path.suffix == ".json" else _read_yaml(text)
        except errors as err:
            kind = path.suffix.lstrip(".").upper()
            raise ConfigError(f"config file {path} is not valid {kind}: {root_cause(err)}") from err
        config_from_dict(raw or {}, cfg)
    for text in overrides:
        _apply(cfg, *parse_override(text))
    for check in supplied_checks():  # rules of keys that meet in a floor above (common/core/fields.py)
        check(cfg)
    return cfg


def with_overrides(cfg: Config, overrides: typing.Sequence[str]) -> Config:
    """A copy of cfg with each `section.key=value` override applied, checked as load_config checks."""
    copy = config_from_dict(config_to_dict(cfg))
    for text in overrides:
        _apply(copy, *parse_override(text))
    for check in supplied_checks():
        check(copy)
    return copy


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """--config FILE and repeated --set section.key=value: the same flags on every tpu2gpu step and both kernels."""
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON config over the defaults")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key, e.g. --set train.epochs=3 (repeatable)",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def parse_kernel_args(description: str, argv: typing.Sequence[str] | None = None) -> Config:
    """A kernel's command line (its module docstring as --help) -> the resolved config."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def format_config(cfg: Config) -> str:
    return json.dumps(config_to_dict(cfg), indent=2)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(format_config(cfg) + "\n")


def field_help(cls: type) -> dict[str, str]:
    """Each field's help: the string literal right after it in the class body (an attribute docstring, as Sphinx
    autodoc reads them), read with `ast`, its lines joined by spaces. A field without one is an error."""
    import ast
    import inspect
    import itertools
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    helps = {}
    for stmt, after in itertools.pairwise(body):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr):
            if isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                helps[stmt.target.id] = " ".join(inspect.cleandoc(after.value.value).splitlines())
    missing = [f.name for f in dataclasses.fields(cls) if not helps.get(f.name)]
    if missing:
        raise ValueError(f"{cls.__name__}: no help for {', '.join(missing)}: write a docstring right after each field")
    return helps


def config_reference() -> str:
    """A markdown table of every key, its default and its help (field_help: the docstring after each field)."""
    rows = ["| key | default | what it does |", "|---|---|---|"]
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        helps = field_help(cls)
        for f in dataclasses.fields(cls):
            default = json.dumps(getattr(cls(), f.name))
            what = helps[f.name].replace("|", "\\|")  # a bare | would end the markdown cell
            rows.append(f"| `{section.name}.{f.name}` | `{default}` | {what} |")
    return "\n".join(rows)
