"""Export: every zoo model to ONNX and TFLite with parity against PyTorch on real inputs, int8 on a
trained model, metadata, the mobile-usability check, and the error cases."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("litert_torch")
pytest.importorskip("ai_edge_litert")

from edgefl.data import load_dataset
from edgefl.errors import EdgeflError
from edgefl.exporters import (
    ExportSourceError,
    ParityError,
    check_parity,
    export_model,
    export_path,
    from_module,
    load_weights_file,
    read_sidecar,
    sha256_file,
)
from edgefl.models import build_model, model_names
from edgefl.rundir import RunDir

# Small widths keep the suite quick; the ops (and so the exporters' paths) are those of the full nets.
SMALL = {"resnet": {"width": 0.125}, "fedhe-cnn": {"width": 0.125}, "vgg9": {"width": 0.0625}}


def small_options(name: str) -> dict:
    return next((v for k, v in SMALL.items() if name.startswith(k)), {})


@pytest.fixture(scope="module")
def fmnist():
    try:
        return load_dataset("fashion-mnist", download=False)
    except EdgeflError as exc:
        pytest.skip(f"Fashion-MNIST not installed: {exc}")


@pytest.fixture(scope="module")
def cancer():
    return load_dataset("breast-cancer")


def zoo_source(name: str, ds):
    torch.manual_seed(0)
    shape = tuple(ds.x_test.shape[1:])
    model = build_model(name, num_classes=ds.num_classes, input_shape=shape, **small_options(name))
    src = from_module(model, name, ds.num_classes, shape, **small_options(name))
    src.dataset = ds.name
    return src


@pytest.mark.parametrize("name", [n for n in model_names() if n != "mlp"])
def test_every_zoo_model_exports_to_both_formats_with_parity(name, fmnist, tmp_path):
    files = export_model(zoo_source(name, fmnist), tmp_path, test_samples=64, mobile_check=False, dataset=fmnist)
    formats = {(f.format, f.batch) for f in files}
    assert formats == {("onnx", 1), ("onnx", None), ("tflite", 1)}
    for f in files:
        assert f.parity is not None and f.parity.max_abs_diff <= 1e-5 + 1e-4 * 100
        if f.agreement is not None:
            assert f.agreement == 1.0
        assert read_sidecar(f.path)["parity"]["rtol"] == 1e-4


def test_tabular_mlp_exports(cancer, tmp_path):
    files = export_model(zoo_source("mlp", cancer), tmp_path, formats=("onnx", "tflite"), mobile_check=False, dataset=cancer)
    assert all(f.parity is not None for f in files)
    meta = read_sidecar(files[0].path)
    assert meta["normalisation"]["description"].startswith("each feature standardised")
    norm = meta["normalisation"]
    assert len(norm["mean"]) == len(norm["std"]) == 30 and norm["formula"] == "x[i] = (feature[i] - mean[i]) / std[i]"
    assert norm["feature_names"] == list(cancer.feature_names) and norm["feature_names"][0] == "mean radius"  # input i's column
    assert meta["inputs"][0]["layout"] == "NC" and meta["class_labels"] == list(cancer.class_names)


def trained_lenet(ds) -> torch.nn.Module:
    return trained("lenet5", ds, 1000)


def test_int8_of_a_trained_model_keeps_98_percent_of_accuracy(fmnist, tmp_path):
    src = from_module(trained_lenet(fmnist), "lenet5", 10, (1, 28, 28))
    src.dataset = "fashion-mnist"
    files = {f.path.name: f for f in export_model(src, tmp_path, int8=True, dataset=fmnist, test_samples=2000)}
    float_acc = files["lenet5.tflite"].accuracy
    assert float_acc > 0.75  # a real model, not chance
    for name in ("lenet5.int8.tflite", "lenet5.int8.onnx"):
        f = files[name]
        assert f.accuracy >= 0.98 * float_acc and f.agreement > 0.95
    meta = read_sidecar(files["lenet5.int8.tflite"].path)
    io_in, io_out = meta["inputs"][0], meta["outputs"][0]
    assert io_in["dtype"] == "int8" and io_in["scale"] > 0 and -128 <= io_in["zero_point"] <= 127
    assert io_out["dtype"] == "int8" and "dequantize" in io_out
    assert meta["float_test_accuracy"] == pytest.approx(float_acc)
    assert files["lenet5.int8.tflite"].path.stat().st_size < 0.5 * files["lenet5.tflite"].path.stat().st_size


def test_fixed_shape_onnx_passes_the_mobile_usability_check_and_dynamic_does_not(fmnist, tmp_path):
    files = export_model(zoo_source("cnn-small", fmnist), tmp_path, formats=("onnx",), test_samples=64, dataset=fmnist)
    fixed = next(f for f in files if f.batch == 1)
    verdict = fixed.extra["mobile_usability"]
    assert verdict["usable"] and "nnapi" in verdict["usable_with"] and verdict["dynamic_inputs"] == []
    assert verdict["nnapi"]["supported_nodes"] == verdict["nnapi"]["nodes"]
    assert "mobile_usability" not in next(f for f in files if f.batch is None).extra
    assert read_sidecar(fixed.path)["mobile_usability"]["nnapi"]["verdict"] in ("YES", "MAYBE")


def test_metadata_round_trips_and_detects_a_changed_file(fmnist, tmp_path):
    files = export_model(zoo_source("lenet5", fmnist), tmp_path, formats=("tflite",), batch=4, channels_last=True, test_samples=64, dataset=fmnist)
    f = files[0]
    meta = read_sidecar(f.path)
    assert meta["inputs"][0]["shape"] == [4, 28, 28, 1] and meta["inputs"][0]["layout"] == "NHWC"
    assert meta["class_labels"] == list(fmnist.class_names)  # a bare module takes the dataset's names
    assert meta["parameters"] == 44426 and meta["flops_per_sample"] > 0
    assert meta["exporter_versions"]["litert-torch"] and meta["normalisation"]["scale"] == pytest.approx(1 / 255)
    data = f.path.read_bytes()
    f.path.write_bytes(data[:-10] + b"0123456789")
    with pytest.raises(EdgeflError, match="SHA-256"):
        read_sidecar(f.path)


def test_decoder_channels_last_output(fmnist, tmp_path):
    files = export_model(zoo_source("cvae-large", fmnist), tmp_path, formats=("tflite",), channels_last=True)
    meta = read_sidecar(files[0].path)
    assert meta["outputs"][0]["shape"] == [1, 28, 28, 1]
    assert [i["name"] for i in meta["inputs"]] == ["z", "y_onehot"]


def test_run_directory_export_carries_run_and_round(fmnist, tmp_path):
    run = RunDir.create(tmp_path / "run", "x", 0)
    model = build_model("cnn-small", num_classes=10, input_shape=(1, 28, 28))
    run.save_model("global-cnn-small", model.state_dict(), {
        "model": "cnn-small", "model_options": {}, "num_classes": 10, "input_shape": [1, 28, 28],
        "class_names": list(fmnist.class_names), "dataset": "fashion-mnist", "round": 7, "arch": "cnn-small"})
    files = export_path(run.path, formats=("onnx",), dynamic_batch=False, test_samples=64, mobile_check=False)
    meta = read_sidecar(files[0].path)
    assert files[0].path.parent == run.path / "export"
    assert meta["source"]["round"] == 7 and meta["source"]["run"] == str(run.path)
    assert meta["class_labels"] == list(fmnist.class_names)
    assert meta["source"]["weights_sha256"] == sha256_file(run.path / "models" / "global-cnn-small.safetensors")
    assert meta["edgefl_version"] and meta["opset"] >= 18


# --- bad input --------------------------------------------------------------------------------
def test_weights_of_another_architecture_are_refused(tmp_path):
    from safetensors.torch import save_file

    state = build_model("lenet5", num_classes=10, input_shape=(1, 28, 28)).state_dict()
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"model": json.dumps("cnn-small")})
    with pytest.raises(ExportSourceError, match="not a cnn-small"):
        load_weights_file(path)
    bare = tmp_path / "bare.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(bare))
    with pytest.raises(ExportSourceError, match="--model"):
        load_weights_file(bare)
    assert load_weights_file(bare, model="lenet5").model == "lenet5"


def test_corrupt_weights_file_is_refused(tmp_path):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ExportSourceError, match="not a readable safetensors"):
        load_weights_file(path)


def test_parity_failure_names_the_worst_output():
    import numpy as np

    ref = np.zeros((3, 4), dtype=np.float32)
    got = ref.copy()
    got[2, 1] = 0.5
    with pytest.raises(ParityError, match=r"output\[2, 1\] is 0.5"):
        check_parity("m.onnx", ref, got)


def test_unsupported_op_is_a_clear_error_and_leaves_no_file(fmnist, tmp_path):
    class Weird(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.svd(x.flatten(1)[:, :10].reshape(-1, 2, 5)).S.flatten(1)

    src = from_module(build_model("lenet5", num_classes=10, input_shape=(1, 28, 28)), "lenet5", 10, (1, 28, 28))
    src.module, src.dataset = Weird(), "fashion-mnist"
    with pytest.raises(EdgeflError) as info:
        export_model(src, tmp_path, formats=("tflite",), test_samples=16, dataset=fmnist)
    assert "could not convert" in str(info.value) or "parity" in str(info.value).lower()
    assert not list(tmp_path.glob("*.tflite"))


def test_unknown_format_and_bad_batch_are_clear_errors(fmnist, tmp_path):
    from edgefl.exporters import ExportError

    src = zoo_source("cnn-small", fmnist)
    with pytest.raises(ExportError, match="unknown export format"):
        export_model(src, tmp_path, formats=("onnx", "coreml"), dataset=fmnist)
    with pytest.raises(ExportError, match="--batch must be at least 1"):
        export_model(src, tmp_path, batch=0, dataset=fmnist)
    assert not list(tmp_path.iterdir())


# --- what a phone developer ships ---------------------------------------------------------------
def raw_pixels(ds, n: int):
    """8-bit pixels as a camera gives them (the dataset holds them / 255)."""
    import numpy as np

    return np.round(ds.x_test[:n, 0].numpy() * 255).astype(np.uint8)


def trained(name: str, ds, steps: int, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, input_shape=(1, 28, 28), **options)
    opt = torch.optim.Adam(model.parameters(), 2e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(ds.y_train), (64,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(ds.x_train[idx]), ds.y_train[idx]).backward()
        opt.step()
    return model.eval()


def test_an_app_that_knows_only_the_sidecar_gets_pytorchs_answers(fmnist, tmp_path):
    """Each file run the way its sidecar says (names, layout, dtype, quantisation, normalisation,
    labels) through ONNX Runtime or the LiteRT signature runner."""
    from tests import sidecar_app

    model = trained("lenet5", fmnist, 300)
    src = from_module(model, "lenet5", 10, (1, 28, 28), dataset="fashion-mnist")
    files = export_model(src, tmp_path, int8=True, dataset=fmnist, test_samples=256, mobile_check=False)
    raw = raw_pixels(fmnist, 300)
    with torch.no_grad():
        want = [fmnist.class_names[i] for i in model(fmnist.x_test[:300]).argmax(1)]
    for f in files:
        got = sidecar_app.predict(f.path, raw)
        same = sum(a == b for a, b in zip(got, want)) / len(want)
        assert same >= (1.0 if f.precision == "float32" else 0.97), (f.path.name, same)
    tfl = sidecar_app.load(tmp_path / "lenet5.tflite")
    assert tfl["signature_key"] == "serving_default" and tfl["inputs"][0]["name"] == "input" and tfl["outputs"][0]["name"] == "logits"
    assert tfl["inputs"][0]["tensor"] == "serving_default_input" and isinstance(tfl["inputs"][0]["index"], int)
    import onnxruntime as ort

    props = ort.InferenceSession(str(tmp_path / "lenet5.onnx")).get_modelmeta().custom_metadata_map
    assert "edgefl.run" not in props and "edgefl.seed" not in props  # unknown facts are left out, not written empty


def test_tflite_is_channels_last_by_default_and_onnx_stays_nchw(fmnist, tmp_path):
    files = {f.path.name: f for f in export_model(zoo_source("cnn-small", fmnist), tmp_path, dynamic_batch=False, test_samples=32,
                                                   mobile_check=False, dataset=fmnist)}
    assert read_sidecar(files["cnn-small.tflite"].path)["inputs"][0]["layout"] == "NHWC"
    assert read_sidecar(files["cnn-small.tflite"].path)["inputs"][0]["shape"] == [1, 28, 28, 1]
    assert read_sidecar(files["cnn-small.onnx"].path)["inputs"][0]["layout"] == "NCHW"
    nchw = export_model(zoo_source("cnn-small", fmnist), tmp_path / "nchw", formats=("tflite",), channels_last=False,
                        test_samples=32, dataset=fmnist)
    assert read_sidecar(nchw[0].path)["inputs"][0]["shape"] == [1, 1, 28, 28]


def test_int8_resnet_is_integer_only_residual_adds_included(fmnist, tmp_path):
    from edgefl.exporters.tflite_model import list_ops

    model = trained("resnet10", fmnist, 150, width=0.125)
    src = from_module(model, "resnet10", 10, (1, 28, 28), dataset="fashion-mnist", width=0.125)
    files = {f.path.name: f for f in export_model(src, tmp_path, formats=("tflite",), int8=True, dataset=fmnist, test_samples=500)}
    f = files["resnet10.int8.tflite"]
    listing = list_ops(f.path)
    assert listing.integer_only and listing.counts["ADD"] == 4, listing.counts
    for op in listing.ops:
        assert set(op["inputs"] + op["outputs"]) <= {"int8", "int32"}, op
    assert f.accuracy >= 0.98 * files["resnet10.tflite"].accuracy
    meta = read_sidecar(f.path)
    assert meta["integer_only"] and meta["ops"]["counts"]["ADD"] == 4
    assert meta["inputs"][0]["dtype"] == meta["outputs"][0]["dtype"] == "int8"


def test_files_describe_themselves_onnx_metadata_and_tflite_metadata(fmnist, tmp_path):
    import onnxruntime as ort

    from edgefl.exporters.tflite_model import read_metadata

    run = RunDir.create(tmp_path / "run", "x", 0)
    run.write_json("run.json", {"name": "phone-run", "method": "fedavg", "seed": 5})
    model = build_model("lenet5", num_classes=10, input_shape=(1, 28, 28))
    run.save_model("global-lenet5", model.state_dict(), {
        "model": "lenet5", "model_options": {}, "num_classes": 10, "input_shape": [1, 28, 28],
        "class_names": list(fmnist.class_names), "dataset": "fashion-mnist", "round": 12, "arch": "lenet5"})
    files = {f.path.name: f for f in export_path(run.path, dynamic_batch=False, test_samples=32, mobile_check=False)}
    meta = ort.InferenceSession(str(files["global-lenet5.onnx"].path)).get_modelmeta()
    props = meta.custom_metadata_map
    assert meta.version == 12 and "lenet5" in meta.description and "x = value / 255" in meta.description
    assert props["edgefl.run"] == "phone-run" and props["edgefl.method"] == "fedavg" and props["edgefl.seed"] == "5"
    assert json.loads(props["edgefl.labels"]) == list(fmnist.class_names) and props["edgefl.layout"] == "NCHW"
    assert props["edgefl.weights_sha256"] == sha256_file(run.path / "models" / "global-lenet5.safetensors")
    tfl = read_metadata(files["global-lenet5.tflite"].path)
    assert tfl["labels"] == list(fmnist.class_names) and tfl["author"] == "edgefl"
    assert tfl["inputs"][0]["content"] == "image" and tfl["inputs"][0]["std"] == [255.0]
    assert tfl["outputs"][0]["associated_files"] == ["labels.txt"]
    side = read_sidecar(files["global-lenet5.tflite"].path)
    assert side["source"]["run_name"] == "phone-run" and side["source"]["seed"] == 5 and side["source"]["method"] == "fedavg"
    assert side["latency"]["median_ms"] > 0 and side["latency"]["threads"] == 1


def test_micro_writes_a_c_array_the_resolver_and_a_measured_arena(fmnist, tmp_path):
    src = from_module(trained("cnn-small", fmnist, 100), "cnn-small", 10, (1, 28, 28), dataset="fashion-mnist")
    files = {f.path.name: f for f in export_model(src, tmp_path, formats=("tflite",), micro=True, dataset=fmnist, test_samples=200)}
    micro = files["cnn-small.int8.tflite"].extra["micro"]
    assert 1024 < micro["arena_bytes"] < 1 << 20 and micro["arena_bytes"] % 256 == 0
    assert "resolver.AddConv2D();" in micro["resolver"] and micro["top1_agreement_with_litert"] >= 0.99
    header = (tmp_path / "cnn-small.int8.h").read_text()
    size = (tmp_path / "cnn-small.int8.tflite").stat().st_size
    assert f"cnn_small_int8_tflite_len = {size};" in header and "alignas(16) const unsigned char cnn_small_int8_tflite[]" in header
    assert read_sidecar(tmp_path / "cnn-small.int8.tflite")["micro"]["c_header"] == "cnn-small.int8.h"


# --- atomic exports -----------------------------------------------------------------------------
def test_a_failed_export_keeps_the_previous_set_and_leaves_nothing_partial(fmnist, tmp_path, monkeypatch):
    from edgefl.exporters import export as export_module

    src = zoo_source("cnn-small", fmnist)
    export_model(src, tmp_path, formats=("onnx",), dynamic_batch=False, test_samples=32, mobile_check=False, dataset=fmnist)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("edgefl.exporters.tflite_export.convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_model(src, tmp_path, test_samples=32, mobile_check=False, dataset=fmnist)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no half set, no staging folder
    monkeypatch.undo()

    import errno

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_module, "write_sidecar", disk_full)
    with pytest.raises(EdgeflError) as info:
        export_model(src, tmp_path, formats=("onnx",), test_samples=32, mobile_check=False, dataset=fmnist)
    assert "No space left on device" in info.value.message and "disk is full" in info.value.hint
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_reexport_replaces_the_whole_set(fmnist, tmp_path):
    src = zoo_source("cnn-small", fmnist)
    export_model(src, tmp_path, formats=("onnx",), int8=True, test_samples=32, mobile_check=False, dataset=fmnist)
    assert (tmp_path / "cnn-small.int8.onnx.json").exists()
    export_model(src, tmp_path, formats=("onnx",), dynamic_batch=False, test_samples=32, mobile_check=False, dataset=fmnist)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cnn-small.onnx", "cnn-small.onnx.json"]


def test_vgg_pool_before_its_fc_is_folded_exactly_for_int8():
    """VGG-9's adaptive pool enlarges a 3x3 map to 7x7, which the converter left in float; for the
    file's input size it folds into the FC that follows (bench/export_int8_zoo.py: integer-only)."""
    from edgefl.exporters.residual import quantisable

    torch.manual_seed(0)
    model = build_model("vgg9", num_classes=10, input_shape=(1, 28, 28), width=0.125).eval()
    x = torch.randn(8, 1, 28, 28)
    folded = quantisable(model, (x[:1],))
    with torch.no_grad():
        assert torch.allclose(folded(x), model(x), atol=1e-5)
    assert not any(isinstance(m, torch.nn.AdaptiveAvgPool2d) for m in folded.modules())
    assert any(isinstance(m, torch.nn.AdaptiveAvgPool2d) for m in model.modules())  # the caller's model is untouched
