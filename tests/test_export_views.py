"""A device's model trained on its own view of the data (CHFL's feature subsets) exports with that
view: checked on what the device saw, and described so that a phone can build the same input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from edgefl.config import RunConfig  # noqa: E402
from edgefl.data import load_dataset  # noqa: E402
from edgefl.errors import EdgeflError  # noqa: E402
from edgefl.exporters import export_path  # noqa: E402
from edgefl.exporters.metadata import read_sidecar  # noqa: E402
from edgefl.rundir import RunDir, load_model_file  # noqa: E402
from edgefl.sim import Simulation  # noqa: E402


@pytest.fixture(scope="module")
def chfl_run(tmp_path_factory):
    """The CHFL breast-cancer example's shape at one round: three hospitals, each with half the columns."""
    raw = {"name": "chfl-views", "seed": 0, "rounds": 1, "method": {"name": "chfl", "embedding_dim": 64},
           "data": {"dataset": "breast-cancer", "partition": "dirichlet", "alpha": 0.5, "min_samples": 40, "client_test_fraction": 0.25},
           "train": {"epochs": 1, "batch_size": 16, "lr": 0.001},
           "fleet": {"groups": [{"model": "mlp", "count": 3, "options": {"hidden": [32], "feature_dim": 64},
                                 "view": {"kind": "features", "fraction": 0.5}}]}}
    run = RunDir.create(tmp_path_factory.mktemp("chfl") / "run", raw["name"], 0)
    Simulation(RunConfig.model_validate(raw), run, show_progress=False).run()
    return run.path


def test_a_device_model_on_a_feature_view_exports_and_a_phone_can_feed_it_raw_features(chfl_run, tmp_path):
    files = export_path(chfl_run, tmp_path, formats=("onnx",), dynamic_batch=False, mobile_check=False)
    assert len(files) == 1  # one architecture: the best device's model ships
    meta = read_sidecar(files[0].path)
    view, norm = meta["view"], meta["normalisation"]
    assert view["kind"] == "features" and view["input_shape"] == [30] and view["output_shape"] == [15]
    cols = view["columns"]
    assert len(cols) == 15 == len(set(cols)) and len(norm["mean"]) == len(norm["std"]) == 15
    names = load_dataset("breast-cancer").feature_names  # the model's input i is the named column cols[i]
    assert norm["feature_names"] == [names[c] for c in cols]
    # judged on the samples its device held out (the run pooled train and test), never on ones it trained on
    held = load_model_file(meta["source"]["weights"])[1]["held_out_indices"]
    assert meta["test_set"].startswith("samples its run's devices held out") and meta["test_samples"] == len(held)
    assert meta["parity"]["samples"] == 128 > len(held)  # the files are compared with PyTorch on any real samples, not only those
    # what a phone does: raw scikit-learn features -> the view's columns -> standardised as the sidecar says
    ds = load_dataset("breast-cancer")
    mean, std = (np.asarray(v, dtype=np.float64) for v in ds.standardisation)
    pool_x, pool_y = np.concatenate([ds.x_train.numpy(), ds.x_test.numpy()]), np.concatenate([ds.y_train.numpy(), ds.y_test.numpy()])
    raw = pool_x[held].astype(np.float64) * std + mean
    x = ((raw[:, cols] - np.asarray(norm["mean"])) / np.asarray(norm["std"])).astype(np.float32)
    session = ort.InferenceSession(str(files[0].path))
    logits = np.concatenate([session.run(None, {"input": x[i : i + 1]})[0] for i in range(len(x))])
    assert float((logits.argmax(1) == pool_y[held]).mean()) == pytest.approx(meta["test_accuracy"])
    assert json.loads(session.get_modelmeta().custom_metadata_map["edgefl.view"])["columns"] == cols


def test_a_model_file_that_recorded_only_the_views_settings_is_refitted_from_the_runs_seed(chfl_run, tmp_path):
    device = sorted((chfl_run / "models").glob("client-*.safetensors"))[0]
    state, meta = load_model_file(device)
    fitted = meta["view"]
    meta["view"] = {"kind": "features", "fraction": 0.5}  # as edgefl wrote it before it recorded the fitted view
    old_run = RunDir.create(tmp_path / "old", "old", 0)
    (old_run.path / "run.json").write_text((chfl_run / "run.json").read_text())
    del meta["held_out_indices"]  # nor what its device held out: the test split it is judged on was partly trained on, said
    del meta["seed"]  # nor its run's seed (files name it since): the run directory's run.json gives it
    old_run.save_model(device.stem, state, meta)
    files = export_path(old_run.path / "models" / device.name, tmp_path / "out", formats=("onnx",), mobile_check=False)
    old = read_sidecar(files[0].path)
    assert old["view"]["columns"] == fitted["columns"] and old["test_set"].endswith("an optimistic accuracy")
    (old_run.path / "run.json").unlink()  # without the run's seed the view cannot be fitted again
    with pytest.raises(EdgeflError, match="does not record, and its run's seed or device is unknown"):
        export_path(old_run.path / "models" / device.name, tmp_path / "out2", formats=("onnx",), mobile_check=False)


def test_a_model_file_with_a_damaged_view_is_refused_before_any_export(chfl_run, tmp_path):
    device = sorted((chfl_run / "models").glob("client-*.safetensors"))[0]
    state, meta = load_model_file(device)
    meta["view"] = {**meta["view"], "columns": meta["view"]["columns"][:-1] + [99]}
    bad = RunDir.create(tmp_path / "bad", "bad", 0)
    bad.save_model(device.stem, state, meta)
    with pytest.raises(EdgeflError, match="view record is unusable: columns must hold indices below 30"):
        export_path(bad.path / "models" / device.name, tmp_path / "out", formats=("onnx",))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("field, value, message", [
    ("class_names", 7, "'class_names' is '7', not a list of names"),
    ("num_classes", [2], "'num_classes' is '[2]', not a class count"),
    ("model_options", [1], "'model_options' is '[1]', not an object of options"),
    ("input_shape", "abc", "'input_shape' is 'abc', not a list of one to three sizes"),
    ("held_out_indices", [-1], "'held_out_indices' is '[-1]', not a list of sample indices"),
    ("view", {"kind": "banana"}, "view record is unusable: kind: Input should be"),
    ("view", {"kind": "features", "fraction": 0.5, "columns": [1]}, "view record is unusable: input_shape is missing"),
    ("view", {"kind": "features"}, "view record is unusable: view 'features' needs fraction or count\n"),
    # the labels a phone shows come from the file, the measured accuracy from the data set's order
    ("class_names", ["benign", "malignant"], "names its classes otherwise than breast-cancer: class 0 is 'benign' in the file, 'malignant'"),
    ("run", 5, "'run' is '5', not a run id"),
])
def test_damaged_metadata_is_refused_naming_the_field(chfl_run, tmp_path, field, value, message):
    device = sorted((chfl_run / "models").glob("client-*.safetensors"))[0]
    state, meta = load_model_file(device)
    bad = RunDir.create(tmp_path / "bad", "bad", 0)
    bad.save_model(device.stem, state, {**meta, field: value})
    with pytest.raises(EdgeflError, match=re.escape(message)):
        export_path(bad.path / "models" / device.name, tmp_path / "out", formats=("onnx",))


def test_metadata_that_is_not_json_names_the_field(chfl_run, tmp_path):
    from safetensors.torch import save_file

    device = sorted((chfl_run / "models").glob("client-*.safetensors"))[0]
    state, meta = load_model_file(device)
    for raw in ("not json", "[" * 100_000 + "]" * 100_000, "9" * 5000):
        path = tmp_path / device.name
        save_file(state, str(path), metadata={**{k: json.dumps(v) for k, v in meta.items()}, "view": raw})
        with pytest.raises(EdgeflError, match="its metadata field 'view' is not the JSON edgefl writes"):
            export_path(path, tmp_path / "out", formats=("onnx",))


def test_a_run_export_goes_on_past_models_it_cannot_load_or_check_and_says_why_in_full(chfl_run, tmp_path):
    import shutil

    from tests.test_cli import edgefl

    run = tmp_path / "run"
    shutil.copytree(chfl_run, run)
    unfit, unloadable, *others = sorted((run / "models").glob("client-*.safetensors"))
    for path, view in ((unfit, {"kind": "features", "fraction": 0.5}), (unloadable, {"kind": "features", "columns": [99]})):
        state, meta = load_model_file(path)
        path.unlink()
        meta.pop("seed", None)  # a file from before model files named their run's seed
        RunDir(run).save_model(path.stem, state, {**meta, "view": view})
    (run / "run.json").write_text("{}")  # no seed: the settings-only view cannot be fitted again
    out = tmp_path / "out"
    res = edgefl("export", str(run), "--all", "--format", "onnx", "--out", str(out), timeout=600)
    assert res.returncode == 1, res.stderr
    total = len(list((run / "models").glob("*.safetensors")))
    assert f"2 of {total} models failed" in res.stderr
    # each reason whole, with its hint (the table's cell cuts them)
    assert "its run's seed or device is unknown" in res.stderr and "hint: export it from its run directory" in res.stderr
    assert "view record is unusable" in res.stderr and "hint: export it from a run of this edgefl version" in res.stderr
    exported = {p.name.split(".")[0] for p in out.glob("*.onnx")}
    assert unfit.stem not in exported and unloadable.stem not in exported and {p.stem for p in others} <= exported


def test_an_export_that_writes_nothing_leaves_no_empty_folder(chfl_run, tmp_path):
    import shutil

    from tests.test_cli import edgefl

    run = tmp_path / "run"
    shutil.copytree(chfl_run, run)
    # (exit 2: the data set passed fits no model, bad input)
    res = edgefl("export", str(run), "--format", "onnx", "--dataset", "digits", timeout=600)
    assert res.returncode == 2 and "was trained on a view of inputs of shape [30], but digits has [1, 8, 8]" in res.stderr
    assert not (run / "export").exists()


def test_a_chfl_device_on_a_fedhe_cnn_exports_with_the_bias_chfl_gave_its_head(tmp_path):
    raw = {"name": "chfl-cnn", "seed": 0, "rounds": 1, "method": {"name": "chfl", "embedding_dim": 32},
           "data": {"dataset": "digits", "partition": "iid", "min_samples": 20},
           "train": {"epochs": 1, "batch_size": 32, "lr": 0.003},
           "fleet": {"groups": [{"model": "fedhe-cnn-0", "count": 2, "options": {"width": 0.125, "feature_dim": 32},
                                 "view": {"kind": "crop", "size": 6}}]}}
    run = RunDir.create(tmp_path / "run", raw["name"], 0)
    Simulation(RunConfig.model_validate(raw), run, show_progress=False).run()
    files = export_path(run.path, tmp_path / "out", formats=("onnx",), dynamic_batch=False, mobile_check=False)
    meta = read_sidecar(files[0].path)
    assert meta["view"]["output_shape"] == [1, 6, 6] and meta["test_set"] == "the data set's test split"
    assert meta["parity"]["max_abs_diff"] < 1e-4
