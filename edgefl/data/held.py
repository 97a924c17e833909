"""Readers for data a device holds itself: the samples a phone or a board trains on and never sends.

The federation's task says what inputs and classes it expects (:class:`DataSpec`);
:func:`load_held_data` reads what the device has (an image folder with one sub-folder per class,
IDX files, a CSV or Parquet table, an ``.npz`` or ``.safetensors`` file with ``x`` and ``y``, or the
owner's own loader function) into model inputs of exactly the task's shape, labels in the task's
class order. What had to be adapted (resized, converted to the task's channels) is listed in
:attr:`HeldData.notes`; what cannot be (a class the task lacks, a cell that is not a number, a file
that does not decode) is a :class:`DataError` naming the file, row or label, never a silently
smaller data set. Nothing is unpickled (docs/your-data.md).
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import importlib.util
import os
import re
import struct
import sys
import zipfile
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from edgefl.data.datasets import FILES, file_name_variants
from edgefl.data.idx import read_idx
from edgefl.errors import DataError, EdgeflError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
#: Pillow decoders tried on an image file (whatever its suffix): no other parser sees the bytes
_PIL_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "WEBP")
#: modes that 8-bit L/RGB would clip, not convert (16-bit and float images)
_WIDE_MODES = ("I", "F", "I;16", "I;16L", "I;16B", "I;16N")
FILE_FORMATS = {".csv": "csv", ".parquet": "parquet", ".npz": "npz", ".safetensors": "safetensors"}
MAX_CLASS_NAME = 200
MAX_COLUMNS = 100_000
_SHOWN = 5  # unknown labels named in an error before "and N more"
_LABEL = {"imagefolder": "ImageFolder", "idx": "IDX", "csv": "CSV", "parquet": "Parquet", "npz": "npz", "safetensors": "safetensors", "loader": "loader"}
_FORMATS_HINT = ("a device's data is a folder with one sub-folder per class (images inside), a folder of IDX files "
                 "(train-images-idx3-ubyte, train-labels-idx1-ubyte), a .csv or .parquet table, an .npz or .safetensors "
                 "file with x and y, or your own loader (package.module:function); see docs/your-data.md")


@dataclass(frozen=True)
class DataSpec:
    """What the federation's task says about a device's samples."""

    kind: Literal["image", "tabular"]
    class_names: tuple[str, ...]  # label order of the federation
    input_shape: tuple[int, ...]  # (C, H, W) for images, (F,) for tabular
    pixel_divisor: float | None = 255.0  # images: model input = pixels / divisor (8-bit images -> [0, 1])
    mean: tuple[float, ...] | None = None  # tabular: standardisation (x - mean) / std, per feature, when given
    std: tuple[float, ...] | None = None
    feature_names: tuple[str, ...] | None = None  # tabular: the columns expected, in order (None: any F numeric columns besides the label)
    label_column: str = "label"  # tabular tables
    resize: bool = True  # images of another size: resized (True) or refused (False)


@dataclass
class HeldData:
    """A device's own samples as the task's models take them."""

    x: torch.Tensor  # float32 model inputs, shape [N, *input_shape]
    y: torch.Tensor  # int64 labels in the task's class order
    source: str  # e.g. "ImageFolder /data/photos (3 classes, 412 images)"
    format: str  # "imagefolder" | "idx" | "csv" | "parquet" | "npz" | "safetensors" | "loader"
    notes: list[str]  # what was adapted, e.g. "resized 12 images from 32x32 to 28x28", "converted RGB to 1 channel"

    def class_counts(self, num_classes: int) -> list[int]:
        """Samples per class index, 0 .. num_classes - 1."""
        if len(self.y) and int(self.y.max()) >= num_classes:
            raise ValueError(f"labels go up to {int(self.y.max())}, more than {num_classes} classes hold")
        return torch.bincount(self.y, minlength=num_classes).tolist()


def load_held_data(path: str | Path, spec: DataSpec, loader: str | None = None, max_samples: int = 5_000_000) -> HeldData:
    """Read the samples this device holds at ``path`` as ``spec`` asks for them.

    The format is detected from ``path`` (:func:`detect_format`) unless ``loader``
    (``"package.module:function"`` or ``"/path/to/file.py:function"``) names the owner's own
    reader, called as ``function(path, spec)`` and returning ``(x, y)``. Raises :class:`DataError`
    for anything that does not fit the task, naming the file, row or label.
    """
    _check_spec(spec)
    path = Path(path).expanduser()
    if loader is not None:
        return _read_with_loader(loader, path, spec, max_samples)
    fmt = detect_format(path)
    return _READERS[fmt](path, spec, max_samples)


def detect_format(path: Path) -> str:
    """Which reader ``path`` needs: "imagefolder", "idx", "csv", "parquet", "npz" or "safetensors"."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist", hint="give the file or folder that holds this device's data")
    if path.is_dir():
        if any(_idx_file(path, stem) for stem in FILES.values()):
            return "idx"
        entries = _visible(path)
        if not entries or any(e.is_dir() for e in entries):
            return "imagefolder"  # an empty folder is an image folder that holds no samples
        if any(e.suffix.lower() in IMAGE_SUFFIXES for e in entries):
            raise DataError(f"{path} holds images but no class sub-folders",
                            hint="put each class's images in a sub-folder named after the class: photos/cat/1.png, photos/dog/2.png")
        tables = [e for e in entries if e.suffix.lower() in FILE_FORMATS]
        if tables:
            raise DataError(f"{path} is a folder of data files, not one data set", hint=f"give the file itself, e.g. {tables[0]}")
        raise DataError(f"{path} holds neither class sub-folders nor IDX files", hint=_FORMATS_HINT)
    fmt = FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        what = f"suffix {path.suffix!r}" if path.suffix else "no suffix"
        hint = _FORMATS_HINT
        if path.suffix.lower() in IMAGE_SUFFIXES:
            hint = "a single image is not a data set: put images in one sub-folder per class and give the folder"
        elif any(path.name in file_name_variants(stem) for stem in FILES.values()):
            hint = "IDX files are read as a folder: give the folder that holds the images and labels files"
        raise DataError(f"{path} is not a data format edgefl reads ({what})", hint=hint)
    return fmt


# ---------------------------------------------------------------------------------------------
# the task's spec


def _check_spec(spec: DataSpec) -> None:
    """A spec that cannot describe any data is the federation's mistake, said as such."""
    problems = []
    dims = 3 if spec.kind == "image" else 1
    if spec.kind not in ("image", "tabular"):
        problems.append(f"kind {spec.kind!r} is neither 'image' nor 'tabular'")
    elif len(spec.input_shape) != dims or any(int(d) < 1 for d in spec.input_shape):
        problems.append(f"input_shape {tuple(spec.input_shape)} is not {'(C, H, W)' if dims == 3 else '(F,)'} of positive sizes")
    if not spec.class_names:
        problems.append("no class names")
    elif len(set(spec.class_names)) != len(spec.class_names):
        problems.append("a class name is given twice")
    if spec.pixel_divisor is not None and not (np.isfinite(spec.pixel_divisor) and spec.pixel_divisor > 0):
        problems.append(f"pixel_divisor {spec.pixel_divisor} is not a positive number")
    features = spec.input_shape[0] if spec.kind == "tabular" and spec.input_shape else None
    for name, values in (("mean", spec.mean), ("std", spec.std), ("feature_names", spec.feature_names)):
        if values is not None and spec.kind != "tabular":
            problems.append(f"{name} is for tabular tasks")
        elif values is not None and len(values) != features:
            problems.append(f"{len(values)} {name} values for {features} features")
    if (spec.mean is None) != (spec.std is None):
        problems.append("mean and std go together")
    if spec.std is not None and not all(np.isfinite(s) and s > 0 for s in spec.std):
        problems.append("a std is not a positive number")
    if spec.feature_names is not None and spec.label_column in spec.feature_names:
        problems.append(f"the label column {spec.label_column!r} is also a feature")
    if problems:
        raise DataError("the task's data spec is inconsistent: " + "; ".join(problems),
                        hint="this comes from the federation's task, not from your data: tell whoever runs the server")


def _require_kind(spec: DataSpec, kind: str, where: Path, what: str) -> None:
    if spec.kind == kind:
        return
    if spec.kind == "tabular":
        raise DataError(f"the task takes tabular samples ({spec.input_shape[0]} features); {where} is {what}",
                        hint="give a .csv or .parquet table, an .npz or .safetensors x of shape [N, F], or your own loader")
    c, h, w = spec.input_shape
    raise DataError(f"the task takes images ({c}x{h}x{w}); {where} is {what}, which is read for tabular tasks only",
                    hint="give an image folder (one sub-folder per class), IDX files or an .npz with x [N, H, W] and y, "
                         "or read your table with your own loader (docs/your-data.md)")


# ---------------------------------------------------------------------------------------------
# labels and class names


def _slug(name: str) -> str:
    """``T-shirt/top`` -> ``t-shirt-top``: what a folder can be called when a class name cannot."""
    return re.sub(r"[\W_]+", "-", name.casefold()).strip("-")


class _Classes:
    """Matches a label to a class: its exact name, its slug, or its index as a decimal integer."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(str(n) for n in names)
        self.exact = {n: i for i, n in enumerate(self.names)}
        slugs = Counter(_slug(n) for n in self.names)
        # two classes with one slug (a/b, a b) can be told apart only by their exact names
        self.slugs = {_slug(n): i for i, n in enumerate(self.names) if slugs[_slug(n)] == 1 and _slug(n)}

    def index_of(self, label: str) -> int | None:
        if label in self.exact:
            return self.exact[label]
        slug = _slug(label)
        if slug in self.slugs:
            return self.slugs[slug]
        text = label.strip()
        if re.fullmatch(r"[0-9]{1,9}", text) and int(text) < len(self.names):
            return int(text)
        return None

    def listing(self) -> str:
        return _listing(self.names, 20)


def _listing(items: Sequence[Any], limit: int = 10) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _unknown_labels(unknown: list[Any], classes: _Classes, where: str, what: str, fix: str) -> DataError:
    shown = ", ".join(repr(str(u)) if isinstance(u, str) else str(u) for u in unknown[:_SHOWN])
    more = f" and {len(unknown) - _SHOWN} more" if len(unknown) > _SHOWN else ""
    return DataError(f"{where} holds {what} the federation's task does not know: {shown}{more} (the task's classes: {classes.listing()})",
                     hint=f"this device cannot take part with a class the task lacks: {fix}; a label matches a class by its exact name, "
                          "by the name with '-' for other characters (t-shirt-top for T-shirt/top), or by the class index (0, 1, ...)")


def _match_labels(values: Iterable[Any], classes: _Classes, where: str, what: str = "labels",
                  fix: str = "remove those samples or relabel them") -> np.ndarray:
    """Class indices of labels given as names, index strings or integers (memoised: few distinct labels)."""
    memo: dict[Any, int | None] = {}
    unknown: list[Any] = []
    out = []
    for value in values:
        key = (type(value), value)
        try:
            known = key in memo
        except TypeError:  # a list or an array where a label belongs
            raise DataError(f"{where}: a label is a {type(value).__name__}", hint="each label is one class name or class index") from None
        if not known:
            memo[key] = _one_label(value, classes)
            if memo[key] is None:
                unknown.append(value)
        out.append(memo[key])
    if unknown:
        raise _unknown_labels(unknown, classes, where, what, fix)
    return np.asarray(out, dtype=np.int64)


def _one_label(value: Any, classes: _Classes) -> int | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        return classes.index_of(value)
    if isinstance(value, (int, np.integer)) or (isinstance(value, (float, np.floating)) and np.isfinite(value) and value == int(value)):
        return int(value) if 0 <= int(value) < len(classes.names) else None
    return None


def _labels_of(y: np.ndarray, classes: _Classes, where: str) -> np.ndarray:
    """Class indices from a label array: integers (indices), whole floats, or strings (names)."""
    if y.dtype.kind in "iub":
        y = y.astype(np.int64)
        bad = (y < 0) | (y >= len(classes.names))
        if bad.any():
            raise _unknown_labels([int(v) for v in np.unique(y[bad])], classes, where, "labels", "remove those samples or relabel them")
        return y
    if y.dtype.kind in "fUS":
        uniques, inverse = np.unique(y, return_inverse=True)
        return _match_labels(uniques.tolist(), classes, where)[inverse.reshape(-1)]
    if y.dtype.kind == "O":
        return _match_labels(y.tolist(), classes, where)
    raise DataError(f"{where}: y holds {y.dtype} values, not labels", hint="y is one class index (integer) or class name (string) per sample")


# ---------------------------------------------------------------------------------------------
# what every format ends in


def _finish(x: torch.Tensor, y: np.ndarray, spec: DataSpec, fmt: str, where: str, notes: list[str], unit: str, detail: str = "") -> HeldData:
    if tuple(x.shape) != (len(y), *spec.input_shape):
        raise _shape_error(where, tuple(x.shape), spec)
    if spec.kind == "tabular" and spec.mean is not None and spec.std is not None:
        x = (x - torch.tensor(spec.mean, dtype=torch.float32)) / torch.tensor(spec.std, dtype=torch.float32)
        notes.append(f"standardised the {spec.input_shape[0]} features with the task's mean and std")
    labels = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    kinds = len(torch.unique(labels))
    label = _LABEL.get(fmt, fmt)
    source = f"{label} {where} ({detail}{_count(kinds, 'class', 'classes')}, {_count(len(labels), unit[:-1], unit)})"
    return HeldData(x=x.contiguous(), y=labels, source=source, format=fmt, notes=notes)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _shape_error(where: str, shape: tuple[int, ...], spec: DataSpec) -> DataError:
    got = "[" + ", ".join(str(d) for d in shape) + "]"
    want = "[N, " + ", ".join(str(d) for d in spec.input_shape) + "]"
    if spec.kind == "tabular":
        return DataError(f"{where}: the samples have shape {got}, the task takes {want}",
                         hint=f"each sample needs exactly {spec.input_shape[0]} features")
    c, h, w = spec.input_shape
    resizing = "resizing allowed" if spec.resize else "resizing is off (resize=False)"
    fix = "other heights and widths are resized" if spec.resize else f"resize them to {h}x{w} first, or allow resizing"
    return DataError(f"{where}: the samples have shape {got}, the task takes {want} ({resizing})",
                     hint=f"images may be [N, H, W] (one channel), [N, {c}, H, W] or [N, H, W, {c}]; {fix}")


def _check_count(n: int, where: str, max_samples: int, empty_hint: str) -> None:
    if n == 0:
        raise DataError(f"{where} holds no samples", hint=empty_hint)
    if n > max_samples:
        raise DataError(f"{where} holds {n} samples, more than the {max_samples} a device reads", hint="use a subset of your data, or raise max_samples")


# ---------------------------------------------------------------------------------------------
# image folders


def _visible(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError as exc:
        raise DataError(f"cannot read {folder}: {exc.strerror}", hint="check the folder's permissions") from None


def _unreadable(exc: OSError) -> None:
    raise DataError(f"cannot read {exc.filename}: {exc.strerror}", hint="check the folder's permissions: no folder is skipped")


def _files_under(folder: Path) -> list[Path]:
    """Every visible file below ``folder`` (hidden files and folders skipped, links to folders not followed)."""
    found = []
    for top, dirs, files in os.walk(folder, onerror=_unreadable):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(top) / f for f in sorted(files) if not f.startswith(".")]
    return found


def _read_image_folder(root: Path, spec: DataSpec, max_samples: int) -> HeldData:
    _require_kind(spec, "image", root, "an image folder")
    channels, height, width = spec.input_shape
    if channels not in (1, 3):
        raise DataError(f"the task takes {channels}-channel images; image files are read as 1 (grey) or 3 (RGB) channels",
                        hint=f"save the samples as an .npz or .safetensors x of shape [N, {channels}, {height}, {width}], or write a loader")
    classes = _Classes(spec.class_names)
    folders = [p for p in _visible(root) if p.is_dir()]
    for folder in folders:
        if len(folder.name) > MAX_CLASS_NAME:
            raise DataError(f"{root}: a class folder's name is {len(folder.name)} characters long: {folder.name[:40]}...",
                            hint=f"class folders are named after classes (at most {MAX_CLASS_NAME} characters)")
    indices = _match_labels([f.name for f in folders], classes, str(root), "class folders", "remove or rename that folder")
    notes = _shared_folders(folders, indices, classes)
    files: list[tuple[Path, int]] = []
    others: list[Path] = []
    for folder, index in zip(folders, indices):
        for file in _files_under(folder):
            if file.suffix.lower() in IMAGE_SUFFIXES:
                files.append((file, int(index)))
            else:
                others.append(file)
    _check_count(len(files), str(root), max_samples, "put one sub-folder per class with its images in it (photos/cat/1.png)")
    stray = [p for p in _visible(root) if not p.is_dir()]
    if stray:
        notes.append(f"ignored {len(stray)} file(s) outside the class folders, e.g. {stray[0].name}")
    if others:
        notes.append(f"ignored {len(others)} file(s) that are not images ({', '.join(s[1:] for s in IMAGE_SUFFIXES)}), e.g. {others[0].relative_to(root)}")
    pixels = np.empty((len(files), height, width, channels), dtype=np.uint8)
    seen: dict[str, Counter] = {"mode": Counter(), "size": Counter(), "upright": Counter()}
    for i, (file, _) in enumerate(files):
        pixels[i] = _decode(file, spec, seen)
    notes += _image_notes(seen, spec)
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous().float()
    if spec.pixel_divisor is not None:
        x.div_(spec.pixel_divisor)
    y = np.array([index for _, index in files], dtype=np.int64)
    return _finish(x, y, spec, "imagefolder", str(root), notes, "images")


def _shared_folders(folders: list[Path], indices: np.ndarray, classes: _Classes) -> list[str]:
    by_class: dict[int, list[str]] = {}
    for folder, index in zip(folders, indices):
        by_class.setdefault(int(index), []).append(folder.name)
    return [f"folders {', '.join(names)} all hold class {classes.names[i]!r}" for i, names in by_class.items() if len(names) > 1]


def _decode(file: Path, spec: DataSpec, seen: dict[str, Counter]) -> np.ndarray:
    """One image file as [H, W, C] uint8 of the task's size and channels."""
    from PIL import Image, ImageOps  # torchvision's dependency; imported here so `edgefl.data` stays light

    channels, height, width = spec.input_shape
    mode = "L" if channels == 1 else "RGB"
    try:
        with Image.open(file, formats=_PIL_FORMATS) as opened:
            opened.load()  # decode now: a truncated file fails here, with its name
            img = opened
            if img.mode in _WIDE_MODES:
                raise DataError(f"{file} is a {img.mode} (16-bit or float) image; image files are read as 8-bit pixels",
                                hint="save it as an 8-bit PNG or JPEG, or give the samples as an .npz with float x")
            if img.getexif().get(0x0112, 1) not in (1, None):  # EXIF orientation: a phone's portrait photo
                img = ImageOps.exif_transpose(img)
                seen["upright"][""] += 1
            if img.mode != mode:
                seen["mode"][img.mode] += 1
                img = img.convert(mode)
            if img.size != (width, height):
                if not spec.resize:
                    raise DataError(f"{file} is {img.size[0]}x{img.size[1]} pixels; the task takes {width}x{height} (width x height) "
                                    "and resizing is off (resize=False)", hint=f"resize your images to {width}x{height} first, or allow resizing")
                seen["size"][f"{img.size[0]}x{img.size[1]}"] += 1
                img = img.resize((width, height), Image.Resampling.BILINEAR)
            return np.asarray(img, dtype=np.uint8).reshape(height, width, channels)
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, Image.DecompressionBombError) as exc:
        raise DataError(f"{file} does not decode as an image: {exc}",
                        hint="replace or delete that file: every file in a class folder is read, none is skipped") from None


def _image_notes(seen: dict[str, Counter], spec: DataSpec) -> list[str]:
    channels, height, width = spec.input_shape
    target = "1 channel" if channels == 1 else "3 channels"
    notes = [f"converted {n} image(s) from {mode} to {target}" for mode, n in sorted(seen["mode"].items())]
    sizes = seen["size"]
    if len(sizes) == 1:
        (size, n), = sizes.items()
        notes.append(f"resized {n} image(s) from {size} to {width}x{height}")
    elif sizes:
        common = ", ".join(f"{s} ({n})" for s, n in sizes.most_common(3))
        notes.append(f"resized {sum(sizes.values())} images of {len(sizes)} sizes to {width}x{height}: {common}" + (", ..." if len(sizes) > 3 else ""))
    if seen["upright"]:
        notes.append(f"turned {seen['upright']['']} image(s) upright by their EXIF orientation")
    return notes


# ---------------------------------------------------------------------------------------------
# arrays: IDX, npz, safetensors and loaders


def _idx_file(folder: Path, stem: str) -> Path | None:
    for name in file_name_variants(stem):
        if (folder / name).is_file():
            return folder / name
    return None


def _read_idx_folder(folder: Path, spec: DataSpec, max_samples: int) -> HeldData:
    pairs = []
    for split, images, labels in (("train", "train_images", "train_labels"), ("t10k", "test_images", "test_labels")):
        image_file, label_file = _idx_file(folder, FILES[images]), _idx_file(folder, FILES[labels])
        if image_file and label_file:
            pairs.append((split, image_file, label_file))
        elif image_file or label_file:
            present, missing = (FILES[images], FILES[labels]) if image_file else (FILES[labels], FILES[images])
            raise DataError(f"{folder}: {present} has no {missing} beside it",
                            hint="IDX files come in pairs: train-images with train-labels (and t10k-images with t10k-labels)")
    ys = [read_idx(label_file) for _, _, label_file in pairs]
    for (_, _, label_file), y in zip(pairs, ys):
        if y.ndim != 1:
            raise DataError(f"{label_file} holds an array of shape {y.shape}, not one label per sample",
                            hint="the labels file is [N] class indices (train-labels-idx1-ubyte)")
    _check_count(sum(len(y) for y in ys), str(folder), max_samples, "the IDX labels files are empty")
    xs = [read_idx(image_file) for _, image_file, _ in pairs]
    for (_, image_file, label_file), x, y in zip(pairs, xs, ys):
        if len(x) != len(y):
            raise DataError(f"{image_file} holds {len(x)} samples, {label_file} {len(y)} labels", hint="the two files come from different data sets")
    if len(xs) == 2 and xs[0].shape[1:] != xs[1].shape[1:]:
        raise DataError(f"{folder}: the train samples are {xs[0].shape[1:]}, the t10k ones {xs[1].shape[1:]}",
                        hint="the files come from different data sets: keep one pair")
    x, y, notes = _from_arrays(np.concatenate(xs), np.concatenate(ys), spec, str(folder), max_samples)
    return _finish(x, y, spec, "idx", str(folder), notes, "samples", detail=" + ".join(split for split, _, _ in pairs) + ", ")


def _read_npz(path: Path, spec: DataSpec, max_samples: int) -> HeldData:
    how = "save it with np.savez(path, x=inputs, y=labels)"
    try:
        if not zipfile.is_zipfile(path):  # np.load would try other formats (pickle among them) and say so
            with path.open("rb") as fh:
                one = fh.read(6) == b"\x93NUMPY"
            raise DataError(f"{path} holds one array (.npy), not x and y" if one else f"{path} is not an .npz file (not a zip archive)", hint=how)
        loaded = np.load(path, allow_pickle=False)  # never pickle: an .npz from elsewhere could run code
        with loaded:
            missing = [k for k in ("x", "y") if k not in loaded.files]
            if missing:
                raise DataError(f"{path} has no array {' or '.join(missing)}: it holds {_listing(loaded.files) or 'none'}", hint=how)
            y = loaded["y"]
            _check_count(len(y) if y.ndim else 0, str(path), max_samples, "save the device's samples in x and their labels in y")
            x = loaded["x"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path} cannot be read as .npz: {exc}", hint=how + " (numbers and strings: object arrays need pickle, never used)") from None
    x, labels, notes = _from_arrays(x, y, spec, str(path), max_samples)
    return _finish(x, labels, spec, "npz", str(path), notes, "samples")


def _read_safetensors(path: Path, spec: DataSpec, max_samples: int) -> HeldData:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as tensors:
            names = list(tensors.keys())
            missing = [k for k in ("x", "y") if k not in names]
            if missing:
                raise DataError(f"{path} has no tensor {' or '.join(missing)}: it holds {_listing(names) or 'none'}",
                                hint="save it with safetensors.torch.save_file({'x': inputs, 'y': labels}, path)")
            shape = tensors.get_slice("y").get_shape()
            _check_count(shape[0] if shape else 0, str(path), max_samples, "save the device's samples in x and their labels in y")
            x, y = tensors.get_tensor("x"), tensors.get_tensor("y")
    except (OSError, SafetensorError) as exc:
        raise DataError(f"{path} cannot be read as .safetensors: {exc}",
                        hint="save it with safetensors.torch.save_file({'x': inputs, 'y': labels}, path)") from None
    x, labels, notes = _from_arrays(x, y, spec, str(path), max_samples)
    return _finish(x, labels, spec, "safetensors", str(path), notes, "samples")


def _as_numpy(value: Any, where: str, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_complex():
            raise DataError(f"{where}: {name} holds complex numbers", hint="inputs are real numbers")
        if value.dtype.is_floating_point and value.dtype not in (torch.float16, torch.float32, torch.float64):
            value = value.float()  # bfloat16 and float8 have no numpy dtype
        return value.numpy()
    if isinstance(value, np.ndarray):
        return value
    if name == "y" and isinstance(value, (list, tuple)):
        return np.asarray(value)
    raise DataError(f"{where}: {name} is a {type(value).__name__}", hint=f"give {name} as a numpy array or a torch tensor")


def _from_arrays(x_in: Any, y_in: Any, spec: DataSpec, where: str, max_samples: int) -> tuple[torch.Tensor, np.ndarray, list[str]]:
    """Model inputs and class indices from an array pair, whatever it came from."""
    x, y = _as_numpy(x_in, where, "x"), _as_numpy(y_in, where, "y")
    if y.ndim != 1:
        raise DataError(f"{where}: y has shape {list(y.shape)}", hint="y holds one label per sample: shape [N]")
    if x.ndim == 0 or len(x) != len(y):
        raise DataError(f"{where}: x holds {len(x) if x.ndim else 0} samples and y {len(y)} labels", hint="x and y hold the same samples, in the same order")
    _check_count(len(y), where, max_samples, "give the device's samples in x and their labels in y")
    if x.dtype.kind not in "iuf":
        raise DataError(f"{where}: x holds {x.dtype} values, not numbers", hint="x holds integer or float numbers")
    labels = _labels_of(y, _Classes(spec.class_names), where)
    if spec.kind == "image":
        inputs, notes = _image_inputs(x, spec, where)
    else:
        inputs, notes = _tabular_inputs(x, spec, where), []
    return inputs, labels, notes


def _image_inputs(x: np.ndarray, spec: DataSpec, where: str) -> tuple[torch.Tensor, list[str]]:
    c, h, w = spec.input_shape
    notes = []
    if x.ndim == 3:
        x = x[:, None]  # [N, H, W]: one channel
    elif x.ndim == 4 and x.shape[1] != c and x.shape[3] == c:
        x = x.transpose(0, 3, 1, 2)
        notes.append("read x as [N, H, W, C] (channels last)")
    if x.ndim != 4 or x.shape[1] != c:
        raise _shape_error(where, tuple(x.shape), spec)
    if x.dtype.kind in "iu":
        low, high = int(x.min()), int(x.max())
        if spec.pixel_divisor is not None and (low < 0 or high > spec.pixel_divisor):
            raise DataError(f"{where}: integer pixels range over {low}..{high}, the task divides them by {spec.pixel_divisor:g}",
                            hint=f"give integer pixels in 0..{spec.pixel_divisor:g}, or float x as the model's inputs")
        inputs = torch.from_numpy(np.array(x, dtype=np.float32))
        if spec.pixel_divisor is not None:
            inputs.div_(spec.pixel_divisor)
            notes.append(f"divided the integer pixels by {spec.pixel_divisor:g}")
    else:
        inputs = torch.from_numpy(np.array(x, dtype=np.float32))  # a copy: a loader's arrays stay its own
        bad = ~torch.isfinite(inputs.reshape(len(inputs), -1)).all(dim=1)
        if bad.any():
            raise DataError(f"{where}: sample {int(bad.nonzero()[0])} of x holds NaN or infinite values", hint="drop or fix that sample")
    if tuple(inputs.shape[2:]) != (h, w):
        if not spec.resize:
            raise _shape_error(where, tuple(inputs.shape), spec)
        notes.append(f"resized {len(inputs)} images from {inputs.shape[3]}x{inputs.shape[2]} to {w}x{h}")
        inputs = _interpolate(inputs, (h, w))
    return inputs, notes


def _interpolate(x: torch.Tensor, size: tuple[int, int], chunk: int = 1024) -> torch.Tensor:
    out = torch.empty((len(x), x.shape[1], *size), dtype=torch.float32)
    for start in range(0, len(x), chunk):  # in chunks: one temporary of a chunk, not of the whole set
        out[start:start + chunk] = F.interpolate(x[start:start + chunk], size=size, mode="bilinear", antialias=True, align_corners=False)
    return out


def _tabular_inputs(x: np.ndarray, spec: DataSpec, where: str, row: Callable[[int], str] | None = None) -> torch.Tensor:
    if x.ndim != 2 or x.shape[1] != spec.input_shape[0]:
        raise _shape_error(where, tuple(x.shape), spec)
    inputs = np.array(x, dtype=np.float32)  # a copy: a loader's arrays stay its own
    bad = ~np.isfinite(inputs)
    if bad.any():
        r, c = (int(v[0]) for v in np.nonzero(bad))
        column = f"column {str(spec.feature_names[c])!r}" if spec.feature_names else f"feature {c}"
        at = row(r) if row else f"sample {r}"
        raise DataError(f"{where}, {at}, {column}: {x[r, c]} is not a finite number",
                        hint="NaN and infinite values cannot be trained on: fill in the value or drop the row")
    return torch.from_numpy(inputs)


def _read_with_loader(loader: str, path: Path, spec: DataSpec, max_samples: int) -> HeldData:
    function = _resolve_loader(loader)
    try:
        result = function(path, spec)
    except EdgeflError:
        raise
    except Exception as exc:  # the owner's code: any failure is theirs to fix, said with its type
        raise DataError(f"loader {loader} failed on {path}: {type(exc).__name__}: {exc}",
                        hint="the error is in your loader function (its traceback is chained to this error)") from exc
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise DataError(f"loader {loader} returned {type(result).__name__}, not (x, y)",
                        hint="return a pair: x as a numpy array or tensor of samples, y as class indices or class names")
    where = f"loader {loader} on {path}"
    x, y, notes = _from_arrays(result[0], result[1], spec, where, max_samples)
    return _finish(x, y, spec, "loader", f"{loader} on {path}", notes, "samples")


def _resolve_loader(loader: str) -> Callable[..., Any]:
    """``package.module:function`` or ``/path/to/file.py:function`` -> the function."""
    target, _, name = loader.rpartition(":")
    shape_hint = "a loader is 'package.module:function' or '/path/to/file.py:function'"
    if not target or not name.isidentifier():
        raise DataError(f"loader {loader!r} does not name a function", hint=shape_hint)
    if target.endswith(".py") or "/" in target or os.sep in target:
        module = _module_from_file(Path(target).expanduser(), loader)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise DataError(f"loader {loader}: cannot import {target}: {type(exc).__name__}: {exc}",
                            hint="install that package or add its folder to PYTHONPATH, or name the file: /path/to/file.py:function") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise DataError(f"loader {loader}: {target} has no function {name!r}", hint=shape_hint)
    return function


def _module_from_file(file: Path, loader: str) -> Any:
    if not file.is_file():
        raise DataError(f"loader {loader}: {file} does not exist", hint="give the path of the Python file that defines the function")
    # one module name per file: loading the same file again replaces it, another file never does
    name = "edgefl_loader_" + hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise DataError(f"loader {loader}: {file} cannot be imported", hint="the loader file is a Python source file (.py)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling-free introspection look modules up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise DataError(f"loader {loader}: importing {file} failed: {type(exc).__name__}: {exc}",
                        hint=f"fix that file (python {file} shows the traceback)") from exc
    return module


# ---------------------------------------------------------------------------------------------
# tables: CSV and Parquet


def _select_columns(columns: list[str], spec: DataSpec, where: str) -> tuple[int, list[int], list[str]]:
    """(label column, feature columns in the task's order, notes) of a table's header."""
    if len(columns) > MAX_COLUMNS:
        raise DataError(f"{where} has {len(columns)} columns, more than {MAX_COLUMNS}", hint="a device's table holds one feature per column")
    label = spec.label_column
    hits = [i for i, c in enumerate(columns) if c == label]
    if len(hits) != 1:
        found = f"has no column {label!r}; its columns: {_listing(columns)}" if not hits else f"has {len(hits)} columns named {label!r}"
        guess = _close(label, [c for c in columns if c not in (spec.feature_names or ())], _LABEL_NAMES)
        raise DataError(f"{where} {found}" + (f" (is {guess!r} it?)" if guess and not hits else ""),
                        hint=f"the task reads each row's class from the column {label!r}: name that column so "
                             "(or the server's data.label_column names yours)")
    features = spec.input_shape[0]
    if spec.feature_names is None:
        chosen = [i for i in range(len(columns)) if i != hits[0]]
        if len(chosen) != features:
            raise DataError(f"{where} has {len(chosen)} feature columns besides {label!r}, the task takes {features}: "
                            f"the samples would be [N, {len(chosen)}], the task takes [N, {features}]",
                            hint=f"keep {label!r} and exactly the task's {features} feature columns")
        return hits[0], chosen, []
    index: dict[str, list[int]] = {}
    for i, c in enumerate(columns):
        index.setdefault(c, []).append(i)
    missing = [f for f in spec.feature_names if f not in index]
    if missing:
        spare = [c for c in columns if c not in spec.feature_names and c != label]
        renames = [(m, g) for m in missing if (g := _close(m, spare))]
        said = f"; rename {_listing([f'{g!r} to {m!r}' for m, g in renames], _SHOWN)}?" if renames else ""
        raise DataError(f"{where} lacks the task's column(s) {_listing([repr(str(m)) for m in missing], _SHOWN)}{said}",
                        hint=f"the task reads these {features} columns by name: {_listing(spec.feature_names)}; add or rename them")
    twice = [f for f in spec.feature_names if len(index[f]) > 1]
    if twice:
        raise DataError(f"{where} has more than one column named {str(twice[0])!r}", hint="rename or remove the extra column")
    chosen = [index[f][0] for f in spec.feature_names]
    used = {hits[0], *chosen}
    extra = [c for i, c in enumerate(columns) if i not in used]
    notes = [f"ignored {len(extra)} column(s) the task does not read: {_listing(extra, _SHOWN)}"] if extra else []
    if chosen != sorted(chosen):
        notes.append("took the feature columns in the task's order")
    return hits[0], chosen, notes


#: what a table's class column is often called instead (scikit-learn's frames call it "target")
_LABEL_NAMES = ("target", "class", "y", "diagnosis", "labels", "Label")


def _close(name: str, columns: Sequence[str], usual: Iterable[str] = ()) -> str | None:
    """The column ``name`` was probably meant to be: a near spelling, else one of the ``usual`` names."""
    import difflib

    near = difflib.get_close_matches(name, list(columns), n=1, cutoff=0.75)
    if near:
        return near[0]
    return next((c for c in columns if c in set(usual)), None)


def _number(text: str, where: str) -> float:
    cell = text.strip()
    if not cell:
        raise DataError(f"{where}: empty cell", hint="every feature needs a number: fill it in or drop the row")
    try:
        return float(cell)
    except ValueError:
        raise DataError(f"{where}: {cell[:40]!r} is not a number", hint="feature cells hold numbers: fix the cell or drop the row") from None


def _delimiter(first_line: str) -> str:
    """',' unless the header is clearly ';'- or tab-separated (spreadsheets in some locales write ';')."""
    counts = {d: first_line.count(d) for d in (",", ";", "\t")}
    best = max(counts, key=lambda d: counts[d])
    return best if counts[best] > counts[","] else ","


def _read_csv(path: Path, spec: DataSpec, max_samples: int) -> HeldData:
    _require_kind(spec, "tabular", path, "a CSV table")
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            delimiter = _delimiter(fh.readline(1 << 20))
            fh.seek(0)
            return _parse_csv(csv.reader(fh, delimiter=delimiter), path, spec, max_samples, delimiter)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})", hint="save the table as UTF-8 CSV") from None
    except csv.Error as exc:
        raise DataError(f"{path} is not a CSV table that can be read: {exc}", hint="save it as a plain CSV: one header row, one row per sample") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None


def _parse_csv(reader: Any, path: Path, spec: DataSpec, max_samples: int, delimiter: str) -> HeldData:
    header = next(reader, None)
    if header is None:
        raise DataError(f"{path} holds no samples", hint="the table is empty: a header row, then one row per sample")
    columns = [c.strip() for c in header]
    label_at, chosen, notes = _select_columns(columns, spec, str(path))
    if delimiter != ",":
        notes.append(f"read as {'tab' if delimiter == chr(9) else repr(delimiter)}-separated")
    values, labels, lines = array("d"), [], array("q")
    rows = 0
    for row in reader:
        if not row:
            continue  # a blank line
        rows += 1
        if rows > max_samples:
            continue  # counted only, to say how many
        at = f"{path}, row {rows} (line {reader.line_num})"
        if len(row) != len(columns):
            raise DataError(f"{at}: {len(row)} cells, the header has {len(columns)}", hint="every row has one cell per column")
        if not row[label_at].strip():
            raise DataError(f"{at}: no label in column {spec.label_column!r}", hint="every row needs its class: fill it in or drop the row")
        labels.append(row[label_at])
        values.extend(_number(row[j], f"{at}, column {columns[j]!r}") for j in chosen)
        lines.append(reader.line_num)
    _check_count(rows, str(path), max_samples, "the table has a header but no rows")
    x = np.frombuffer(values, dtype=np.float64).reshape(rows, len(chosen))
    y = _match_labels(labels, _Classes(spec.class_names), str(path), fix="remove those rows or change their label")
    inputs = _tabular_inputs(x, _with_columns(spec, [columns[j] for j in chosen]), str(path), lambda r: f"row {r + 1} (line {lines[r]})")
    return _finish(inputs, y, spec, "csv", str(path), notes, "rows")


def _with_columns(spec: DataSpec, names: list[str]) -> DataSpec:
    """The spec with the table's feature names, so errors name the column the owner sees."""
    return DataSpec(kind=spec.kind, class_names=spec.class_names, input_shape=spec.input_shape, feature_names=tuple(names),
                    label_column=spec.label_column, resize=spec.resize)


def _read_parquet(path: Path, spec: DataSpec, max_samples: int) -> HeldData:
    _require_kind(spec, "tabular", path, "a Parquet table")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow, which is not installed", hint="pip install pyarrow") from None
    try:
        table_file = pq.ParquetFile(path)
        columns = list(table_file.schema_arrow.names)
        label_at, chosen, notes = _select_columns(columns, spec, str(path))
        _check_count(table_file.metadata.num_rows, str(path), max_samples, "the table has columns but no rows")
        table = table_file.read(columns=[columns[label_at], *(columns[j] for j in chosen)])
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise DataError(f"{path} cannot be read as Parquet: {exc}", hint="write it with pyarrow.parquet.write_table or DataFrame.to_parquet") from None
    rows = table.num_rows
    label_column = table.column(0)
    if label_column.null_count:
        first = int(np.flatnonzero(label_column.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{path}, row {first + 1}: no label in column {spec.label_column!r}", hint="every row needs its class: fill it in or drop the row")
    if pa.types.is_integer(label_column.type):
        raw_labels = label_column.to_numpy()
    else:
        raw_labels = np.asarray(label_column.to_pylist(), dtype=object)
    y = _labels_of(raw_labels, _Classes(spec.class_names), str(path))
    x = np.empty((rows, len(chosen)), dtype=np.float64)
    for k, j in enumerate(chosen):
        x[:, k] = _parquet_numbers(table.column(k + 1), f"{path}", columns[j], pa)
    inputs = _tabular_inputs(x, _with_columns(spec, [columns[j] for j in chosen]), str(path), lambda r: f"row {r + 1}")
    return _finish(inputs, y, spec, "parquet", str(path), notes, "rows")


def _parquet_numbers(column: Any, where: str, name: str, pa: Any) -> np.ndarray:
    if column.null_count:
        first = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{where}, row {first + 1}, column {name!r}: empty cell", hint="every feature needs a number: fill it in or drop the row")
    kind = column.type
    if pa.types.is_dictionary(kind):  # a pandas category column
        return _parquet_numbers(column.cast(kind.value_type), where, name, pa)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind) or pa.types.is_decimal(kind):
        return column.cast(pa.float64(), safe=False).to_numpy()
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return np.array([_number(v, f"{where}, row {r + 1}, column {name!r}") for r, v in enumerate(column.to_pylist())], dtype=np.float64)
    raise DataError(f"{where}, column {name!r} holds {kind} values, not numbers", hint="feature columns hold numbers")


_READERS: dict[str, Callable[[Path, DataSpec, int], HeldData]] = {
    "imagefolder": _read_image_folder,
    "idx": _read_idx_folder,
    "csv": _read_csv,
    "parquet": _read_parquet,
    "npz": _read_npz,
    "safetensors": _read_safetensors,
}
