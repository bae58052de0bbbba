"""The images of a conversion (common/data/conversion.py): each checked once, in parallel, before anything is written,
the bad ones reported together or left out and listed in bad_images.csv, and the good ones prepared for the records
(their own bytes, or converted to RGB, resized and re-encoded).

    facts, bad = check_images({"train": samples, "test": test_samples}, cfg.data, pool)
    image_bytes, fmt = prepare_image(path, facts[path], cfg.data.convert_size, cfg.data.reencode)
"""

from __future__ import annotations

import csv
import io
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common.core.errors import DataError
from common.data.samples import IMAGE_SUFFIXES, Sample

BAD_IMAGES_NAME = "bad_images.csv"


@dataclass(frozen=True)
class ImageFacts:
    """A usable image: its file format (jpeg | png | another Pillow reads) and 'WxH MODE'."""

    format: str
    geometry: str


@dataclass(frozen=True)
class BadImage:
    split: str  # train | test
    source: str  # "train.csv line 7"
    id: str
    path: str
    problem: str

    def line(self) -> str:
        return f"{self.source} (id '{self.id}'): {self.problem}"


class ImageProblem(Exception):
    """Why an image cannot be converted (the message becomes BadImage.problem)."""


def progress(label: str, done: int, total: int, previous: int) -> None:
    """One updating line in a terminal; in a Kaggle log (not a terminal) a line per quarter."""
    if sys.stderr.isatty():
        print(
            f"\r[tfrecords] {label}: {done}/{total} images",
            end="\n" if done == total else "",
            file=sys.stderr,
            flush=True,
        )
    elif done == total or done * 4 // total > previous * 4 // total:
        print(f"[tfrecords] {label}: {done}/{total} images", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------------ check
def inspect_image(path: Path, stored_as_is: bool) -> ImageFacts:
    """Decode the whole image (a truncated file fails only here) and check it can be stored: as it is (JPEG or PNG,
    which TensorFlow decodes to RGB in every colour mode Pillow writes) or converted to RGB."""
    from PIL import Image, UnidentifiedImageError

    try:
        if path.stat().st_size == 0:
            raise ImageProblem(f"{path} is empty (0 bytes)")
        with Image.open(path) as img:
            img.load()
            facts = ImageFacts((img.format or "unknown").lower(), f"{img.width}x{img.height} {img.mode}")
            if stored_as_is and facts.format not in ("jpeg", "png"):
                raise ImageProblem(
                    f"{path} is a {img.format} image; records store JPEG or PNG as they are. Fix: "
                    "--set data.reencode=jpeg converts every image"
                )
            if not stored_as_is:
                try:
                    img.convert("RGB")
                except ValueError as err:
                    raise ImageProblem(f"{path}: its {img.mode} pixels cannot be converted to RGB ({err})") from err
            return facts
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:  # a vanished file is an OSError too
        raise ImageProblem(f"{path} is not a readable image ({type(err).__name__}: {err})") from err


def check_images(
    samples: dict[str, list[Sample]], data_cfg, pool: ThreadPoolExecutor
) -> tuple[dict[Path, ImageFacts], list[BadImage]]:
    """Every sample's image checked once, in parallel ({split: samples}): the facts of the good ones by path, and
    the bad ones (no file, empty, unreadable, not storable) with the CSV line and id that name them."""
    stored_as_is = data_cfg.convert_size <= 0 and data_cfg.reencode == "keep"
    folders = {"train": data_cfg.train_images, "test": data_cfg.test_images}

    def check(sample: Sample) -> ImageFacts | str:
        if sample.path is None:
            return "no image file"
        try:
            return inspect_image(sample.path, stored_as_is)
        except ImageProblem as problem:
            return str(problem)

    facts, bad = {}, []
    for split, split_samples in samples.items():
        done = 0
        for sample, result in zip(split_samples, pool.map(check, split_samples), strict=True):
            if isinstance(result, ImageFacts):
                facts[sample.path] = result
            else:
                missing = result == "no image file"
                problem = (
                    f"no image {sample.id}[{'|'.join(IMAGE_SUFFIXES)}] in {folders[split]}/" if missing else result
                )
                bad.append(BadImage(split, sample.source, sample.id, str(sample.path or ""), problem))
            progress(f"checking {split} images", done + 1, len(split_samples), done)
            done += 1
    return facts, bad


# ------------------------------------------------------------------------------------------------------ bad images
def bad_images_message(bad: list[BadImage], shown: int = 30) -> str:
    lines = [f"  {b.line()}" for b in bad[:shown]]
    if len(bad) > shown:
        lines.append(f"  ... and {len(bad) - shown} more")
    counts = Counter(b.split for b in bad)
    return (
        f"{len(bad)} bad image(s) ({', '.join(f'{n} {split}' for split, n in counts.items())}), found in one "
        "pass; nothing was written:\n" + "\n".join(lines) + "\nFix: replace or remove them (and their CSV rows), "
        "or --set data.on_bad_image=skip to convert without them (they are listed in " + BAD_IMAGES_NAME + ")"
    )


def without_bad_images(
    samples: list[Sample],
    test_samples: list[Sample],
    facts: dict[Path, ImageFacts],
    bad: list[BadImage],
    on_bad_image: str,
    out_dir: Path,
) -> tuple[list[Sample], list[Sample]]:
    """The samples whose images are good. data.on_bad_image=error: any bad image stops the conversion, all of them
    named; skip: they are left out, and said so."""
    if bad and on_bad_image == "error":
        raise DataError(bad_images_message(bad))
    samples = [s for s in samples if s.path in facts]
    test_samples = [s for s in test_samples if s.path in facts]
    if not samples:
        raise DataError(
            f"every one of the {sum(b.split == 'train' for b in bad)} training images is bad, e.g. {bad[0].line()}"
        )
    if bad:
        print(
            f"[tfrecords] skipping {len(bad)} bad image(s) (data.on_bad_image=skip; listed in "
            f"{out_dir / BAD_IMAGES_NAME}):\n"
            + "\n".join(f"  {b.line()}" for b in bad[:10])
            + (f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else "")
            + (
                "\n  the test records lack the skipped test images: predict those from the images themselves"
                if any(b.split == "test" for b in bad)
                else ""
            ),
            file=sys.stderr,
            flush=True,
        )
    return samples, test_samples


def write_bad_images(path: Path, bad: list[BadImage]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["split", "source", "id", "path", "problem"])
        writer.writerows([b.split, b.source, b.id, b.path, b.problem] for b in bad)


def skipped_summary(bad: list[BadImage]) -> dict:
    """The manifest's account of the images left out."""
    return {
        "count": len(bad),
        "file": BAD_IMAGES_NAME if bad else None,
        "by_split": dict(Counter(b.split for b in bad)),
    }


# --------------------------------------------------------------------------------------------------------- prepare
def prepare_image(
    path: Path, facts: ImageFacts, convert_size: int = 0, reencode: str = "keep", jpeg_quality: int = 95
) -> tuple[bytes, str]:
    """(bytes to store, their format) for a checked image: its own bytes, or converted to RGB, resized, re-encoded."""
    from PIL import Image

    if convert_size <= 0 and reencode == "keep":
        return path.read_bytes(), facts.format
    with Image.open(path) as img:
        img = img.convert("RGB")
        if convert_size > 0:
            img = img.resize((convert_size, convert_size), Image.BICUBIC)
        target = "png" if reencode == "png" else "jpeg"
        out = io.BytesIO()
        img.save(out, format=target.upper(), **({"quality": jpeg_quality} if target == "jpeg" else {}))
        return out.getvalue(), target


def source_images(geometries: set[str], max_sizes: int = 8) -> dict:
    """What the training images looked like before conversion: their colour modes, and their sizes unless varied.
    Inference compares test images with this: a model trained on 512x512 RGB scans should not silently get 256x256
    grayscale ones."""
    sizes = sorted({g.split()[0] for g in geometries})
    return {"modes": sorted({g.split()[1] for g in geometries}), "sizes": sizes if len(sizes) <= max_sizes else None}
