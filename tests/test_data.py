"""IDX reader, dataset search and download, partitioners."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import http.server
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import torch

from edgefl.data import class_counts, contiguous, dirichlet, download_idx, iid, load_dataset, read_idx, shards, subsample, write_idx
from edgefl.data.datasets import FILES, locate_idx_folder
from edgefl.errors import ConfigError, DataError, EdgeflError


def make_idx_folder(folder: Path, n_train: int = 60, n_test: int = 20, compress: bool = True) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if compress else ""
    write_idx(folder / f"{FILES['train_images']}{ext}", rng.integers(0, 256, (n_train, 28, 28)))
    write_idx(folder / f"{FILES['train_labels']}{ext}", np.arange(n_train) % 10)
    write_idx(folder / f"{FILES['test_images']}{ext}", rng.integers(0, 256, (n_test, 28, 28)))
    write_idx(folder / f"{FILES['test_labels']}{ext}", np.arange(n_test) % 10)
    return folder


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """No system dataset, an empty cache: only what the test provides is found."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("EDGEFL_DATA", raising=False)
    import edgefl.data.datasets as d

    original = d.search_roots
    monkeypatch.setattr(d, "search_roots", lambda data_dir: [r for r in original(data_dir) if str(r) != "/usr/share/datasets"])
    return tmp_path


@pytest.mark.parametrize("compress", [True, False])
def test_idx_round_trip(tmp_path, compress):
    arr = np.random.default_rng(1).integers(0, 256, (5, 28, 28)).astype(np.uint8)
    path = tmp_path / ("x.idx.gz" if compress else "x.idx")
    write_idx(path, arr, compress=compress)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == compress
    np.testing.assert_array_equal(read_idx(path), arr)


def test_idx_truncated_names_file_and_fix(tmp_path):
    path = tmp_path / "imgs.idx"
    write_idx(path, np.zeros((4, 28, 28)), compress=False)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"imgs.idx truncated.*\(4, 28, 28\)") as exc:
        read_idx(path)
    assert "fetch it again" in str(exc.value)


def test_idx_bad_magic_trailing_bytes_and_damaged_gzip(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 50)
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(bad)
    extra = tmp_path / "extra"
    write_idx(extra, np.zeros(10), compress=False)
    extra.write_bytes(extra.read_bytes() + b"xx")
    with pytest.raises(DataError, match="trailing bytes"):
        read_idx(extra)
    damaged = tmp_path / "d.gz"
    blob = gzip.compress(b"\x00\x00\x08\x01" + np.random.default_rng(0).bytes(5000))
    damaged.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataError, match="damaged gzip"):
        read_idx(damaged)
    with pytest.raises(DataError, match="cannot read"):
        read_idx(tmp_path / "missing")


def test_real_fashion_mnist_if_installed():
    if locate_idx_folder("fashion-mnist") is None:
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    ds = load_dataset("fashion-mnist", download=False)
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert float(ds.x_train.max()) <= 1.0 and ds.num_classes == 10
    assert np.bincount(ds.y_train.numpy()).tolist() == [6000] * 10


def test_search_order_data_dir_then_env(isolated, monkeypatch):
    a = make_idx_folder(isolated / "a" / "fashion-mnist", n_train=30)
    b = make_idx_folder(isolated / "b", n_train=40)  # files directly in the folder also count
    monkeypatch.setenv("EDGEFL_DATA", str(isolated / "b"))
    assert locate_idx_folder("fashion-mnist", isolated / "a") == a
    assert locate_idx_folder("fashion-mnist") == b
    assert len(load_dataset("idx", data_dir=isolated / "a", idx_name="fashion-mnist", classes=10).y_train) == 30


def test_a_named_data_dir_is_the_only_place_and_must_exist(isolated, monkeypatch):
    make_idx_folder(isolated / "elsewhere")
    monkeypatch.setenv("EDGEFL_DATA", str(isolated / "elsewhere"))
    with pytest.raises(DataError, match="nowhere does not exist"):
        load_dataset("fashion-mnist", data_dir=isolated / "nowhere", download=False)
    (isolated / "empty").mkdir()
    with pytest.raises(DataError) as exc:  # not silently taken from $EDGEFL_DATA, nor downloaded
        load_dataset("fashion-mnist", data_dir=isolated / "empty")
    text = str(exc.value)
    assert "fashion-mnist not found in" in text and "apt-get install dataset-fashion-mnist" in text
    assert "--data-dir" in text and "train-images-idx3-ubyte" in text


def test_files_that_are_not_the_declared_data_set_are_refused(isolated):
    folder = make_idx_folder(isolated / "fake", n_train=30)
    with pytest.raises(DataError, match="are not fashion-mnist: 30 train samples, not 60000"):
        load_dataset("fashion-mnist", data_dir=folder)
    real = Path("/usr/share/datasets/fashion-mnist")
    if not real.is_dir():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    with pytest.raises(DataError, match=r"are not mnist: train labels begin 9 0 0 3.*\(they are fashion-mnist\)") as exc:
        load_dataset("mnist", data_dir=real)
    assert 'data.dataset = "fashion-mnist"' in str(exc.value)


def test_own_idx_data_in_any_common_file_naming(isolated):
    folder = isolated / "letters"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for stem, array in (("train-images.idx3-ubyte", rng.integers(0, 256, (52, 28, 28))), ("train-labels.idx1-ubyte", np.arange(52) % 26),
                        ("t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (26, 28, 28))), ("t10k-labels-idx1-ubyte", np.arange(26) % 26)):
        write_idx(folder / stem, array)
    ds = load_dataset("idx", data_dir=folder, idx_name="letters", classes=[chr(65 + i) for i in range(26)])
    assert (ds.name, ds.num_classes, len(ds.y_train)) == ("letters", 26, 52)
    assert [Path(f).name for f in ds.files] == ["train-images.idx3-ubyte", "train-labels.idx1-ubyte",
                                                "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte"]
    with pytest.raises(DataError, match="labels go up to 25, but letters has 10 classes"):
        load_dataset("idx", data_dir=folder, idx_name="letters", classes=10)


def test_mismatched_files_are_an_error(isolated):
    folder = make_idx_folder(isolated / "mix")
    write_idx(folder / f"{FILES['train_labels']}.gz", np.zeros(7))
    with pytest.raises(DataError, match="do not match"):
        load_dataset("fashion-mnist", data_dir=folder, download=False)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_root(tmp_path):
    root = tmp_path / "www"
    make_idx_folder(root)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def _md5s(root: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in root.glob("*.gz")}


def test_download_from_local_server_verifies_md5(isolated, http_root):
    root, url = http_root
    dest = download_idx("fashion-mnist", isolated / "dl", base_url=url, md5=_md5s(root))
    assert sorted(p.name for p in dest.glob("*.gz")) == sorted(f"{s}.gz" for s in FILES.values())
    ds = load_dataset("idx", data_dir=dest, classes=10)  # what was served is not the real data set
    assert len(ds.y_train) == 60


def test_corrupt_download_keeps_nothing(isolated, http_root):
    root, url = http_root
    sums = _md5s(root)
    sums["train-images-idx3-ubyte.gz"] = "0" * 32
    with pytest.raises(DataError, match="MD5 mismatch"):
        download_idx("fashion-mnist", isolated / "dl", base_url=url, md5=sums)
    assert not (isolated / "dl" / "train-images-idx3-ubyte.gz").exists()


def test_unreachable_server_is_a_clear_error(isolated):
    with pytest.raises(DataError, match="download of http://127.0.0.1:9/"):
        download_idx("fashion-mnist", isolated / "dl", base_url="http://127.0.0.1:9/", timeout=2)


def test_sklearn_sets():
    digits = load_dataset("digits")
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10
    bc = load_dataset("breast-cancer")
    assert bc.input_shape == (30,) and bc.num_classes == 2
    # a table's columns are named, in input order: a device's CSV is read by them, an export lists them
    assert bc.feature_names is not None and len(bc.feature_names) == 30 and bc.feature_names[0] == "mean radius"
    assert digits.feature_names is None
    assert abs(float(bc.x_train.mean())) < 1e-4  # standardised on the training split
    with pytest.raises(DataError, match="unknown dataset"):
        load_dataset("cifar-11")



def _same_dataset(a, b) -> bool:
    return (all(torch.equal(getattr(a, k), getattr(b, k)) and getattr(a, k).dtype == getattr(b, k).dtype
                for k in ("x_train", "y_train", "x_test", "y_test"))
            and (a.class_names, a.standardisation, a.source, a.feature_names) == (b.class_names, b.standardisation, b.source, b.feature_names))


@pytest.mark.parametrize("name", ["digits", "breast-cancer"])
def test_a_sklearn_split_is_read_back_from_the_cache_without_importing_sklearn(name, isolated):
    import json
    import subprocess
    import sys

    from edgefl.data.datasets import _split_with_sklearn, cache_dir

    first = load_dataset(name)
    kept = list((cache_dir() / "sklearn").glob(f"{name}-sklearn*.safetensors"))
    assert len(kept) == 1
    umask = os.umask(0o022)
    os.umask(umask)
    assert kept[0].stat().st_mode & 0o777 == 0o666 & ~umask  # as readable as any file the user writes
    assert not list(kept[0].parent.glob("*.partial"))
    assert _same_dataset(first, load_dataset(name))  # read back: the very tensors scikit-learn's split gave
    fresh = _split_with_sklearn(name, 0.25, 0)
    assert np.array_equal(fresh["x_test"], first.x_test.numpy())
    # another process (a device) reads the cache: scikit-learn, SciPy and pandas are never imported
    code = ("import json, sys; from edgefl.data import load_dataset; d = load_dataset(sys.argv[1]); "
            "print(json.dumps([m for m in ('sklearn', 'scipy', 'pandas') if m in sys.modules] + [float(d.x_train.sum())]))")
    out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, check=True, timeout=120).stdout
    assert json.loads(out) == [pytest.approx(float(first.x_train.sum()))]


DAMAGES = ["garbage", "truncated", "a flipped bit", "wrong dtype", "class names not a list", "class names missing",
           "class names nested deeply", "label out of range", "samples missing", "a terabyte promised", "a huge header promised",
           "a scaling it does not have"]


def _safetensors_file(path: Path, header: dict, data: bytes) -> None:
    """A safetensors file written by hand: an 8-byte little-endian header length, the JSON header, the bytes."""
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _read(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def _resave(path: Path, arrays: dict, meta: dict | None = None) -> None:
    """Write a split as the cache does, with a digest that matches the (damaged) contents: each
    damage case is then caught by the check it is about, not by the digest."""
    from safetensors.numpy import save_file

    from edgefl.data.sklearn_cache import _digest

    meta = dict(meta or {})
    if "class_names" in meta:
        meta["sha256"] = _digest(arrays, meta["class_names"], meta.get("feature_names", ""))
    save_file(arrays, str(path), metadata=meta)


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_sklearn_cache_is_ignored_and_written_again(damage, isolated):
    from edgefl.data.datasets import cache_dir

    good = load_dataset("digits")
    path = next((cache_dir() / "sklearn").glob("digits-*.safetensors"))
    arrays, meta = _read(path)
    if damage == "garbage":
        path.write_bytes(b"\xff" * 64)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "a flipped bit":  # passes every check but the digest
        blob = bytearray(path.read_bytes())
        blob[-100] ^= 1
        path.write_bytes(bytes(blob))
    elif damage == "wrong dtype":
        _resave(path, {**arrays, "x_train": arrays["x_train"].astype(np.float64)}, meta)
    elif damage == "class names not a list":
        _resave(path, arrays, {"class_names": json.dumps({"0": "zero"})})
    elif damage == "class names nested deeply":  # json.loads raises RecursionError, not ValueError
        _resave(path, arrays, {"class_names": "[" * 100_000 + "]" * 100_000})
    elif damage == "class names missing":
        _resave(path, arrays)
    elif damage == "label out of range":
        _resave(path, {**arrays, "y_train": arrays["y_train"] + 10}, meta)
    elif damage == "a terabyte promised":  # x_train's header claims 10^11 images; the file holds none
        _safetensors_file(path, {"x_train": {"dtype": "F32", "shape": [10**11, 1, 8, 8], "data_offsets": [0, 4 * 64 * 10**11]}}, b"")
    elif damage == "a huge header promised":
        path.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    elif damage == "a scaling it does not have":  # digits are not standardised: a mean and std of 8x8 images is not its split
        _resave(path, {**arrays, "mean": np.zeros((1, 8, 8)), "std": np.ones((1, 8, 8))}, meta)
    else:
        _resave(path, {**arrays, "x_train": arrays["x_train"][:-1], "y_train": arrays["y_train"][:-1]}, meta)
    assert _same_dataset(load_dataset("digits"), good)
    assert _read(path)[0].keys() == arrays.keys() and _read(path)[1] == meta  # written again
    assert _same_dataset(load_dataset("digits"), good)


def test_a_standardised_set_whose_cache_lost_its_scaling_is_computed_again(isolated):
    """breast-cancer's exports normalise with the training mean and std: a cached split without
    them (or with a zero std) would train the same and export without normalisation."""
    from edgefl.data.datasets import cache_dir

    good = load_dataset("breast-cancer")
    assert good.standardisation is not None
    path = next((cache_dir() / "sklearn").glob("breast-cancer-*.safetensors"))
    arrays, meta = _read(path)
    for broken in ({k: v for k, v in arrays.items() if k != "std"}, {**arrays, "std": np.zeros(30)}):
        _resave(path, broken, meta)
        assert _same_dataset(load_dataset("breast-cancer"), good)
    # a file of a version that did not keep the column names: computed again, names and all
    _resave(path, arrays, {k: v for k, v in meta.items() if k != "feature_names"})
    assert _same_dataset(load_dataset("breast-cancer"), good)
    assert "feature_names" in _read(path)[1]


@pytest.mark.parametrize("value", ["", "relative/cache"])
def test_an_empty_or_relative_xdg_cache_home_is_ignored(value, monkeypatch, tmp_path):
    """The XDG specification ignores both; used as given, they put the cache in whatever folder the
    command runs in (edgefl's own package, run from a checkout)."""
    from edgefl.data.datasets import cache_dir
    from edgefl.userdirs import cache_home, state_home

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", value)
    monkeypatch.setenv("XDG_STATE_HOME", value)
    assert cache_dir() == tmp_path / "home" / ".cache" / "edgefl" / "datasets"
    assert cache_home() == tmp_path / "home" / ".cache" and state_home() == tmp_path / "home" / ".local" / "state"


def test_a_cache_folder_that_cannot_be_written_only_costs_the_import(isolated, monkeypatch):
    (isolated / "cache").write_text("a file where the cache folder would go")
    assert load_dataset("digits").num_classes == 10


LABELS = np.repeat(np.arange(10), 100)


def test_iid_even_and_disjoint():
    parts = iid(LABELS, 7, seed=0)
    assert sorted(len(p) for p in parts) == [142] + [143] * 6
    assert len(np.unique(np.concatenate(parts))) == 1000


def test_dirichlet_is_seeded_skewed_and_respects_minimum():
    a = dirichlet(LABELS, 10, 0.1, seed=3, min_samples=20)
    b = dirichlet(LABELS, 10, 0.1, seed=3, min_samples=20)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert min(len(p) for p in a) >= 20
    assert len(np.unique(np.concatenate(a))) == 1000
    counts = class_counts(LABELS, a, 10)
    assert (counts == 0).sum() > 10  # alpha 0.1: many clients miss many classes
    iid_counts = class_counts(LABELS, dirichlet(LABELS, 10, 1000.0, seed=3), 10)
    assert (iid_counts == 0).sum() == 0


def test_dirichlet_bad_inputs():
    with pytest.raises(ConfigError, match="alpha must be positive"):
        dirichlet(LABELS, 10, 0.0)
    with pytest.raises(ConfigError, match="cannot give 10 clients 200 samples"):
        dirichlet(LABELS, 10, 0.5, min_samples=200)


def test_shards_give_k_classes():
    parts = shards(LABELS, 10, 2, seed=0)
    assert all(len(np.unique(LABELS[p])) <= 2 for p in parts)
    assert len(np.unique(np.concatenate(parts))) == 1000


def test_subsample_caps_each_client():
    parts = subsample(iid(LABELS, 4, seed=0), 50, seed=0)
    assert [len(p) for p in parts] == [50] * 4


def test_a_device_can_keep_images_as_8_bit_pixels_with_identical_inputs():
    try:
        flt = load_dataset("fashion-mnist", download=False)
        raw = load_dataset("fashion-mnist", download=False, raw_pixels=True)
    except EdgeflError as exc:
        pytest.skip(f"Fashion-MNIST not installed: {exc}")
    assert raw.x_train.dtype == torch.uint8 and raw.x_train.element_size() * 4 == flt.x_train.element_size()
    idx = torch.arange(0, 60000, 997)
    assert torch.equal(raw.model_input(raw.x_train[idx]), flt.x_train[idx])  # bit for bit: same training numbers


def test_contiguous_parts_are_the_file_order_cut_in_equal_parts_and_too_many_devices_are_refused():
    from edgefl.errors import ConfigError

    parts = contiguous(np.zeros(10, dtype=np.int64), 3)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(ConfigError, match="cannot each hold a part"):
        contiguous(np.zeros(2, dtype=np.int64), 3)
