"""An export loaded for inference: TensorFlow alone (no tf_keras, no tensorflow_hub), any version the GPU image has.

card, predict = load_export(export_dir)       # predict(uint8 images [N, S, S, 3]) -> float32 [N, K]
fetch_exports("gs://bucket/run/export", Path("runs/gcs/input/..."))  # its complete exports, copied there
"""

from __future__ import annotations

from pathlib import Path

from common.core.gcs import bucket_errors, download, remote_files
from common.export.card import CARD_NAME, OUTPUT_NAME, SAVED_MODEL_DIR, ExportError, ModelCard, read_card

import tensorflow as tf


def serving_functions(export_dir: str | Path, card: ModelCard, precisions=("float32",)) -> dict:
    """{precision: predict(uint8 images [N, S, S, 3]) -> float32 predictions [N, K]} of the export whose card is
    `card`, each computing in its precision (float32, or float16 where the export offers it), from one load of the
    SavedModel. TensorFlow only."""
    for precision in precisions:
        if precision not in card.precisions:
            raise ExportError(
                f"{export_dir} offers {sorted(card.precisions)} computation, not {precision}. Fix: "
                "infer.precision=auto or float32, or re-export with train.export_float16=true"
            )
    loaded = tf.saved_model.load(
        str(Path(export_dir) / SAVED_MODEL_DIR),
        options=tf.saved_model.LoadOptions(experimental_io_device="/job:localhost"),
    )

    def signature(precision: str):
        serve = loaded.signatures[card.precisions[precision]]

        def predict(images) -> tf.Tensor:
            return serve(images=tf.convert_to_tensor(images, tf.uint8))[OUTPUT_NAME]

        predict.loaded = loaded  # keeps the variables alive as long as predict is
        return predict

    return {precision: signature(precision) for precision in precisions}


def serving_function(export_dir: str | Path, card: ModelCard, precision: str = "float32"):
    """predict(uint8 images [N, S, S, 3]) -> float32 predictions [N, K] in `precision`: see serving_functions."""
    return serving_functions(export_dir, card, (precision,))[precision]


def load_export(export_dir: str | Path, precision: str = "float32") -> tuple[ModelCard, object]:
    """(card, predict) of a complete export: see serving_function."""
    card = read_card(export_dir)
    return card, serving_function(export_dir, card, precision)


def fetch_exports(url: str, local: Path) -> Path:
    """The complete exports (folders whose model_card.json is there) under a gs:// folder, copied into `local`
    (replaced); an export without its card (an upload cut short) is refused by name."""
    with bucket_errors(url, "reading"):
        files = remote_files(url)
        saved = {Path(r).parent.parent for r in files if r.endswith(f"{SAVED_MODEL_DIR}/saved_model.pb")}
        cut = sorted(str(f) for f in saved if (f / CARD_NAME).as_posix() not in files)
        if cut:
            where = url.rstrip("/") + ("" if cut[0] == "." else f"/{cut[0]}")
            raise ExportError(
                f"{where} holds a SavedModel without its {CARD_NAME}: its upload "
                "was cut short, so it is not taken for an export. Fix: run the training again with the "
                "same runtime.output_dir (it uploads that fold again), or remove the folder from the "
                "bucket to go without it"
            )
        download(files, local)
    print(f"[gcs] {url}: {len(saved)} export(s), {len(files)} files, copied into {local}", flush=True)
    return local
