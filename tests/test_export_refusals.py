"""What `edgefl export` says of a file it cannot export as it is (an outside trial's findings): each
refusal names what is wrong with the file itself and what to do, never a hint that points elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgefl.errors import EdgeflError
from edgefl.exporters import load_weights_file
from edgefl.models import build_model

META = {"model": "mlp", "model_options": {"hidden": [16]}, "num_classes": 2, "input_shape": [30],
        "class_names": ["malignant", "benign"], "method": "fedhe", "client_id": "client-2", "run": "run-a"}


def _device_file(path, **changed) -> str:
    """A device's model file as a fleet device writes it: its task names no data set."""
    torch.manual_seed(0)
    state = build_model("mlp", num_classes=2, input_shape=(30,), hidden=[16]).state_dict()
    meta = {**META, **changed}
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={k: json.dumps(v) for k, v in meta.items()})
    return str(path)


def test_a_device_file_without_a_data_set_is_a_usage_error_saying_where_the_name_is(tmp_path):
    path = _device_file(tmp_path / "model.safetensors")
    run = subprocess.run([sys.executable, "-m", "edgefl", "export", path, "--format", "onnx"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "COLUMNS": "200"})
    said = " ".join(run.stderr.split())
    assert run.returncode == 2, run.stderr[-2000:]  # bad input, before any model is exported
    # a device's file exports under its device's name, not "model" (many devices' files end up side by side)
    assert "no dataset to check the export of client-2-mlp on" in said and "--dataset NAME" in said and "ship.json" in said
    assert not (tmp_path / "export").exists()


def test_metadata_changed_after_the_fact_is_named_as_such_not_as_a_wrong_model(tmp_path):
    with pytest.raises(EdgeflError) as caught:  # the shape edited: the weights no longer fit what the metadata builds
        load_weights_file(_device_file(tmp_path / "shape.safetensors", input_shape=[1, 28, 28]))
    assert "as its metadata describes it" in caught.value.message and "restore the file from a copy" in caught.value.hint
    assert "--model" not in caught.value.hint
    # a caller's own --model that does not fit is still told to pass the right one
    state = load_file(_device_file(tmp_path / "bare.safetensors"))
    save_file(state, str(tmp_path / "bare.safetensors"))  # no metadata at all
    with pytest.raises(EdgeflError) as caught:
        load_weights_file(tmp_path / "bare.safetensors", model="mlp", model_options={"hidden": [32]}, num_classes=2, input_shape=(30,))
    assert "as its metadata" not in caught.value.message and "(--model)" in caught.value.hint
    # class names too long are called that, not "not a list"
    with pytest.raises(EdgeflError, match="not a list of names of at most 200 characters each"):
        load_weights_file(_device_file(tmp_path / "long.safetensors", class_names=["x" * 5000, "y"]))


def test_a_wrong_data_set_for_a_runs_model_is_not_told_about_device_views(tmp_path):
    from edgefl.data import load_dataset
    from edgefl.exporters.export import prepare_inputs

    src = load_weights_file(_device_file(tmp_path / "shared.safetensors", client_id=None, dataset="breast-cancer"))
    with pytest.raises(EdgeflError) as caught:
        prepare_inputs(src, load_dataset("digits"))
    assert "takes inputs of shape [30], but digits has [1, 8, 8]" in caught.value.message
    assert "view" not in caught.value.hint
    # a fleet device's file (it names its run) records any view it had: a plain wrong data set, said so
    fleet_device = load_weights_file(_device_file(tmp_path / "fleet.safetensors"))
    with pytest.raises(EdgeflError) as caught:
        prepare_inputs(fleet_device, load_dataset("digits"))
    assert "view" not in caught.value.hint
    # a device's file without a run id may come from a version that did not record views
    older = load_weights_file(_device_file(tmp_path / "device.safetensors", run=None))
    with pytest.raises(EdgeflError) as caught:
        prepare_inputs(older, load_dataset("digits"))
    assert "fleet.groups[].view" in caught.value.hint


def test_a_device_file_names_its_runs_seed_and_a_bad_one_is_refused(tmp_path):
    assert load_weights_file(_device_file(tmp_path / "model.safetensors", seed=7)).seed == 7  # the sidecar's source.seed
    with pytest.raises(EdgeflError, match="'seed' is '-1', not a seed"):
        load_weights_file(_device_file(tmp_path / "bad.safetensors", seed=-1))


@pytest.mark.parametrize(("formats", "int8", "said", "unsaid"), [
    (("onnx",), True, ["int8 ONNX"], ["TFLite"]),
    (("onnx",), False, [], ["int8"]),
    (("tflite",), True, ["int8 TFLite files are integer-only"], ["ONNX"]),
    (("onnx", "tflite"), True, ["int8 TFLite", "int8 ONNX"], []),
])
def test_the_exports_footer_speaks_only_of_files_it_wrote(formats, int8, said, unsaid):
    from edgefl.cli import _export_footer

    footer = _export_footer(formats, int8)
    assert "float files match PyTorch" in footer and "sidecar" in footer
    assert all(s in footer for s in said) and not any(u in footer for u in unsaid)
