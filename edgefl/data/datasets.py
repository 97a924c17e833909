"""Datasets: MNIST-format IDX folders (Fashion-MNIST, MNIST, or one's own as ``idx``) and
scikit-learn's small sets.

A named ``data_dir`` (``--data-dir``) is the only place looked in, and must exist. Without one,
IDX folders are searched, in order, in ``$EDGEFL_DATA``, the user cache
(``$XDG_CACHE_HOME/edgefl/datasets``) and ``/usr/share/datasets`` (where Debian's
``dataset-fashion-mnist`` puts them). When none has them and downloading is allowed, they are
fetched into the cache, checked against known MD5 sums, and only then moved into place.

What was read is checked against the declared data set (:class:`IdxIdentity`: sample counts,
image shape, the first labels and a SHA-256 of the labels where known), so MNIST files are never
trained on as Fashion-MNIST or the other way round. File names: ``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each also
accepted with ``.idx3-ubyte``/``.idx1-ubyte`` after a dot (``train-images.idx3-ubyte``) and with
``.gz`` (README, Data).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgefl.data.idx import read_idx
from edgefl.data.sklearn_cache import read_split, split_path, write_split
from edgefl.errors import DataError
from edgefl.userdirs import cache_home

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclass(frozen=True)
class IdxIdentity:
    """What the files of a known data set hold: enough to tell MNIST from Fashion-MNIST (same
    sizes, different labels) without hashing 50 MB of images."""

    train_count: int
    test_count: int
    image_shape: tuple[int, int]
    first_train_labels: tuple[int, ...]
    first_test_labels: tuple[int, ...]
    train_labels_sha256: str | None = None  # of the decoded label bytes (gzip or not alike)
    test_labels_sha256: str | None = None


@dataclass(frozen=True)
class IdxSource:
    base_url: str
    md5: dict[str, str]  # file name (with .gz) -> md5
    class_names: tuple[str, ...]
    debian_package: str | None = None
    identity: IdxIdentity | None = None


IDX_SOURCES: dict[str, IdxSource] = {
    "fashion-mnist": IdxSource(
        base_url="http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        md5={
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
        class_names=("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
        debian_package="dataset-fashion-mnist",
        identity=IdxIdentity(60000, 10000, (28, 28), (9, 0, 0, 3, 0, 2, 7, 2, 5, 5), (9, 2, 1, 1, 6, 1, 4, 6, 5, 7),
                             "657fbd221bfc9f4198cc14b5619cc33ec57c58dd0e47af4d99d6650759e869a7",
                             "3d0e6c6ea990b53b6f8f500a41cac93881d981b315f84578b7d915342ade01e9"),
    ),
    "mnist": IdxSource(
        base_url="https://ossci-datasets.s3.amazonaws.com/mnist/",
        md5={
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
        class_names=tuple(str(i) for i in range(10)),
        identity=IdxIdentity(60000, 10000, (28, 28), (5, 0, 4, 1, 9, 2, 1, 3, 1, 4), (7, 2, 1, 0, 4, 1, 4, 9, 5, 9)),
    ),
}

SKLEARN_SETS = ("digits", "breast-cancer")
#: what scikit-learn ships of each (samples, input shape as edgefl reads it, classes): a cached split must hold as much
SKLEARN_SIZES = {"digits": (1797, (1, 8, 8), 10), "breast-cancer": (569, (30,), 2)}
#: one's own MNIST-format data: ``dataset = "idx"`` with ``data_dir``, ``idx_name`` and ``classes``
GENERIC_IDX = "idx"
DATASET_NAMES = (*IDX_SOURCES, GENERIC_IDX, *SKLEARN_SETS)


@dataclass
class Dataset:
    """A dataset in memory: float32 inputs (images scaled to [0, 1]) and int64 labels."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    class_names: tuple[str, ...]
    source: str
    files: tuple[str, ...] = ()  # the exact files read (IDX data sets)
    #: per-feature (mean, std) the raw features were standardised with, for tabular sets
    standardisation: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    #: set when x_train/x_test hold the raw 8-bit pixels (a device's lean load): input = pixels / this
    pixel_divisor: float | None = None
    #: a table's column names, in input order (what a device's CSV is read by, what an export lists)
    feature_names: tuple[str, ...] | None = None

    def model_input(self, x: torch.Tensor) -> torch.Tensor:
        """Samples as models take them (float32 in [0, 1]), from either form of storage (the same
        division as the float load, so both give bit-identical inputs)."""
        return x.float().div_(self.pixel_divisor) if self.pixel_divisor is not None else x

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def cache_dir() -> Path:
    return cache_home() / "edgefl" / "datasets"


def search_roots(data_dir: str | Path | None) -> list[Path]:
    """Where IDX folders are looked for: only ``data_dir`` when one is named (it must exist: a
    typo must not silently pick up another copy), else the environment, the cache, Debian's."""
    if data_dir:
        if not Path(data_dir).is_dir():
            raise DataError(f"data folder {data_dir} does not exist",
                            hint="fix data.data_dir (--data-dir), or leave it out to search the usual places")
        return [Path(data_dir)]
    roots: list[Path] = []
    if os.environ.get("EDGEFL_DATA"):
        roots.append(Path(os.environ["EDGEFL_DATA"]))
    roots += [cache_dir(), Path("/usr/share/datasets")]
    return roots


def file_name_variants(stem: str) -> list[str]:
    """The names one IDX file goes by: ``train-images-idx3-ubyte`` and ``train-images.idx3-ubyte``,
    each plain or ``.gz``."""
    dotted = stem.replace("-idx", ".idx", 1)
    return [f"{stem}.gz", stem, f"{dotted}.gz", dotted]


def _find_file(folder: Path, stem: str) -> Path | None:
    for name in file_name_variants(stem):
        if (folder / name).is_file():
            return folder / name
    return None


def locate_idx_folder(name: str, data_dir: str | Path | None = None) -> Path | None:
    """The first folder holding all four IDX files of ``name`` (either ``root/name`` or ``root``)."""
    for root in search_roots(data_dir):
        for folder in (root / name, root):
            if all(_find_file(folder, stem) for stem in FILES.values()):
                return folder
    return None


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_idx(
    name: str, dest: Path | None = None, base_url: str | None = None, md5: dict[str, str] | None = None, timeout: float = 30.0
) -> Path:
    """Fetch the four IDX files of ``name`` into ``dest`` (default: the user cache).

    Each file lands in a temporary directory first and is moved into place only after its MD5
    matches, so an interrupted or corrupted download never leaves a file that looks valid.
    """
    source = IDX_SOURCES[name]
    base = (base_url or source.base_url).rstrip("/") + "/"
    sums = source.md5 if md5 is None else md5
    dest = dest or cache_dir() / name
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        for stem in FILES.values():
            fname = f"{stem}.gz"
            target = dest / fname
            if target.is_file() and (fname not in sums or _md5(target) == sums[fname]):
                continue
            part = Path(tmp) / fname
            try:
                with urllib.request.urlopen(base + fname, timeout=timeout) as resp, part.open("wb") as out:
                    shutil.copyfileobj(resp, out)
            except (urllib.error.URLError, OSError) as exc:
                raise DataError(f"download of {base + fname} failed: {exc}") from None
            if fname in sums and _md5(part) != sums[fname]:
                raise DataError(f"download of {base + fname} is corrupt (MD5 mismatch); nothing was kept")
            part.replace(target)
    return dest


def _missing_hint(name: str, data_dir: str | Path | None) -> str:
    places = ", ".join(str(r) for r in search_roots(data_dir))
    wanted = ", ".join(FILES.values())
    pkg = IDX_SOURCES[name].debian_package
    install = f"install it (apt-get install {pkg}), or put" if pkg else "put"
    return (f"looked in {places} (and a {name}/ folder in each) for {wanted} (or .gz, or with a dot before idx); "
            f"{install} the four IDX files in one of those folders, or point the run at them: --data-dir DIR "
            f"(--set data.data_dir=DIR, or data_dir in the config's [data])")


def load_idx_dataset(name: str, data_dir: str | Path | None = None, download: bool = True,
                     class_names: tuple[str, ...] | None = None, raw_pixels: bool = False) -> Dataset:
    """Four IDX files of ``name`` (a known data set, or one's own with ``class_names``), checked
    against what the data set is known to hold."""
    folder = locate_idx_folder(name, data_dir)
    if folder is None:
        if data_dir or not download or class_names is not None:
            raise DataError(f"{name} not found" + (f" in {data_dir}" if data_dir else ""), hint=_missing_hint(name, data_dir))
        try:
            folder = download_idx(name)
        except DataError as exc:
            raise DataError(f"{name} not found locally and {exc.message}", hint=_missing_hint(name, data_dir)) from None
    paths = {key: _find_file(folder, stem) for key, stem in FILES.items()}
    arrays = {key: read_idx(path) for key, path in paths.items()}  # type: ignore[arg-type]
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(
                f"{folder}: {split} images {images.shape} and labels {labels.shape} do not match",
                hint="the folder mixes files from different datasets; fetch them again",
            )
    classes = class_names if class_names is not None else IDX_SOURCES[name].class_names
    for split in ("train", "test"):
        labels = arrays[f"{split}_labels"]
        if len(labels) and int(labels.max()) >= len(classes):
            raise DataError(f"{folder}: {split} labels go up to {int(labels.max())}, but {name} has {len(classes)} classes",
                            hint="for your own data set: dataset = \"idx\" with classes = the number of classes (or their names)")
    if class_names is None:  # a known data set (one's own, with its class names, is taken as it is)
        _check_identity(name, folder, arrays)

    def images(a: np.ndarray) -> torch.Tensor:
        if raw_pixels:  # a quarter of the memory: a device converts only the samples it holds
            return torch.from_numpy(a).unsqueeze(1)
        return torch.from_numpy(a).float().div_(255.0).unsqueeze(1)

    def labels(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.int64))

    return Dataset(
        name=name,
        x_train=images(arrays["train_images"]),
        y_train=labels(arrays["train_labels"]),
        x_test=images(arrays["test_images"]),
        y_test=labels(arrays["test_labels"]),
        class_names=tuple(classes),
        source=str(folder),
        files=tuple(str(paths[key]) for key in FILES),
        pixel_divisor=255.0 if raw_pixels else None,
    )


def _identity_of(arrays: dict[str, np.ndarray]) -> str | None:
    """Which known data set these arrays are, when one matches."""
    for other, source in IDX_SOURCES.items():
        if source.identity is not None and not _identity_problems(source.identity, arrays):
            return other
    return None


def _identity_problems(ident: IdxIdentity, arrays: dict[str, np.ndarray]) -> list[str]:
    problems = []
    for split, count, first, digest in (("train", ident.train_count, ident.first_train_labels, ident.train_labels_sha256),
                                        ("test", ident.test_count, ident.first_test_labels, ident.test_labels_sha256)):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if len(labels) != count:
            problems.append(f"{len(labels)} {split} samples, not {count}")
        if tuple(images.shape[1:]) != ident.image_shape:
            problems.append(f"{split} images of {'x'.join(map(str, images.shape[1:]))}, not {'x'.join(map(str, ident.image_shape))}")
        if tuple(int(v) for v in labels[: len(first)]) != first:
            problems.append(f"{split} labels begin {' '.join(str(int(v)) for v in labels[:len(first)])}, not {' '.join(map(str, first))}")
        elif digest and hashlib.sha256(labels.astype(np.uint8).tobytes()).hexdigest() != digest:
            problems.append(f"{split} labels differ from the published ones (SHA-256)")
    return problems


def _check_identity(name: str, folder: Path, arrays: dict[str, np.ndarray]) -> None:
    ident = IDX_SOURCES[name].identity
    problems = _identity_problems(ident, arrays) if ident is not None else []
    if problems:
        actually = _identity_of(arrays)
        raise DataError(f"the files in {folder} are not {name}: {'; '.join(problems[:3])}"
                        + (f" (they are {actually})" if actually else ""),
                        hint=(f"set data.dataset = \"{actually}\", or point --data-dir at the {name} files" if actually else
                              f"point --data-dir at the {name} files; for your own data set use dataset = \"idx\""))


def load_sklearn_dataset(name: str, test_fraction: float = 0.25, split_seed: int = 0) -> Dataset:
    """scikit-learn's digits (8x8 images) or breast-cancer (30 features, standardised on train).

    The train/test split uses a fixed ``split_seed`` so the test set is the same for every run seed.
    It is kept in the user cache after the first load (:mod:`edgefl.data.sklearn_cache`), so a
    device process does not import scikit-learn to read it again.
    """
    if name not in SKLEARN_SETS:
        raise DataError(f"unknown scikit-learn dataset {name!r}")
    cached = split_path(cache_dir(), name, test_fraction, split_seed)
    arrays = read_split(cached, *SKLEARN_SIZES[name], standardised=name == "breast-cancer")
    if arrays is None:
        arrays = _split_with_sklearn(name, test_fraction, split_seed)
        write_split(cached, arrays)
    standardisation = ((tuple(float(v) for v in arrays["mean"]), tuple(float(v) for v in arrays["std"]))
                       if "mean" in arrays else None)
    return Dataset(
        name=name,
        x_train=torch.from_numpy(np.ascontiguousarray(arrays["x_train"])),
        y_train=torch.from_numpy(np.ascontiguousarray(arrays["y_train"])),
        x_test=torch.from_numpy(np.ascontiguousarray(arrays["x_test"])),
        y_test=torch.from_numpy(np.ascontiguousarray(arrays["y_test"])),
        class_names=tuple(str(c) for c in arrays["class_names"]),
        source=f"sklearn.datasets ({name})",
        standardisation=standardisation,
        feature_names=tuple(str(c) for c in arrays["feature_names"]) if "feature_names" in arrays else None,
    )


def _split_with_sklearn(name: str, test_fraction: float, split_seed: int) -> dict[str, np.ndarray]:
    try:
        from sklearn.datasets import load_breast_cancer, load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise DataError(f"{name} needs scikit-learn", hint="pip install -e '.[sim]' in the edgefl checkout") from None
    if name == "digits":
        raw = load_digits()
        x = raw.data.reshape(-1, 1, 8, 8).astype(np.float32) / 16.0
    else:
        raw = load_breast_cancer()
        x = raw.data.astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, raw.target, test_size=test_fraction, random_state=split_seed, stratify=raw.target)
    arrays = {"x_train": xtr, "y_train": ytr.astype(np.int64), "x_test": xte, "y_test": yte.astype(np.int64),
              "class_names": np.array([str(c) for c in raw.target_names])}
    if name == "breast-cancer":
        mean, std = xtr.mean(0), xtr.std(0) + 1e-8
        arrays.update(x_train=(xtr - mean) / std, x_test=(xte - mean) / std, mean=mean.astype(np.float64), std=std.astype(np.float64),
                      feature_names=np.array([str(c) for c in raw.feature_names]))
    return arrays


def load_dataset(name: str, data_dir: str | Path | None = None, download: bool = True,
                 idx_name: str | None = None, classes: int | list[str] | None = None, raw_pixels: bool = False) -> Dataset:
    """Load a dataset by name: ``fashion-mnist``, ``mnist``, ``digits``, ``breast-cancer``, or
    ``idx``: one's own four IDX files in ``data_dir`` (``idx_name`` names it in reports,
    ``classes`` is the number of classes or their names). ``raw_pixels`` keeps IDX images as
    uint8 (see :meth:`Dataset.model_input`): what a small device loads."""
    if name == GENERIC_IDX:
        if not data_dir or classes is None:
            raise DataError("dataset = \"idx\" reads your own IDX files: it needs data_dir (the folder) and classes",
                            hint="e.g. [data] dataset = \"idx\", data_dir = \"/data/letters\", classes = 26, idx_name = \"letters\"")
        names = tuple(str(c) for c in range(classes)) if isinstance(classes, int) else tuple(classes)
        ds = load_idx_dataset(idx_name or GENERIC_IDX, data_dir, False, names, raw_pixels=raw_pixels)
        return ds
    if name in IDX_SOURCES:
        return load_idx_dataset(name, data_dir, download, raw_pixels=raw_pixels)
    if name in SKLEARN_SETS:
        return load_sklearn_dataset(name)
    raise DataError(f"unknown dataset {name!r}", hint=f"choose one of {', '.join(DATASET_NAMES)}")
