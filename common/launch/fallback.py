"""Which route trains on a Kaggle TPU VM: the TensorFlow TPU stack the negotiation finds (common/launch/negotiation.py),
or, under train.framework=auto when none answers or none can be installed, Keras 3 on JAX as the image ships it
(common/training/backends/keras_jax/backend.py), when the backbone has a Keras 3 form. The log says which, and why:

    [tpu] none of the 4 TensorFlow TPU stacks tried answered:
    [tpu] train.framework=auto: taking the Keras 3 on JAX route instead (the image's JAX owns the TPU, ...)

The card's runtime.tpu_stack and training_report.json record every try (fallback_record). Standard library only.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from common.core.platform import installed_versions
from common.launch.negotiation import FALLBACK_ENV, JAX_ROUTE_FIX, _route, ensure_tpu_stack
from common.launch.tpu_stack import (
    TpuStackError,
    _pip,
    check_wheels,
    download_wheels,
    pin_specs,
    same_version,
)

if TYPE_CHECKING:
    from common.core.config import Config


def fallback_record() -> dict | None:
    """Why a Kaggle TPU run trains with Keras 3 on JAX under train.framework=auto: {reason, tries}."""
    return json.loads(os.environ.get(FALLBACK_ENV) or "null")


def fallback_blocked(cfg: Config) -> str:
    """Why train.framework=auto cannot fall back to the TPU route's fallback (keras_jax) here ('' when it can)."""
    from common.launch.routes import ROUTES, route_of

    if cfg.train.framework != "auto":
        return f"train.framework={cfg.train.framework} asks for TensorFlow"
    route = route_of(cfg)
    fallback = ROUTES.get(route.fallback)
    if fallback is None:
        return f"train.framework={route.name} has no other route on a TPU"
    if cfg.model.backbone not in fallback.backbones:
        return f"model.backbone={cfg.model.backbone} has no Keras 3 form"
    missing = fallback.missing()
    return f"this image lacks {', '.join(missing)}" if missing else ""


def restore_image_package(name: str, version: str | None, kaggle_cfg) -> None:
    """Put the image's own `name` back (JAX's libtpu, which a tried TensorFlow stack replaced), from the attached
    wheels or the package index; `tpu2gpu wheels` holds the image's libtpu as the third default candidate's pin."""
    if not version or same_version(installed_versions().get(name, ""), version):
        return
    pins = {name: version}
    folder = _route(kaggle_cfg)
    if folder is None:
        if not kaggle_cfg.train_internet:
            raise TpuStackError(
                f"the tries replaced the image's {name} {version}, which JAX needs, and neither the "
                "wheels nor the internet are there to put it back. Fix: --set "
                "train.framework=keras_jax (it skips the TensorFlow tries), and rebuild"
            )
        folder = download_wheels(pins, Path(tempfile.gettempdir()) / "tpu2gpu-image-wheels", kaggle_cfg.tpu_find_links)
    wheel = check_wheels(pins, folder)[0]
    _pip(
        ["install", "--no-index", "--no-deps", "--find-links", str(wheel.parent), *pin_specs(pins)],
        f"putting back the image's {name} {version}",
    )
    print(f"[tpu] put back the image's {name} {version} for JAX", flush=True)


def negotiate(cfg: Config, rerun) -> int | None:
    """ensure_tpu_stack, and under train.framework=auto, when no TensorFlow TPU stack answers or none can be
    installed, the keras_jax route (when the backbone has a Keras 3 form): it says why, and which route it took."""
    from common.launch.routes import FRAMEWORK_ENV, ROUTES, route_of

    image_libtpu = installed_versions().get("libtpu")
    try:
        return ensure_tpu_stack(cfg.kaggle, rerun)
    except TpuStackError as err:
        blocked = "" if not getattr(err, "fatal", False) else "TensorFlow was left half-installed"
        blocked = blocked or fallback_blocked(cfg)
        if blocked:
            why = f" (train.framework=auto did not: {blocked})" if cfg.train.framework == "auto" else ""
            err.args = (f"{err}{why}" if JAX_ROUTE_FIX in str(err) else f"{err} {JAX_ROUTE_FIX}{why}",)
            raise
        reason = str(err).splitlines()[0].split(" Fix:")[0]  # what failed; the fix is this route
        print(
            f"[tpu] {reason}\n[tpu] train.framework=auto: taking the Keras 3 on JAX route instead (the image's "
            "JAX owns the TPU, TensorFlow only reads the data)",
            flush=True,
        )
        fallback = ROUTES[route_of(cfg).fallback]
        env = {
            FRAMEWORK_ENV: fallback.name,
            FALLBACK_ENV: json.dumps({"reason": reason, "tries": [asdict(t) for t in getattr(err, "tries", [])]}),
        }
        if getattr(err, "installed", False):  # this interpreter's packages changed under it: a fresh one trains
            restore_image_package("libtpu", image_libtpu, cfg.kaggle)
            print("[tpu] running the kernel again in a fresh interpreter", flush=True)
            return rerun({**env, **dict(fallback.environment)})
        os.environ.update(env)
        fallback.prepare(cfg)
        return None
