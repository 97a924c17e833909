"""Export formats come from a registry: a format of one's own registers from a test file alone and
runs through the same job (checks against PyTorch, sidecar, all-or-nothing staging) as the
built-in ones; an unknown name is an error with the nearest known one."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from edgefl.cli import app
from edgefl.data import load_dataset
from edgefl.exporters import export_path, read_sidecar, registry
from edgefl.exporters.registry import ExportContext, ExportedFile, ExportError, ExportFormat, Requirement, get_format, register_format
from edgefl.models import build_model
from edgefl.rundir import RunDir


@register_format
class NpzFormat(ExportFormat):
    """The state dict as NAME.npz: arrays only, read back without pickle."""

    name = "npz"
    summary = "the state dict as NAME.npz (a test's toy format)"
    suffixes = (".npz",)
    requires = (Requirement(("numpy",), "numpy"),)

    def export(self, job: ExportContext, folder: Path) -> list[ExportedFile]:
        path = folder / f"{job.src.name}.npz"
        np.savez(path, **{k: v.detach().cpu().numpy() for k, v in job.module.state_dict().items()})
        f = ExportedFile(path, "npz", "float32", None, extra={"arrays": len(job.module.state_dict())})
        job.judge(f, _runner(job.module, path))  # the file itself is checked: a fresh model loaded from it must match
        return [f]


def _runner(module: torch.nn.Module, path: Path):
    fresh = copy.deepcopy(module)
    with np.load(path, allow_pickle=False) as arrays:
        fresh.load_state_dict({k: torch.from_numpy(arrays[k]) for k in arrays.files})

    def run(*inputs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return fresh(*(torch.from_numpy(a) for a in inputs)).numpy()

    return run


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A run directory holding a small MLP trained on the breast-cancer table (no download)."""
    ds = load_dataset("breast-cancer")
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=ds.num_classes, input_shape=(30,))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(60):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(ds.x_train), ds.y_train).backward()
        opt.step()
    run = RunDir.create(tmp_path_factory.mktemp("runs") / "run", "tiny", 0)
    run.save_model("global-mlp", model.state_dict(), {
        "model": "mlp", "model_options": {}, "num_classes": ds.num_classes, "input_shape": [30],
        "class_names": list(ds.class_names), "dataset": ds.name, "round": 3, "arch": "mlp"})
    return run.path


def test_a_format_registered_from_a_test_file_exports_a_trained_run(trained_run):
    files = export_path(trained_run, formats=("npz",), test_samples=64, latency_runs=2)
    assert [f.path.name for f in files] == ["global-mlp.npz"] and files[0].path.parent == trained_run / "export"
    saved = load_file(str(trained_run / "models" / "global-mlp.safetensors"))
    with np.load(files[0].path, allow_pickle=False) as arrays:
        assert sorted(arrays.files) == sorted(saved)
        for key, tensor in saved.items():
            assert np.array_equal(arrays[key], tensor.numpy()), key
    meta = read_sidecar(files[0].path)  # the job's sidecar, SHA-256 checked
    assert meta["format"] == "npz" and meta["arrays"] == len(saved) and meta["source"]["round"] == 3
    assert meta["parity"]["max_abs_diff"] == 0.0 and meta["test_accuracy"] == meta["pytorch_test_accuracy"] > 0.85
    assert meta["class_labels"] == ["malignant", "benign"] and meta["inputs"] is None  # no runtime to report tensors


def test_a_reexport_in_another_format_replaces_the_toy_formats_files_too(trained_run, tmp_path):
    pytest.importorskip("onnxruntime")
    export_path(trained_run, tmp_path, formats=("npz",), test_samples=64, latency_runs=0)
    export_path(trained_run, tmp_path, formats=("onnx",), dynamic_batch=False, mobile_check=False, test_samples=64, latency_runs=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global-mlp.onnx", "global-mlp.onnx.json"]


def test_an_unknown_format_name_gets_the_nearest_one(trained_run, tmp_path):
    assert get_format("npz") is NpzFormat
    with pytest.raises(ExportError, match=r"unknown export format 'npzz' \(did you mean 'npz'\?\)") as info:
        export_path(trained_run, tmp_path / "out", formats=("onnx", "npzz"))
    assert "npz" in info.value.hint and "onnx" in info.value.hint
    assert not (tmp_path / "out").exists()
    res = CliRunner().invoke(app, ["export", str(trained_run), "--format", "onnx,tflit"])
    assert isinstance(res.exception, ExportError) and "did you mean 'tflite'" in str(res.exception)


def test_a_missing_dependency_is_refused_before_any_work_with_the_install_line(trained_run, monkeypatch):
    monkeypatch.setattr(registry, "FORMATS", dict(registry.FORMATS))  # this format is gone after the test

    @register_format
    class Needy(NpzFormat):
        name = "needy"
        requires = (Requirement(("edgefl_no_such_module",), "edgefl-no-such-module", hint="pip install edgefl-no-such-module"),)

    with pytest.raises(ExportError, match="the needy export format needs edgefl-no-such-module") as info:
        export_path(trained_run, trained_run / "needy-out", formats=("needy",))
    assert info.value.hint == "pip install edgefl-no-such-module" and not (trained_run / "needy-out").exists()


def test_the_registry_names_the_built_in_formats_and_checks_what_is_registered():
    assert registry.format_names()[:3] == ["onnx", "tflite", "micro"]
    assert [c.name for c in registry.chosen_formats(["micro", "tflite", "onnx", "tflite"])] == ["tflite", "onnx", "micro"]
    with pytest.raises(ExportError, match="builds on the tflite format"):
        registry.chosen_formats(["onnx", "micro"])
    with pytest.raises(ValueError, match="already registered"):
        register_format(type("Other", (NpzFormat,), {}))
    res = CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and all(f"{name}: " in res.output for name in ("onnx", "tflite", "micro"))
