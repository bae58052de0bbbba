"""From a dataset name or a path to a location TensorFlow can read, and private-dataset credentials.

    resolve_data_path("gs://bucket/tfrec")       -> unchanged
    resolve_data_path("./data/tfrec")            -> the absolute local path
    resolve_data_path("owner/flowers-tfrec")     -> /kaggle/input/flowers-tfrec, or
                                                    /kaggle/input/datasets/owner/flowers-tfrec (newer mount layout)
    resolve_data_path("flowers", needs_gcs=True) -> KaggleDatasets().get_gcs_path("flowers")   (old TPU Node)

TPU2GPU_KAGGLE_ROOT moves /kaggle (input/ and working/ below it), so tests and local runs simulate a kernel.
Credentials are handed from kaggle_secrets to TensorFlow and never printed, logged or written anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from common.core.errors import ConfigError, DataPathError
from common.core.gcs import Mirror, is_gcs

KAGGLE_ROOT_ENV = "TPU2GPU_KAGGLE_ROOT"
_MOUNT_KINDS = ("datasets", "competitions", "models", "notebooks")  # notebooks: a kernel's output (kernel_sources)
_MAX_MOUNT_DEPTH = 6  # models/<owner>/<model>/<framework>/<variation>/<version>


def kaggle_root() -> Path:
    return Path(os.environ.get(KAGGLE_ROOT_ENV, "/kaggle"))


def kaggle_input_dir() -> Path:
    return kaggle_root() / "input"


def kaggle_working_dir() -> Path:
    return kaggle_root() / "working"


def local_folder(value: str, key: str, what: str) -> Path:
    """The local folder `value` (what `key` names: `what`). A gs:// (or any scheme://) URL is refused by name, never
    made into a Path: pathlib turns 'gs://b/x' into a local folder 'gs:/b/x', and an output would stay on this disk."""
    if "://" in str(value):
        raise DataPathError(
            f"{key}={value!r} is a URL, and {what} can only be a local folder for now (pathlib would "
            f"make it the local folder '{Path(str(value))}'). Fix: a local folder; copy it to or from "
            "the bucket with `gcloud storage cp -r`"
        )
    return Path(value)


def folders_holding(root: Path, name: str, max_depth: int = 6) -> list[Path]:
    """The folders under root (root included, at most max_depth deep) that hold a file `name`, in sorted order; none
    looked for below one that does (an attached dataset's export, or blend, and what it carries)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if name in filenames:
            found.append(here)
            dirnames.clear()
        elif len(here.relative_to(root).parts) >= max_depth:
            dirnames.clear()
        dirnames.sort()
    return found


def local_copy(url: str, role: str) -> Path:
    """Where a bucket folder is worked on (role "output") or read ("input") here: /kaggle/temp/gcs/<role>/<bucket>/
    <path> in a Kaggle kernel (kept out of the kernel's output), else runs/gcs/<role>/<bucket>/<path>."""
    from common.core.platform import detect_platform

    base = kaggle_root() / "temp" if detect_platform().on_kaggle else Path("runs")
    return base / "gcs" / role / url[len("gs://") :].strip("/")


def output_dir(configured: str, local_default: str, bucket_ok: bool = False) -> Path:
    """runtime.output_dir, else /kaggle/working in a Kaggle kernel, else local_default (e.g. runs/train). With
    bucket_ok, a gs:// output is worked on in its local copy (common/core/gcs.py pushes it)."""
    from common.core.platform import detect_platform

    if bucket_ok and is_gcs(configured):
        return local_copy(configured, "output")
    if configured:
        return local_folder(configured, "runtime.output_dir", "the output")
    return kaggle_working_dir() if detect_platform().on_kaggle else Path(local_default)


def scratch_dir(configured: str, output: Path) -> Path:
    """runtime.scratch_dir, else /kaggle/temp in a Kaggle kernel (kept out of the kernel's output, which is what
    /kaggle/working becomes), else the output folder itself."""
    from common.core.platform import detect_platform

    if configured:
        return local_folder(configured, "runtime.scratch_dir", "the scratch folder")
    return kaggle_root() / "temp" if detect_platform().on_kaggle else Path(output)


COMPILE_CACHE_ENV = "TPU2GPU_COMPILE_CACHE"  # one folder for every run on this machine (the test suite sets it)


def compile_cache_dir(runtime) -> Path | None:
    """Where the routes that compile keep their programs: runtime.compile_cache (a local folder; off: nowhere), else
    $TPU2GPU_COMPILE_CACHE, else compile-cache/ in the scratch folder (/kaggle/temp on Kaggle, else the output folder;
    for a gs:// output its local copy, and the cache is not pushed: it serves this machine)."""
    configured = runtime.compile_cache or os.environ.get(COMPILE_CACHE_ENV, "")
    if configured == "off":
        return None
    if configured.lower() in ("no", "none", "false", "disable", "disabled", "0"):  # meant as off, read as a folder
        raise ConfigError(
            f"runtime.compile_cache={configured!r} would be a folder named {configured!r}. Fix: "
            f"runtime.compile_cache=off to compile without a cache, or ./{configured} for that folder"
        )
    if configured:
        return local_folder(configured, "runtime.compile_cache", "the compile cache")
    out = output_dir(runtime.output_dir, "runs/train", bucket_ok=True)
    return scratch_dir(runtime.scratch_dir, out) / "compile-cache"


@dataclass(frozen=True)
class TrainingFolders:
    """Where the training kernel writes: out (the exports; for a gs:// output, its local copy), scratch (records
    converted in-kernel) and work (checkpoints: in out when the output is a bucket, so that they reach it too), and
    the mirror that pushes out to the bucket (process 0's alone; a local output has nothing to push)."""

    out: Path
    scratch: Path
    work: Path
    mirror: Mirror


def training_folders(runtime, hosts) -> TrainingFolders:
    out = output_dir(runtime.output_dir, "runs/train", bucket_ok=True)
    scratch = scratch_dir(runtime.scratch_dir, out)
    bucket = is_gcs(runtime.output_dir)
    work = out if bucket else scratch
    if not hosts.writer:  # its own folders, were they shared
        scratch, work = scratch / f"process{hosts.index}", work / f"process{hosts.index}"
    return TrainingFolders(out, scratch, work, Mirror(runtime.output_dir if bucket and hosts.writer else "", out))


def mounted(input_dir: Path) -> list[str]:
    """What is attached, for error messages: 'slug' (old layout) or 'datasets/owner/slug' (new layout)."""
    if not input_dir.is_dir():
        return []
    found = []
    for child in sorted(input_dir.iterdir()):
        if child.name in _MOUNT_KINDS:
            pattern = "*" if child.name == "competitions" else "*/*"
            found += [str(p.relative_to(input_dir)) for p in sorted(child.glob(pattern)) if p.is_dir()]
        elif child.is_dir():
            found.append(child.name)
    return found


def find_kaggle_mount(name: str, kinds: tuple[str, ...] = _MOUNT_KINDS) -> Path | None:
    """Find an attached input by 'slug', 'owner/slug' or a model handle 'owner/model/framework/variation/version'.

    Both mount layouts are searched: /kaggle/input/<slug> (models: <model>/<framework>/<variation>/<version>) and
    /kaggle/input/{datasets,competitions,models,notebooks}/<owner>/..., the newer one among `kinds` only (a kernel's
    output: ("notebooks",)). Names compare case-insensitively (TensorFlow2 is mounted as tensorflow2)."""
    input_dir = kaggle_input_dir()
    parts = tuple(p.lower() for p in name.strip("/").split("/") if p)
    if not parts or not input_dir.is_dir():
        return None
    matches: list[Path] = []
    for k in range(len(parts), 0, -1):  # old layout: the longest tail of the name that is mounted
        legacy = input_dir.joinpath(*parts[len(parts) - k :])
        if legacy.is_dir() and parts[len(parts) - k] not in _MOUNT_KINDS:
            matches.append(legacy)
            break
    for kind in kinds:
        base = input_dir / kind
        if not base.is_dir():
            continue
        for dirpath, dirnames, _ in os.walk(base, followlinks=True):  # an input may be a symlink; depth is capped
            relative = tuple(p.lower() for p in Path(dirpath).relative_to(base).parts)
            if relative and relative[-len(parts) :] == parts:
                matches.append(Path(dirpath))
                dirnames.clear()  # a match's own sub-folders are its content, not other mounts
            elif len(relative) >= _MAX_MOUNT_DEPTH:
                dirnames.clear()
    if len(matches) > 1:
        listing = ", ".join(str(m) for m in matches)
        raise DataPathError(
            f"'{name}' matches several attached inputs ({listing}); name it as owner/slug or give the path"
        )
    return matches[0] if matches else None


def resolve_hub_handle(handle: str) -> str:
    """A local directory for a TF Hub / Kaggle Models handle when the model is attached, else the handle itself.

    'https://www.kaggle.com/models/google/efficientnet-v2/TensorFlow2/<variation>/1' and the bare
    'google/efficientnet-v2/tensorflow2/<variation>/1' both find an attached model, so a kernel with the internet off
    loads it from /kaggle/input instead of trying to download it."""
    if Path(handle).expanduser().exists():
        return str(Path(handle).expanduser().resolve())
    models_url = "https://www.kaggle.com/models/"
    bare = handle[len(models_url) :] if handle.startswith(models_url) else handle
    if "://" not in bare and len(bare.strip("/").split("/")) == 5:
        mount = find_kaggle_mount(bare)
        if mount is not None:
            return str(mount)
    return handle


def resolve_input_path(value: str) -> str:
    """A file or folder the training kernel loads (a .keras backbone, a weights file, a KerasHub preset): a
    '/kaggle/...' path under this kernel's Kaggle root, an attached Kaggle Models handle to its mount, else as given."""
    if value.startswith("/kaggle/"):
        return str(kaggle_root() / value[len("/kaggle/") :])
    return resolve_hub_handle(value) if "/" in value else value


def set_private_credentials() -> None:
    """Let TensorFlow read a private dataset from GCS with the kernel's own gcloud credential.

    Needs the kernel's Google Cloud SDK add-on (Add-ons > Google Cloud Services). The credential goes straight from
    kaggle_secrets to TensorFlow: it is held in no variable that outlives this call and is never printed."""
    try:
        from kaggle_secrets import UserSecretsClient
    except ImportError as err:
        raise DataPathError(
            "runtime.private_dataset=true needs kaggle_secrets, which exists only inside a Kaggle kernel. Fix: run it "
            "on Kaggle, or download the data and pass a local path in runtime.tfrecords"
        ) from err
    secrets = UserSecretsClient()
    secrets.set_tensorflow_credential(secrets.get_gcloud_credential())
    print("[paths] private dataset: gcloud credential handed to TensorFlow (not shown)")


def gcs_path(name: str, private: bool = False) -> str:
    """The gs:// location Kaggle serves an attached dataset from (KaggleDatasets needs the kernel's datasets)."""
    try:
        from kaggle_datasets import KaggleDatasets
    except ImportError as err:
        raise DataPathError(
            f"'{name}' needs a GCS path, and kaggle_datasets exists only inside a Kaggle kernel. "
            "Fix: pass a gs:// URL or a local path"
        ) from err
    if private:
        set_private_credentials()
    slug = name.strip("/").split("/")[-1]
    return KaggleDatasets().get_gcs_path(slug)


def resolve_data_path(name_or_path: str, *, needs_gcs: bool = False, private: bool = False) -> str:
    """A readable location for a dataset: gs:// URL, local path, or an attached Kaggle input (see module doc)."""
    if not name_or_path:
        raise DataPathError(
            "no dataset given. Fix: set runtime.tfrecords (or runtime.competition_dir) to a path, "
            "a gs:// URL or the name of an attached Kaggle dataset"
        )
    if name_or_path.startswith("gs://"):
        if private:
            set_private_credentials()
        return name_or_path
    local = Path(name_or_path).expanduser()
    if local.exists():
        return str(local.resolve())
    if needs_gcs:
        return gcs_path(name_or_path, private=private)
    mount = find_kaggle_mount(name_or_path)
    if mount is not None:
        return str(mount)
    attached = mounted(kaggle_input_dir())
    raise DataPathError(
        f"'{name_or_path}' is neither a local path nor an attached Kaggle input; {kaggle_input_dir()} holds "
        f"{attached or 'nothing'}. Fix: attach it (dataset_sources / competition_sources in kernel-metadata.json, "
        "or Add Input in the editor), or pass a path or gs:// URL"
    )
