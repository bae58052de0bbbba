"""`tpu2gpu build`: one self-contained script per kernel, its kernel-metadata.json, and the model dataset's
dataset-metadata.json, filled from the templates in kernel-metadata/ and checked against the kaggle CLI's rules.

    build/train/train.py + kernel-metadata.json      (common + train_tpu, TPU v5e-8 or GPU T4 x2; with
                                                      kaggle.train_parts, build/train-p1/, -p2/, ...: tpu2gpu/parts.py)
    build/infer/infer.py + kernel-metadata.json      (common + infer_gpu, GPU T4 x2, internet off)
    build/dataset/dataset-metadata.json              (copied into the export before it is published)

A Kaggle script kernel is one file with nothing of this repository beside it, so each script carries its packages as
a base64 zip that it writes to the temp folder and puts first on sys.path (zipimport): no pip install, no internet.
The run config (the project config adapted to Kaggle paths) is embedded too. Builds are reproducible: zip entries have
fixed dates and order, JSON keeps the templates' order, and nothing records the time, so the same inputs give
byte-identical files.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import re
import zipfile
from pathlib import Path

from common.core.atomic import staged_dir
from common.core.config import Config, config_to_dict
from common.core.errors import UserError
from common.launch.tpu_stack import wheels_ref

from slugify import slugify

from tpu2gpu.parts import training_kernels
from tpu2gpu.reachability import TPU_SHAPES, unreachable

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "kernel-metadata"
KERNELS = {"train": ("train_tpu", "train_tpu.train"), "infer": ("infer_gpu", "infer_gpu.infer")}
GPU_SHAPES = ("NvidiaTeslaT4", "NvidiaTeslaP100", "NvidiaL4", "NvidiaTeslaA100", "NvidiaH100")
MACHINE_SHAPES = (*GPU_SHAPES, *TPU_SHAPES)
# Kaggle still allocates a P100, and its image's PyTorch no longer runs there (kaggle-cli #1151: the first CUDA op
# fails with cudaErrorNoKernelImageForDevice; docker-python #1544 dropped sm_60); P100s are being phased out.
RETIRED_SHAPES = {
    "NvidiaTeslaP100": "Kaggle's image no longer runs on a P100 (its PyTorch is built without sm_60: the "
    "first CUDA op fails with cudaErrorNoKernelImageForDevice, kaggle-cli #1151), and "
    "P100s are being phased out"
}
_SLUG = re.compile(r"^[a-z0-9](?:[a-z0-9-]*[a-z0-9])?$")


class MetadataError(UserError, ValueError):
    """kernel-metadata.json / dataset-metadata.json that the kaggle CLI or Kaggle would refuse or misread."""


# ---------------------------------------------------------------------------------------------------- validation
def _check_slug(field: str, slug: str, low: int, high: int) -> None:
    if not _SLUG.match(slug) or not low <= len(slug) <= high:
        raise MetadataError(f"{field}: slug {slug!r} must be {low}-{high} lowercase letters, digits or hyphens")


def _check_id(field: str, value: str, slug_range: tuple[int, int]) -> None:
    parts = value.split("/")
    if len(parts) != 2 or not parts[0]:
        raise MetadataError(f"{field}: {value!r} must be 'owner/slug' without a version (set kaggle.owner)")
    _check_slug(field, parts[1], *slug_range)


def _check_source(field: str, value: str, kind: str) -> None:
    parts = value.split("/")
    if kind == "competition":
        ok = len(parts) == 1 and bool(_SLUG.match(value))
        form = "a competition slug, e.g. tpu-getting-started"
    elif kind == "model":
        ok = len(parts) == 5 and all(parts) and parts[4].isdigit()
        form = "'owner/model/framework/variation/version' with an integer version"
    else:
        ok = len(parts) in (2, 3) and all(parts) and (len(parts) == 2 or parts[2].isdigit())
        form = "'owner/slug' or 'owner/slug/version'"
    if not ok:
        raise MetadataError(f"{field}: {value!r} is malformed; it must be {form}")


def validate_kernel_metadata(meta: dict, folder: Path, inference: bool, code_competition: bool) -> None:
    """The kaggle CLI's push checks, plus the Kaggle facts it does not check (docs/kaggle-facts.md): a machine its
    image no longer runs on, and a GPU or TPU asked for by the machine shape alone."""
    _check_id("id", meta.get("id", ""), (5, 50))
    title, slug = meta.get("title", ""), meta["id"].split("/")[1]
    if len(title) < 5:
        raise MetadataError(f"title: {title!r} is under 5 characters (the kaggle CLI refuses it)")
    if slugify(title) != slug:
        raise MetadataError(
            f"title: {title!r} slugifies to {slugify(title)!r}, not the slug {slug!r}; Kaggle would "
            "give the kernel another URL. Fix: a title made of the slug's words"
        )
    if not (folder / meta.get("code_file", "")).is_file():
        raise MetadataError(f"code_file: {meta.get('code_file')!r} does not exist in {folder}")
    if meta.get("language") != "python" or meta.get("kernel_type") != "script":
        raise MetadataError("language must be 'python' and kernel_type 'script'")
    for key, kind in (
        ("dataset_sources", "dataset"),
        ("kernel_sources", "kernel"),
        ("model_sources", "model"),
        ("competition_sources", "competition"),
    ):
        for source in meta.get(key, []):
            _check_source(key, source, kind)
    own = [source for source in meta.get("kernel_sources", []) if source.split("/")[:2] == meta["id"].split("/")]
    if own:
        raise MetadataError(
            f"kernel_sources: {own[0]!r} is this kernel itself, and a kernel cannot attach its own output (the push "
            "says 'not valid kernel sources' and still succeeds). Fix: a chain of slugs, each link attaching the one "
            "before (`tpu2gpu continue` builds it)"
        )
    shape = meta.get("machine_shape")
    if shape not in MACHINE_SHAPES:
        raise MetadataError(f"machine_shape: {shape!r} is not one of {list(MACHINE_SHAPES)}")
    key = "kaggle.infer_accelerator" if inference else "kaggle.train_accelerator"
    if shape in RETIRED_SHAPES:
        raise MetadataError(f"{key}={shape}: {RETIRED_SHAPES[shape]}. Fix: {key}=NvidiaTeslaT4 (GPU T4 x2)")
    if meta.get("enable_gpu") is not (shape in GPU_SHAPES):
        raise MetadataError(
            f"machine_shape {shape} with enable_gpu {meta.get('enable_gpu')}: a kernel that asks for "
            "a machine without its accelerator can land on another (kaggle-cli #821). Fix: "
            f"enable_gpu {str(shape in GPU_SHAPES).lower()} in kernel-metadata/"
        )
    if "docker_image" in meta:
        raise MetadataError(
            "docker_image: a pinned image puts a TPU kernel on the CPU image (kaggle-cli #1197); remove it"
        )
    if not isinstance(meta.get("enable_internet"), bool):
        raise MetadataError("enable_internet must be set explicitly: the CLI's default is true")
    if inference and code_competition and meta["enable_internet"]:
        raise MetadataError(
            "enable_internet: true on the inference kernel of a code competition, whose submissions "
            "must run offline. Fix: kaggle.infer_internet=false"
        )


def validate_dataset_metadata(meta: dict) -> None:
    title = meta.get("title", "")
    if not 6 <= len(title) <= 50:
        raise MetadataError(f"dataset title: {title!r} must be 6-50 characters")
    _check_id("dataset id", meta.get("id", ""), (6, 50))
    if len(meta.get("licenses", [])) != 1:
        raise MetadataError("dataset licenses: exactly one, e.g. [{'name': 'CC0-1.0'}]")


# ---------------------------------------------------------------------------------------------------------- build
def _fill(template, values: dict):
    """'{name}' alone becomes the typed value (bool, list); inside longer text it is formatted in."""
    if isinstance(template, str):
        whole = re.fullmatch(r"\{(\w+)\}", template)
        return values[whole.group(1)] if whole else template.format_map(values)
    if isinstance(template, list):
        return [_fill(item, values) for item in template]
    if isinstance(template, dict):
        return {key: _fill(value, values) for key, value in template.items()}
    return template


def template_values(cfg: Config) -> dict:
    k = cfg.kaggle
    # The TPU stack's offline route, attached to a TPU training kernel only: a GPU kernel has no use for it.
    wheels = wheels_ref(k.tpu_wheels, k.owner) if k.train_accelerator in TPU_SHAPES else ""
    dataset = f"{k.owner}/{k.model_dataset}" + (f"/{k.dataset_version}" if k.dataset_version else "")
    return {
        "owner": k.owner,
        "train_kernel": k.train_kernel,
        "infer_kernel": k.infer_kernel,
        "model_dataset": k.model_dataset,
        "private": k.private,
        "train_title": k.train_title or k.train_kernel.replace("-", " "),
        "infer_title": k.infer_title or k.infer_kernel.replace("-", " "),
        "dataset_title": k.dataset_title or k.model_dataset.replace("-", " "),
        "train_internet": k.train_internet,
        "infer_internet": k.infer_internet,
        "train_accelerator": k.train_accelerator,
        "infer_accelerator": k.infer_accelerator,
        "train_gpu": k.train_accelerator in GPU_SHAPES,
        "infer_gpu": k.infer_accelerator in GPU_SHAPES,
        "train_dataset_sources": list(dict.fromkeys([*k.dataset_sources, *filter(None, [wheels])])),
        "infer_dataset_sources": [dataset],
        "competition_sources": [k.competition] if k.competition else [],
        # A chain's next link attaches the link before (runtime.continue_from, common/training/chain.py).
        "train_kernel_sources": [cfg.runtime.continue_from] if cfg.runtime.continue_from else [],
        "model_sources": list(k.model_sources),
    }


def kernel_config(cfg: Config, kernel: str) -> dict:
    """The project config as the kernel runs it on Kaggle: inputs by their attached names, output in /kaggle/working.
    The inference kernel gets the model dataset as its exports, and keeps runtime.tfrecords only when that is the
    competition's own data (the only input attached to both kernels)."""
    runtime = dataclasses.replace(
        cfg.runtime,
        output_dir="",
        scratch_dir="",
        competition_dir=cfg.kaggle.competition or cfg.runtime.competition_dir,
    )
    run = dataclasses.replace(cfg, runtime=runtime)
    if kernel == "infer":
        exports = cfg.infer.exports or (f"{cfg.kaggle.owner}/{cfg.kaggle.model_dataset}",)
        shared = runtime.tfrecords if runtime.tfrecords == cfg.kaggle.competition else ""
        run = dataclasses.replace(
            run,
            infer=dataclasses.replace(cfg.infer, exports=exports),
            runtime=dataclasses.replace(runtime, tfrecords=shared),
        )
    return config_to_dict(run)


# What the GPU kernel leaves out of common/: it stands on the floors below inference (docs/design.md, "Floors") and
# never on the TPU launcher or training, so it does not carry them (an import of either fails in the built kernel,
# tests/test_kaggle.py runs it).
LEFT_OUT = {"train": (), "infer": ("common/launch/", "common/training/")}


# Pure-Python packages a training kernel carries where Kaggle's images lack them: torchax lowers a timm model that
# keras-hub cannot rebuild through JAX for its export (common/training/backends/torch_shared/export.py).
VENDORED = {"timm": ("torchax",)}


def vendored_roots(cfg: Config) -> list[Path]:
    """The folders holding the installed packages the training kernel of cfg carries (VENDORED, by backbone)."""
    import importlib.util

    roots = []
    for name in VENDORED.get(cfg.model.backbone, ()):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            raise MetadataError(
                f"model.backbone={cfg.model.backbone}: the training kernel carries {name}, which is not installed "
                "here. Fix: ./dev installs it (the torch extra), or pip install it"
            )
        roots.append(Path(spec.origin).parent.parent)
    return roots


def bundle_zip(packages: list[str], left_out: tuple[str, ...] = (), roots: tuple[Path, ...] = ()) -> bytes:
    """The packages' .py files (but those under left_out) in a zip with fixed dates and order: the same sources give
    the same bytes. A package is looked for in this repository, then in `roots` (installed packages carried)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for package in packages:
            root = next((r for r in (REPO, *roots) if (r / package).is_dir()), REPO)
            for path in sorted((root / package).rglob("*.py")):
                if path.relative_to(root).as_posix().startswith(left_out):
                    continue
                info = zipfile.ZipInfo(str(path.relative_to(root)), date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, path.read_bytes())
    return buffer.getvalue()


SCRIPT = '''"""tpu2gpu {kernel} kernel, built by `tpu2gpu build` (bundle sha256 {sha}).
Do not edit: change the repository and rebuild. Carries the packages {packages} as a zip and the run config;
needs no internet{note}."""

import base64
import json
import os
import sys
import tempfile

BUNDLE_SHA256 = "{sha}"
CONFIG = json.loads({config!r})
BUNDLE = (
{chunks}
)


def _unpack() -> str:
    path = os.path.join(tempfile.gettempdir(), "tpu2gpu-" + BUNDLE_SHA256[:16] + ".zip")
    if not os.path.exists(path):
        tmp = path + "." + str(os.getpid())
        with open(tmp, "wb") as f:
            f.write(base64.b64decode(BUNDLE))
        os.replace(tmp, path)
    return path


BUNDLE_PATH = _unpack()
sys.path.insert(0, BUNDLE_PATH)  # ahead of anything installed: the bundled code is the code that runs
import common  # noqa: E402  (sets TF_USE_LEGACY_KERAS before tensorflow is imported)

print("[bundle] " + BUNDLE_SHA256[:16] + ": common from " + os.path.dirname(os.path.dirname(common.__file__)),
      flush=True)
config_path = os.path.join(tempfile.gettempdir(), "tpu2gpu-" + BUNDLE_SHA256[:16] + "-{kernel}.json")
with open(config_path, "w") as f:
    json.dump(CONFIG, f)
# Kaggle's own argv (e.g. ipykernel's -f) is not ours to parse: the entry point reads the config file.
{start}
'''


# How each kernel starts. Training: through the launcher (standard library only until then), since its runtime needs
# come before the entry point is imported: on a TPU image without a TPU build, the TPU stack is installed and the
# kernel runs again (run_kernel). Inference: TensorFlow alone, whichever build the GPU image holds. Either runs under
# core's run_entry, which ends a user's error with one line and exit code 2, and ends the process once its outputs
# are written without finalizing the interpreter (common/core/process.py says why).
START = {
    "train": """from common.core.errors import run_entry  # noqa: E402
from common.launch.kernel import run_kernel  # noqa: E402
run_entry("train", run_kernel, "train", "{entry}", config_path, BUNDLE_PATH)""",
    "infer": """from common.core.errors import run_entry  # noqa: E402
from {entry} import main  # noqa: E402
run_entry("infer", main, ["--config", config_path])""",
}


def build_script(cfg: Config, kernel: str) -> str:
    package, entry = KERNELS[kernel]
    carried = VENDORED.get(cfg.model.backbone, ()) if kernel == "train" else ()
    roots = tuple(vendored_roots(cfg)) if carried else ()
    data = bundle_zip(["common", package, *carried], LEFT_OUT[kernel], roots)
    encoded = base64.b64encode(data).decode()
    chunks = "\n".join(f'    "{encoded[i : i + 100]}"' for i in range(0, len(encoded), 100))
    config = json.dumps(kernel_config(cfg, kernel), indent=1)
    note = {
        "train": " (on a TPU image without a TPU build of TensorFlow it installs the TPU stack first: see\n"
        "common/launch/tpu_stack.py in the bundle)",
        "infer": " (the TPU launcher and training, common/launch and common/training, left out)",
    }[kernel]
    return SCRIPT.format(
        kernel=kernel,
        sha=hashlib.sha256(data).hexdigest(),
        packages=["common", package, *carried],
        config=config,
        chunks=chunks,
        start=START[kernel].format(entry=entry),
        note=note,
    )


def write_kernel(cfg: Config, kernel: str, folder: Path) -> None:
    """Kernel `kernel` ('train' or 'infer') of cfg, script and checked kernel-metadata.json, into the empty folder."""
    meta = _fill(json.loads((TEMPLATES / f"{kernel}.json").read_text()), template_values(cfg))
    (folder / meta["code_file"]).write_text(build_script(cfg, kernel))
    validate_kernel_metadata(meta, folder, inference=kernel == "infer", code_competition=cfg.kaggle.code_competition)
    (folder / "kernel-metadata.json").write_text(json.dumps(meta, indent=2) + "\n")


def _refuse_unreachable(cfg: Config, out: Path, demo: bool) -> None:
    problems = unreachable(cfg)
    if problems and not demo:
        raise MetadataError("the training kernel could not run on Kaggle:\n- " + "\n- ".join(problems))
    if problems:
        print(
            f"[build] demo build in {out}: for reading, not for pushing; on Kaggle it would stop because\n- "
            + "\n- ".join(problems),
            flush=True,
        )


def build(cfg: Config, out_dir: str | Path, demo: bool = False) -> dict[str, Path]:
    """Write and check every kernel folder and the dataset metadata; returns {'train' (or 'train-p1', ... for
    kaggle.train_parts), 'infer', 'dataset'}. Built in a hidden folder and swapped in whole: a failed check leaves
    the previous build as it was. demo=True (the offline demo) builds what cannot run on Kaggle, saying so, instead of
    refusing it."""
    out = Path(out_dir)
    trainers = training_kernels(cfg)
    for trainer in trainers:
        _refuse_unreachable(trainer.cfg, out, demo)
        last = f"{trainer.cfg.kaggle.train_kernel}-{cfg.kaggle.max_links}"  # its chain's last link (tpu2gpu continue)
        if cfg.kaggle.max_links > 1 and len(last) > 50:
            raise MetadataError(
                f"kaggle.train_kernel: the chain's link {cfg.kaggle.max_links} would be {last!r}, over Kaggle's 50 "
                "characters. Fix: a shorter kaggle.train_kernel, or a smaller kaggle.max_links"
            )
    with staged_dir(out, overwrite=True) as tmp:
        for trainer in trainers:
            (tmp / trainer.folder).mkdir()
            write_kernel(trainer.cfg, "train", tmp / trainer.folder)
        (tmp / "infer").mkdir()
        write_kernel(cfg, "infer", tmp / "infer")
        dataset = _fill(json.loads((TEMPLATES / "dataset.json").read_text()), template_values(cfg))
        validate_dataset_metadata(dataset)
        (tmp / "dataset").mkdir()
        (tmp / "dataset" / "dataset-metadata.json").write_text(json.dumps(dataset, indent=2) + "\n")
    return {name: out / name for name in (*(t.folder for t in trainers), "infer", "dataset")}


def rebuild_training_kernel(cfg: Config, folder: Path) -> Path:
    """One training kernel's folder written again (a chain's next link), the rest of the build left as it is."""
    _refuse_unreachable(cfg, folder, demo=False)
    with staged_dir(folder, overwrite=True) as tmp:
        write_kernel(cfg, "train", tmp)
    return folder
