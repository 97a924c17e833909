"""A device's model trained on its own view of the data (CHFL's feature subsets) exports with that
view: checked on what the device saw, and described so that a phone can build the same input."""

from __future__ import annotations

import json

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
    # what a phone does: raw scikit-learn features -> the view's columns -> standardised as the sidecar says
    ds = load_dataset("breast-cancer")
    mean, std = (np.asarray(v, dtype=np.float64) for v in ds.standardisation)
    raw = ds.x_test.numpy().astype(np.float64) * std + mean
    x = ((raw[:, cols] - np.asarray(norm["mean"])) / np.asarray(norm["std"])).astype(np.float32)
    session = ort.InferenceSession(str(files[0].path))
    batch = meta["batch"] if "batch" in meta else session.get_inputs()[0].shape[0]
    n = len(x) // batch * batch
    logits = np.concatenate([session.run(None, {"input": x[i : i + batch]})[0] for i in range(0, n, batch)])
    phone_accuracy = float((logits.argmax(1) == ds.y_test.numpy()[:n]).mean())
    assert abs(phone_accuracy - meta["test_accuracy"]) <= 1.0 / n + 1e-9  # the sidecar's accuracy counts the last padded batch too
    assert json.loads(session.get_modelmeta().custom_metadata_map["edgefl.view"])["columns"] == cols


def test_a_model_file_that_recorded_only_the_views_settings_is_refitted_from_the_runs_seed(chfl_run, tmp_path):
    device = sorted((chfl_run / "models").glob("client-*.safetensors"))[0]
    state, meta = load_model_file(device)
    fitted = meta["view"]
    meta["view"] = {"kind": "features", "fraction": 0.5}  # as edgefl wrote it before it recorded the fitted view
    old_run = RunDir.create(tmp_path / "old", "old", 0)
    (old_run.path / "run.json").write_text((chfl_run / "run.json").read_text())
    old_run.save_model(device.stem, state, meta)
    files = export_path(old_run.path / "models" / device.name, tmp_path / "out", formats=("onnx",), mobile_check=False)
    assert read_sidecar(files[0].path)["view"]["columns"] == fitted["columns"]
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
