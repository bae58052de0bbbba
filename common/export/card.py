"""The model card: what an export says about itself (docs/design.md, contract 5), written and read here only.

    card = ModelCard.create(task, class_names, image_size, fold=0, metric={...}, ...)   # training: the one constructor
    write_card(folder, card)                                                            # model_card.json
    card = read_card(export_dir)            # inference: checked (format, complete) and upgraded from older cards

A card is frozen: the export adds its verification with dataclasses.replace, never by editing a card it was given.
The JSON keeps the names and nesting the inference kernel and users read (input, output, precision, time_budget,
metrics, ...). No TensorFlow here: the card is read before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from common.core.errors import DataError

EXPORT_FORMAT = "tpu2gpu-export/2"  # 2: task-typed predictions (common/tasks/types.py); 1 had class probabilities only
CARD_NAME = "model_card.json"
SAVED_MODEL_DIR = "saved_model"  # the SavedModel, beside the card
OUTPUT_NAME = "predictions"  # every signature's one output
VERIFY_NAME = "verify_batch.npz"  # a few validation images and what the export must predict for them
SIGNATURES = {"float32": "serving_default", "float16": "serving_float16"}
VERIFY_TOLERANCE = 1e-4  # the float32 signature against the trained model's exact float32 outputs
FLOAT16_TOLERANCE = 1e-2  # float16 storage: about 3 significant digits (checked in tensor-core arithmetic)


def scaled_difference(outputs, reference) -> float:
    """max |outputs - reference|, relative to the reference's scale where its values exceed 1 (regression values can
    be large): how every tolerance above is measured."""
    import numpy as np

    reference = np.asarray(reference, np.float32)
    scale = max(1.0, float(np.max(np.abs(reference))))
    return float(np.max(np.abs(np.asarray(outputs, np.float32) - reference))) / scale


class ExportError(DataError):
    """An export that is missing, incomplete, or does not reproduce its own predictions."""


@dataclass(frozen=True, kw_only=True)
class ModelCard:
    fold: int = 0
    task: str
    class_names: list[str]
    label_type: str = "str"  # int | str | float: how the training CSV wrote labels
    image_size: int
    record_schema: dict = field(default_factory=dict)  # common.data.records.RecordSchema of the training records
    source_images: dict | None = None  # colour modes and sizes of the training images (infer.check_images)
    input: dict  # the serving signature's input: uint8 [N, S, S, 3] RGB 0..255
    output: dict  # its output: float32 [N, K] of the task's kind, with a name per output
    metric: dict = field(default_factory=dict)  # {name, value}: train.metric on the validation fold
    thresholds: list[float] | None = None  # multilabel: per label, chosen on this fold's validation predictions
    target_scaling: dict | None = None  # regression: undone inside the export, which predicts the value
    class_weights: list[float] | None = None
    precision: dict = field(default_factory=dict)  # what each part computed in, training and serving
    time_budget: dict = field(default_factory=dict)  # common.training.budget.cut_record: did the budget cut this fold
    trained_in: list = field(default_factory=list)  # [{"run", "epochs": [first, last]}]: which run trained which epochs
    metrics: dict = field(default_factory=dict)  # every metric of the task, epochs, the per-class report
    config: dict = field(default_factory=dict)  # the whole training config
    format: str = EXPORT_FORMAT
    complete: bool = False  # true only in a folder whose fresh-process check passed
    versions: dict = field(default_factory=dict)  # python, tensorflow, tf_keras, tensorflow_hub at export
    runtime: dict | None = None  # the training framework, and on a TPU the stack that answered (tpu_negotiation)
    precisions: dict = field(default_factory=lambda: {"float32": SIGNATURES["float32"]})  # precision -> signature
    verification: dict | None = None  # the fresh-process check: max differences, environment, tolerances

    @classmethod
    def create(cls, task, class_names, image_size: int, **facts) -> ModelCard:
        """The card of a model of `task` (a common.tasks.types.Task) over `class_names` at `image_size`: the serving
        signature's input and output follow from those three."""
        names = list(class_names)
        return cls(
            task=task.name,
            class_names=names,
            image_size=image_size,
            input={
                "signature": "serving_default",
                "name": "images",
                "dtype": "uint8",
                "shape": [None, image_size, image_size, 3],
                "channels": "RGB",
                "range": [0, 255],
            },
            output={
                "name": "predictions",
                "kind": task.kind,
                "dtype": "float32",
                "shape": [None, task.outputs(len(names))],
                "names": task.output_names(names),
            },
            **facts,
        )

    @property
    def width(self) -> int:
        """Outputs per image."""
        return int(self.output["shape"][-1])

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=str) + "\n"


def upgrade(raw: dict) -> dict:
    """A format-2 card from any earlier release of this format, as today's fields: cards written before the card
    had time_budget said metrics.stopped_by_time_budget; before float16 signatures they had no precisions."""
    card = dict(raw)
    if "time_budget" not in card:
        metrics = card.get("metrics", {})
        card["time_budget"] = {
            "cut": metrics.get("stopped_by_time_budget", False),
            "epochs_trained": metrics.get("epochs"),
            "epochs_planned": card.get("config", {}).get("train", {}).get("epochs"),
            "exported_epoch": metrics.get("best_epoch"),
        }
    card.setdefault("precisions", {"float32": SIGNATURES["float32"]})
    card.setdefault("task", "multiclass")  # the first format-2 cards were all multiclass
    known = {f.name for f in dataclasses.fields(ModelCard)}
    return {key: value for key, value in card.items() if key in known}


def write_card(folder: Path, card: ModelCard) -> None:
    (Path(folder) / CARD_NAME).write_text(card.to_json())


def card_digest(export_dir: str | Path) -> str:
    """sha256 of the export's model_card.json as written: which trained model a folder holds, wherever it is copied
    (a blend names its members by it; two trainings never write the same card, a copy always does)."""
    import hashlib

    return hashlib.sha256((Path(export_dir) / CARD_NAME).read_bytes()).hexdigest()


def read_card(export_dir: str | Path, require_complete: bool = True) -> ModelCard:
    """The card of an export folder, refused when it is not a tpu2gpu export of this format or not complete."""
    export_dir = Path(export_dir)
    path = export_dir / CARD_NAME
    if not path.is_file():
        raise ExportError(
            f"{export_dir} holds no {CARD_NAME}: it is not a tpu2gpu export. Fix: point the inference "
            "kernel at the folder the training kernel exported (e.g. export/fold0)"
        )
    raw = json.loads(path.read_text())
    if raw.get("format") != EXPORT_FORMAT:
        raise ExportError(
            f"{export_dir} is a {raw.get('format')!r} export; this code reads {EXPORT_FORMAT}. Fix: "
            "export it again with this version of the training kernel"
        )
    if require_complete and raw.get("complete") is not True:
        raise ExportError(
            f"{export_dir} is not marked complete (an interrupted or failed export). Fix: run the "
            "training kernel again, or attach a complete export"
        )
    return ModelCard(**upgrade(raw))
