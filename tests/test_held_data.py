"""A device's own data (edgefl.data.held): real Fashion-MNIST images written as PNG folders, IDX,
npz and safetensors files, scikit-learn's breast-cancer table as CSV and Parquet, a user's loader;
every file is written here and read back, nothing is mocked."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import save_file

from edgefl.data import DataSpec as ExportedSpec
from edgefl.data.datasets import FILES, IDX_SOURCES, load_dataset, locate_idx_folder
from edgefl.data.held import DataSpec, HeldData, detect_format, load_held_data
from edgefl.data.idx import write_idx
from edgefl.errors import DataError

FASHION = IDX_SOURCES["fashion-mnist"].class_names
SPEC = DataSpec(kind="image", class_names=FASHION, input_shape=(1, 28, 28))
PER_CLASS = 12
#: folder names the owner might use: the slug of T-shirt/top (a '/' cannot be in a folder name),
#: exact names, another case and separator, and a class index; no Bag folder (a missing class is normal)
FOLDERS = {0: "t-shirt-top", 1: "Trouser", 2: "pullover", 3: "3", 4: "Coat", 5: "Sandal", 6: "Shirt", 7: "SNEAKER", 9: "Ankle_boot"}


@pytest.fixture(scope="module")
def fashion() -> dict[int, np.ndarray]:
    """PER_CLASS real test-set images of each class, as uint8 [n, 28, 28]."""
    if locate_idx_folder("fashion-mnist") is None:
        pytest.skip("Fashion-MNIST IDX files not installed (apt-get install dataset-fashion-mnist puts them in /usr/share/datasets)")
    ds = load_dataset("fashion-mnist", download=False, raw_pixels=True)
    images, labels = ds.x_test[:, 0].numpy(), ds.y_test.numpy()
    return {c: images[labels == c][:PER_CLASS] for c in range(10)}


def write_folder(root: Path, fashion: dict[int, np.ndarray], transform=None) -> Path:
    for label, folder in FOLDERS.items():
        (root / folder).mkdir(parents=True)
        for i, pixels in enumerate(fashion[label]):
            img = Image.fromarray(pixels, mode="L")
            (transform(img) if transform else img).save(root / folder / f"{i:03d}.png")
    return root


def expected(fashion: dict[int, np.ndarray], label: int) -> torch.Tensor:
    return torch.from_numpy(fashion[label]).float().div_(255.0).unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# image folders


def test_an_image_folder_reads_back_the_exact_pixels(tmp_path, fashion):
    root = write_folder(tmp_path / "photos", fashion)
    (root / ".thumbnails").mkdir()
    (root / ".thumbnails" / "x.png").write_bytes(b"not read")
    (root / "Coat" / ".DS_Store").write_bytes(b"\0\1")
    held = load_held_data(root, SPEC)
    assert isinstance(held, HeldData) and held.format == "imagefolder" and held.notes == []
    assert held.x.dtype == torch.float32 and held.y.dtype == torch.int64 and held.x.shape == (9 * PER_CLASS, 1, 28, 28)
    assert held.source == f"ImageFolder {root} (9 classes, {9 * PER_CLASS} images)"
    assert held.class_counts(10) == [PER_CLASS if c in FOLDERS else 0 for c in range(10)]
    for label in FOLDERS:  # files are read in name order within a class
        assert torch.equal(held.x[held.y == label], expected(fashion, label))


def test_rgb_images_of_another_size_are_converted_and_resized(tmp_path, fashion):
    root = write_folder(tmp_path / "rgb", fashion, lambda img: img.resize((32, 32), Image.Resampling.BILINEAR).convert("RGB"))
    held = load_held_data(root, SPEC)
    n = 9 * PER_CLASS
    assert held.notes == [f"converted {n} image(s) from RGB to 1 channel", f"resized {n} image(s) from 32x32 to 28x28"]
    assert held.x.shape == (n, 1, 28, 28) and 0 <= held.x.min() and held.x.max() <= 1
    for label in FOLDERS:  # up to 32x32 and back down: close to the originals, not equal
        assert (held.x[held.y == label] - expected(fashion, label)).abs().mean() < 0.05

    colour = DataSpec(kind="image", class_names=FASHION, input_shape=(3, 32, 32))
    held = load_held_data(write_folder(tmp_path / "grey", fashion), colour)
    assert held.notes == [f"converted {n} image(s) from L to 3 channels", f"resized {n} image(s) from 28x28 to 32x32"]
    assert held.x.shape == (n, 3, 32, 32) and torch.equal(held.x[:, 0], held.x[:, 2])


def test_every_image_format_and_a_phone_s_rotated_photo(tmp_path, fashion):
    root = tmp_path / "formats"
    for label, fmt in ((1, "JPEG"), (4, "GIF"), (6, "BMP"), (7, "WEBP")):
        (root / FASHION[label]).mkdir(parents=True)
        Image.fromarray(fashion[label][0]).save(root / FASHION[label] / f"a.{fmt.lower()}", fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    portrait = Image.fromarray(np.ascontiguousarray(fashion[9][0][:, :20])).rotate(90, expand=True)  # stored 28 wide, 20 high
    exif = portrait.getexif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to view": what a phone writes for a portrait photo
    portrait.save(root / FASHION[7] / "B.JPG", exif=exif)
    (root / FASHION[7] / "notes.txt").write_text("not an image")
    held = load_held_data(root, SPEC)
    assert held.class_counts(10) == [0, 1, 0, 0, 1, 0, 1, 2, 0, 0]
    assert held.notes == ["ignored 1 file(s) that are not images (png, jpg, jpeg, bmp, gif, webp), e.g. Sneaker/notes.txt",
                          "converted 1 image(s) from P to 1 channel",  # the GIF: a palette of greys
                          "converted 1 image(s) from RGB to 1 channel",  # the WEBP: WebP has no grey mode
                          "resized 1 image(s) from 20x28 to 28x28", "turned 1 image(s) upright by their EXIF orientation"]
    lossless = [held.x[held.y == label][0] for label in (4, 6)] + [held.x[held.y == 7][1]]  # GIF, BMP, WEBP (after B.JPG in name order)
    assert all(torch.equal(x, expected(fashion, label)[0]) for x, label in zip(lossless, (4, 6, 7)))
    assert (held.x[held.y == 1][0] - expected(fashion, 1)[0]).abs().mean() < 0.02  # JPEG is lossy


def test_images_of_another_size_are_refused_when_resizing_is_off(tmp_path, fashion):
    root = write_folder(tmp_path / "big", fashion, lambda img: img.resize((32, 30)))
    with pytest.raises(DataError, match=r"3/000\.png is 32x30 pixels; the task takes 28x28 .*resize=False") as exc:
        load_held_data(root, DataSpec(kind="image", class_names=FASHION, input_shape=(1, 28, 28), resize=False))
    assert "resize your images to 28x28" in exc.value.hint


def test_a_class_the_task_does_not_know_is_refused_by_name(tmp_path, fashion):
    root = write_folder(tmp_path / "photos", fashion)
    (root / "cat").mkdir()
    Image.fromarray(fashion[0][0]).save(root / "cat" / "tabby.png")
    with pytest.raises(DataError, match=r"class folders the federation's task does not know: 'cat' \(the task's classes: T-shirt/top, Trouser") as exc:
        load_held_data(root, SPEC)
    assert "cannot take part" in exc.value.hint and "remove or rename that folder" in exc.value.hint

    for name in ("dog", "emu", "fox", "gnu", "hen", "yak"):
        (root / name).mkdir()
    with pytest.raises(DataError, match=r"'cat', 'dog', 'emu', 'fox', 'gnu' and 2 more"):
        load_held_data(root, SPEC)


def test_an_empty_folder_holds_no_samples(tmp_path):
    (tmp_path / "empty").mkdir()
    assert detect_format(tmp_path / "empty") == "imagefolder"
    with pytest.raises(DataError, match="empty holds no samples"):
        load_held_data(tmp_path / "empty", SPEC)
    (tmp_path / "folders" / "Coat").mkdir(parents=True)
    (tmp_path / "folders" / "Coat" / "notes.txt").write_text("no images yet")
    with pytest.raises(DataError, match="folders holds no samples"):
        load_held_data(tmp_path / "folders", SPEC)


def test_a_file_that_does_not_decode_is_refused_by_name(tmp_path, fashion):
    root = write_folder(tmp_path / "photos", fashion)
    png = root / "Coat" / "005.png"
    png.write_bytes(png.read_bytes()[:60])  # truncated mid-stream
    with pytest.raises(DataError, match=r"Coat/005\.png does not decode as an image") as exc:
        load_held_data(root, SPEC)
    assert "none is skipped" in exc.value.hint
    png.write_bytes(b"GIF89a but not really")
    with pytest.raises(DataError, match=r"Coat/005\.png does not decode"):
        load_held_data(root, SPEC)


def test_too_many_samples_are_refused_saying_how_many(tmp_path, fashion):
    root = write_folder(tmp_path / "photos", fashion)
    with pytest.raises(DataError, match=rf"holds {9 * PER_CLASS} samples, more than the 50 a device reads"):
        load_held_data(root, SPEC, max_samples=50)


# ---------------------------------------------------------------------------------------------
# IDX, npz, safetensors


def test_idx_files_train_and_t10k(tmp_path, fashion):
    images = np.concatenate([fashion[c] for c in range(10)])
    labels = np.repeat(np.arange(10), PER_CLASS)
    folder = tmp_path / "idx"
    folder.mkdir()
    write_idx(folder / f"{FILES['train_images']}.gz", images[:100])
    write_idx(folder / f"{FILES['train_labels']}.gz", labels[:100])
    held = load_held_data(folder, SPEC)
    assert held.format == "idx" and held.source == f"IDX {folder} (train, 9 classes, 100 samples)"
    assert torch.equal(held.x, torch.from_numpy(images[:100]).float().div_(255.0).unsqueeze(1))
    assert torch.equal(held.y, torch.from_numpy(labels[:100]).long())

    write_idx(folder / FILES["test_images"].replace("-idx", ".idx"), images[100:])  # the dotted name, not compressed
    write_idx(folder / FILES["test_labels"], labels[100:])
    held = load_held_data(folder, SPEC)
    assert "train + t10k, 10 classes" in held.source and torch.equal(held.x, torch.from_numpy(images).float().div_(255.0).unsqueeze(1))

    write_idx(folder / FILES["test_labels"], np.full(len(labels) - 100, 12))
    with pytest.raises(DataError, match=r"does not know: 12 \(the task's classes"):
        load_held_data(folder, SPEC)


def test_npz_with_uint8_images_channels_last(tmp_path, fashion):
    images = np.concatenate([fashion[c] for c in range(10)])
    labels = np.repeat(np.arange(10), PER_CLASS)
    np.savez(tmp_path / "held.npz", x=images[..., None], y=labels)  # [N, H, W, C]
    held = load_held_data(tmp_path / "held.npz", SPEC)
    assert held.format == "npz" and held.notes == ["read x as [N, H, W, C] (channels last)", "divided the integer pixels by 255"]
    assert torch.equal(held.x, torch.from_numpy(images).float().div_(255.0).unsqueeze(1)) and torch.equal(held.y, torch.from_numpy(labels))

    names = np.array([FASHION[c] for c in labels])  # labels as class names; float x is taken as it is
    np.savez(tmp_path / "named.npz", x=images.astype(np.float32) / 255, y=names)
    held = load_held_data(tmp_path / "named.npz", SPEC)
    assert held.notes == [] and torch.equal(held.y, torch.from_numpy(labels))

    rgb = np.repeat(images[:, None], 3, axis=1)  # [N, 3, 28, 28] to a 3 x 32 x 32 task
    np.savez(tmp_path / "rgb.npz", x=rgb, y=labels)
    held = load_held_data(tmp_path / "rgb.npz", DataSpec(kind="image", class_names=FASHION, input_shape=(3, 32, 32)))
    assert held.x.shape == (len(labels), 3, 32, 32) and f"resized {len(labels)} images from 28x28 to 32x32" in held.notes
    with pytest.raises(DataError, match=r"shape \[120, 3, 28, 28\], the task takes \[N, 1, 28, 28\] \(resizing allowed\)"):
        load_held_data(tmp_path / "rgb.npz", SPEC)
    with pytest.raises(DataError, match=r"shape \[120, 1, 28, 28\], the task takes \[N, 1, 32, 32\] \(resizing is off"):
        load_held_data(tmp_path / "held.npz", DataSpec(kind="image", class_names=FASHION, input_shape=(1, 32, 32), resize=False))


def test_npz_is_read_without_pickle(tmp_path):
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}], dtype=object), y=np.array([0]))
    with pytest.raises(DataError, match=r"objects\.npz cannot be read as \.npz"):
        load_held_data(tmp_path / "objects.npz", SPEC)
    np.savez(tmp_path / "wrong.npz", images=np.zeros((2, 28, 28)))
    with pytest.raises(DataError, match=r"has no array x or y: it holds images"):
        load_held_data(tmp_path / "wrong.npz", SPEC)


def test_safetensors_pair(tmp_path, fashion):
    images = np.concatenate([fashion[c] for c in range(10)])
    labels = np.repeat(np.arange(10), PER_CLASS).astype(np.int64)
    save_file({"x": images[:, None].copy(), "y": labels}, str(tmp_path / "held.safetensors"))
    held = load_held_data(tmp_path / "held.safetensors", SPEC)
    assert held.format == "safetensors" and held.source.endswith("(10 classes, 120 samples)")
    assert torch.equal(held.x, torch.from_numpy(images).float().div_(255.0).unsqueeze(1)) and torch.equal(held.y, torch.from_numpy(labels))
    save_file({"x": images[:, None].copy()}, str(tmp_path / "nolabels.safetensors"))
    with pytest.raises(DataError, match="has no tensor y: it holds x"):
        load_held_data(tmp_path / "nolabels.safetensors", SPEC)


# ---------------------------------------------------------------------------------------------
# tables


@pytest.fixture(scope="module")
def cancer():
    from sklearn.datasets import load_breast_cancer

    return load_breast_cancer()


def cancer_spec(cancer, **kw) -> DataSpec:
    return DataSpec(kind="tabular", class_names=tuple(cancer.target_names), input_shape=(30,), feature_names=tuple(str(n) for n in cancer.feature_names), **kw)


def write_csv(path: Path, columns: list[str], rows: list[list]) -> Path:
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        writer.writerows(rows)
    return path


def cancer_table(cancer) -> tuple[list[str], list[list]]:
    """The label in the middle, an id column the task does not read, names as the labels."""
    names = list(cancer.feature_names)
    columns = ["id", *names[:10], "label", *names[10:]]
    rows = [[i, *(repr(float(v)) for v in r[:10]), cancer.target_names[t], *(repr(float(v)) for v in r[10:])]
            for i, (r, t) in enumerate(zip(cancer.data, cancer.target))]
    return columns, rows


def test_a_csv_table_with_named_features(tmp_path, cancer):
    assert (tuple(cancer.target_names), cancer.data.shape) == (("malignant", "benign"), (569, 30))
    path = write_csv(tmp_path / "cancer.csv", *cancer_table(cancer))
    held = load_held_data(path, cancer_spec(cancer))
    raw = torch.from_numpy(cancer.data.astype(np.float32))
    assert held.format == "csv" and held.source == f"CSV {path} (2 classes, 569 rows)"
    assert held.notes == ["ignored 1 column(s) the task does not read: id"]
    assert torch.equal(held.x, raw) and torch.equal(held.y, torch.from_numpy(cancer.target).long())

    mean, std = raw.mean(0), raw.std(0)
    held = load_held_data(path, cancer_spec(cancer, mean=tuple(mean.tolist()), std=tuple(std.tolist())))
    assert torch.equal(held.x, (raw - mean) / std) and held.notes[-1] == "standardised the 30 features with the task's mean and std"

    # without feature names: any 30 columns besides the label, in the file's order
    columns, rows = cancer_table(cancer)
    write_csv(tmp_path / "plain.csv", columns[1:], [r[1:] for r in rows])
    plain = DataSpec(kind="tabular", class_names=("malignant", "benign"), input_shape=(30,))
    assert torch.equal(load_held_data(tmp_path / "plain.csv", plain).x[:, 10:], raw[:, 10:])
    with pytest.raises(DataError, match=r"has 31 feature columns besides 'label', the task takes 30"):
        load_held_data(path, plain)


def test_csv_refusals_name_the_column_and_row(tmp_path, cancer):
    spec = cancer_spec(cancer)
    columns, rows = cancer_table(cancer)
    at = columns.index("mean radius")
    write_csv(tmp_path / "missing.csv", columns[:at] + columns[at + 1:], [r[:at] + r[at + 1:] for r in rows])
    with pytest.raises(DataError, match=r"missing\.csv lacks the task's column\(s\) 'mean radius'") as exc:
        load_held_data(tmp_path / "missing.csv", spec)
    assert "add or rename them" in exc.value.hint and "rename" not in exc.value.message  # nothing close to suggest
    # a misspelt column is named as the one to rename (an outside trial got only the task's 30 names)
    write_csv(tmp_path / "misspelt.csv", [c if c != "mean radius" else "mean raduis" for c in columns], rows)
    with pytest.raises(DataError, match=r"lacks the task's column\(s\) 'mean radius'; rename 'mean raduis' to 'mean radius'\?"):
        load_held_data(tmp_path / "misspelt.csv", spec)

    texture = columns.index("mean texture")
    bad = [list(r) for r in rows]
    bad[2][texture] = "n/a"
    write_csv(tmp_path / "text.csv", columns, bad)
    with pytest.raises(DataError, match=r"text\.csv, row 3 \(line 4\), column 'mean texture': 'n/a' is not a number"):
        load_held_data(tmp_path / "text.csv", spec)
    bad[2][texture] = ""
    write_csv(tmp_path / "empty.csv", columns, bad)
    with pytest.raises(DataError, match=r"row 3 \(line 4\), column 'mean texture': empty cell"):
        load_held_data(tmp_path / "empty.csv", spec)
    bad[2][texture] = "17.0"
    bad[40][texture] = "nan"
    write_csv(tmp_path / "nan.csv", columns, bad)
    with pytest.raises(DataError, match=r"nan\.csv, row 41 \(line 42\), column 'mean texture': nan is not a finite number") as exc:
        load_held_data(tmp_path / "nan.csv", spec)
    assert "NaN and infinite" in exc.value.hint

    write_csv(tmp_path / "nolabel.csv", [c if c != "label" else "diagnosis" for c in columns], rows)
    with pytest.raises(DataError, match=r"has no column 'label'; its columns: id, mean radius, mean texture.*\(is 'diagnosis' it\?\)") as exc:
        load_held_data(tmp_path / "nolabel.csv", spec)
    assert "data.label_column" in exc.value.hint
    write_csv(tmp_path / "unknown.csv", columns, [*rows[:5], [*rows[5][:11], "benign-ish", *rows[5][12:]]])
    with pytest.raises(DataError, match=r"labels the federation's task does not know: 'benign-ish' \(the task's classes: malignant, benign\)") as exc:
        load_held_data(tmp_path / "unknown.csv", spec)
    assert "remove those rows or change their label" in exc.value.hint


def test_csv_labels_as_indices_and_semicolons(tmp_path, cancer):
    columns, rows = cancer_table(cancer)
    label = columns.index("label")
    with (tmp_path / "semi.csv").open("w", newline="") as fh:
        writer = csv.writer(fh, delimiter=";")
        writer.writerow(columns)
        writer.writerows([*r[:label], str(t), *r[label + 1:]] for r, t in zip(rows[:50], cancer.target))
    held = load_held_data(tmp_path / "semi.csv", cancer_spec(cancer))
    assert torch.equal(held.y, torch.from_numpy(cancer.target[:50]).long()) and "read as ';'-separated" in held.notes


def test_parquet_table(tmp_path, cancer):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (Parquet is read only with it)")
    import pyarrow.parquet as pq

    table = {name: cancer.data[:, i] for i, name in enumerate(cancer.feature_names)}
    table["label"] = [cancer.target_names[t] for t in cancer.target]
    pq.write_table(pa.table(table), tmp_path / "cancer.parquet")
    held = load_held_data(tmp_path / "cancer.parquet", cancer_spec(cancer))
    assert held.format == "parquet" and held.source.endswith("(2 classes, 569 rows)")
    assert torch.equal(held.x, torch.from_numpy(cancer.data.astype(np.float32))) and torch.equal(held.y, torch.from_numpy(cancer.target).long())
    table["mean area"] = [None if i == 7 else v for i, v in enumerate(table["mean area"].tolist())]
    pq.write_table(pa.table(table), tmp_path / "hole.parquet")
    with pytest.raises(DataError, match=r"hole\.parquet, row 8, column 'mean area': empty cell"):
        load_held_data(tmp_path / "hole.parquet", cancer_spec(cancer))


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, cancer, monkeypatch):
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # the import fails as it does where pyarrow is not installed
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match="needs pyarrow") as exc:
        load_held_data(tmp_path / "t.parquet", cancer_spec(cancer))
    assert exc.value.hint == "pip install pyarrow"


# ---------------------------------------------------------------------------------------------
# the owner's loader, and what is not data


LOADER = '''
import numpy as np

def load(path, spec):
    """A Kaggle-style pixel table: class name, then 784 pixels per row."""
    names = np.loadtxt(path, delimiter=",", usecols=0, dtype=str)
    pixels = np.loadtxt(path, delimiter=",", usecols=range(1, 785), dtype=np.uint8)
    return pixels.reshape(-1, 28, 28), list(names)

def broken(path, spec):
    return {}["x"]

def flat(path, spec):
    return np.zeros((4, 784), np.uint8), [0, 1, 2, 3]
'''


def test_a_loader_from_a_file_and_from_a_module(tmp_path, fashion, monkeypatch):
    (tmp_path / "my_loader.py").write_text(LOADER)
    labels = np.repeat(np.arange(10), 3)
    images = np.concatenate([fashion[c][:3] for c in range(10)])
    with (tmp_path / "pixels.txt").open("w") as fh:
        for label, image in zip(labels, images):
            fh.write(",".join([FASHION[label], *map(str, image.reshape(-1))]) + "\n")
    held = load_held_data(tmp_path / "pixels.txt", SPEC, loader=f"{tmp_path / 'my_loader.py'}:load")
    assert held.format == "loader" and held.source.startswith(f"loader {tmp_path / 'my_loader.py'}:load on {tmp_path / 'pixels.txt'}")
    assert torch.equal(held.x, torch.from_numpy(images).float().div_(255.0).unsqueeze(1)) and torch.equal(held.y, torch.from_numpy(labels))

    monkeypatch.syspath_prepend(str(tmp_path))
    assert torch.equal(load_held_data(tmp_path / "pixels.txt", SPEC, loader="my_loader:load").x, held.x)
    with pytest.raises(DataError, match=r"failed on .*pixels\.txt: KeyError: 'x'"):
        load_held_data(tmp_path / "pixels.txt", SPEC, loader="my_loader:broken")
    with pytest.raises(DataError, match=r"the samples have shape \[4, 784\], the task takes \[N, 1, 28, 28\]"):
        load_held_data(tmp_path / "pixels.txt", SPEC, loader="my_loader:flat")
    with pytest.raises(DataError, match="my_loader has no function 'missing'"):
        load_held_data(tmp_path / "pixels.txt", SPEC, loader="my_loader:missing")
    with pytest.raises(DataError, match="does not name a function"):
        load_held_data(tmp_path / "pixels.txt", SPEC, loader="my_loader")
    with pytest.raises(DataError, match="cannot import no_such_package_here"):
        load_held_data(tmp_path / "pixels.txt", SPEC, loader="no_such_package_here:load")


def test_what_is_not_data_is_refused(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(DataError, match=r"blob\.bin is not a data format edgefl reads \(suffix '\.bin'\)") as exc:
        detect_format(blob)
    assert "one sub-folder per class" in exc.value.hint and "loader" in exc.value.hint
    with pytest.raises(DataError, match="does not exist"):
        load_held_data(tmp_path / "nowhere", SPEC)
    loose = tmp_path / "loose"
    loose.mkdir()
    Image.new("L", (28, 28)).save(loose / "a.png")
    with pytest.raises(DataError, match="holds images but no class sub-folders"):
        detect_format(loose)
    for name, fmt in (("a.CSV", "csv"), ("b.parquet", "parquet"), ("c.npz", "npz"), ("d.safetensors", "safetensors")):
        (tmp_path / name).write_bytes(b"")
        assert detect_format(tmp_path / name) == fmt


def test_a_tabular_task_refuses_images_and_an_inconsistent_spec_is_the_task_s(tmp_path, cancer, fashion):
    root = write_folder(tmp_path / "photos", fashion)
    with pytest.raises(DataError, match=r"the task takes tabular samples \(30 features\); .*photos is an image folder"):
        load_held_data(root, cancer_spec(cancer))
    with pytest.raises(DataError, match="inconsistent: 2 mean values for 30 features") as exc:
        load_held_data(root, cancer_spec(cancer, mean=(0.0, 1.0), std=(1.0, 1.0)))
    assert "not from your data" in exc.value.hint
    assert ExportedSpec is DataSpec
