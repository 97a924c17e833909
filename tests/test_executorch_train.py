"""Issue 37: the executorch-train export format writes a training program, an inference program and
sidecars; one SGD step in ExecuTorch's runtime matches the same step in PyTorch for two zoo models;
a model ExecuTorch's training path cannot take is refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("executorch")

from edgefl.data import load_dataset
from edgefl.errors import EdgeflError
from edgefl.exporters import export_model, from_module, read_sidecar
from edgefl.exporters.executorch_train import (
    RuntimeTrainer,
    TrainStep,
    export_training_program,
    trainability,
)
from edgefl.exporters.registry import ExportError
from edgefl.models import build_model

#: stated tolerance of the step parity (float32, the runtime's portable kernels vs PyTorch's)
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def cancer():
    return load_dataset("breast-cancer")


@pytest.fixture(scope="module")
def fmnist():
    try:
        return load_dataset("fashion-mnist", download=False)
    except EdgeflError as exc:
        pytest.skip(f"Fashion-MNIST not installed: {exc}")


def _model(name, ds):
    torch.manual_seed(0)
    return build_model(name, num_classes=ds.num_classes, input_shape=tuple(ds.x_train.shape[1:]))


@pytest.mark.parametrize("name,data", [("mlp", "cancer"), ("lenet5", "fmnist")])
def test_one_step_in_the_runtime_matches_pytorch(name, data, request):
    ds = request.getfixturevalue(data)
    net = _model(name, ds)
    x, y = ds.x_train[:16].contiguous(), ds.y_train[:16].contiguous()
    prog = export_training_program(net, x, y)
    assert [p["state_dict_name"] for p in prog.parameters] == [k for k, _ in net.named_parameters()]
    ref = TrainStep(net).train()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    rt = RuntimeTrainer(prog.buffer, lr=0.05, momentum=0.9)
    for step in range(3):  # three steps: momentum's buffer is used from the second on
        opt.zero_grad()
        loss, logits = ref(x, y)
        loss.backward()
        opt.step()
        rt_loss, rt_logits = rt.step(x.numpy(), y.numpy())
        assert rt_loss == pytest.approx(float(loss), rel=RTOL, abs=ATOL), step
        np.testing.assert_allclose(rt_logits, logits.detach().numpy(), rtol=RTOL, atol=1e-4)
    got = rt.parameters()
    for p in prog.parameters:
        want = dict(net.named_parameters())[p["state_dict_name"]].detach().numpy()
        np.testing.assert_allclose(got[p["program_name"]], want, rtol=RTOL, atol=ATOL, err_msg=p["state_dict_name"])


def test_the_format_writes_both_programs_and_a_sidecar_naming_the_parameters(cancer, tmp_path):
    net = _model("mlp", cancer)
    src = from_module(net, "mlp", cancer.num_classes, (30,))
    src.dataset = cancer.name
    files = export_model(src, tmp_path, formats=("executorch-train",), dataset=cancer, test_samples=64, latency_runs=2)
    assert sorted(f.path.name for f in files) == ["mlp.pte", "mlp.train.pte"]
    train = read_sidecar(tmp_path / "mlp.train.pte")
    assert train["program"] == "training" and train["inputs_spec"][0]["shape"] == [32, 30]
    assert train["inputs_spec"][1] == {"name": "labels", "shape": [32], "dtype": "int64"}
    assert [p["state_dict_name"] for p in train["parameters_order"]] == [k for k, _ in net.named_parameters()]
    assert train["optimizer"]["name"] == "sgd" and train["optimizer"]["lr"] > 0 and "momentum" in train["optimizer"]
    assert train["step_parity"]["ok"] and train["normalisation"]["formula"].startswith("x[i]")
    assert train["class_labels"] == list(cancer.class_names)
    inf = read_sidecar(tmp_path / "mlp.pte")
    assert inf["program"] == "inference" and inf["parity"]["max_abs_diff"] < 1e-4 and inf["top1_agreement_with_pytorch"] == 1.0


def test_a_model_with_batch_norm_is_refused_with_the_reason(tmp_path):
    ok, reason = trainability("fedhe-cnn-0")
    assert not ok and "batch_norm" in reason and "Core ATen" in reason
    torch.manual_seed(0)
    net = build_model("fedhe-cnn-0", num_classes=10, input_shape=(1, 28, 28))
    with pytest.raises(ExportError, match="cannot export a training program: .*batch_norm") as info:
        export_training_program(net, torch.randn(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))
    assert "group" in info.value.hint
    assert trainability("lenet5") == (True, "yes") and trainability("mlp", 2, (30,)) == (True, "yes")


def test_the_command_line_exports_a_run_and_lists_which_models_train_on_phones(cancer, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from edgefl.cli import app
    from edgefl.exporters import executorch_train
    from edgefl.rundir import RunDir

    net = _model("mlp", cancer)
    run = RunDir.create(tmp_path / "runs" / "run", "tiny", 0)
    run.save_model("global-mlp", net.state_dict(), {
        "model": "mlp", "model_options": {}, "num_classes": 2, "input_shape": [30],
        "class_names": list(cancer.class_names), "dataset": cancer.name, "round": 1, "arch": "mlp"})
    res = CliRunner().invoke(app, ["export", str(run.path), "--format", "executorch-train", "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["global-mlp.pte", "global-mlp.pte.json",
                                                                   "global-mlp.train.pte", "global-mlp.train.pte.json"]
    # edgefl models --phones: the column says yes or the reason (measured here for two models only: the
    # zoo's big models take minutes to export)
    verdicts = {"lenet5": (True, "yes"), "fedhe-cnn-0": trainability("fedhe-cnn-0")}
    monkeypatch.setattr(executorch_train, "trainability", lambda name, *a: verdicts.get(name, (False, "not measured")))
    res = CliRunner().invoke(app, ["models", "--phones"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    line = {ln.split("│")[1].strip(): ln for ln in res.output.splitlines() if ln.count("│") > 3}
    assert line["lenet5"].rstrip(" │").endswith("yes") and "no: Operator" in line["fedhe-cnn-0"]
    assert "batch_norm" in res.output.replace("│", "").replace(" ", "").replace("\n", "")  # the reason, wrapped in its cell
