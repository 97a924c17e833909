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
    assert sorted(f.path.name for f in files) == ["mlp.fedhe.train.pte", "mlp.pte", "mlp.train.pte"]
    assert read_sidecar(tmp_path / "mlp.fedhe.train.pte")["inputs_spec"][2]["shape"] == [32, 2]
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
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["global-mlp.fedhe.train.pte", "global-mlp.fedhe.train.pte.json",
                                                                   "global-mlp.pte", "global-mlp.pte.json",
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


def test_fedhes_program_matches_fedhes_loss_in_pytorch(cancer):
    """The FedHe program (cross-entropy + alpha x masked MSE to the server's class logits) against
    edgefl's own FedHe loss: loss and gradients after one runtime SGD step."""
    from executorch.extension.training import _load_for_executorch_for_training_from_buffer, get_sgd_optimizer

    from edgefl.algorithms.fedhe import masked_logit_loss

    net = _model("mlp", cancer)
    x, y = cancer.x_train[:16].contiguous(), cancer.y_train[:16].contiguous()
    prog = export_training_program(net, x, y, distill=True, num_classes=2)
    server = torch.tensor([[2.0, -1.0], [-0.5, 1.5]])
    mask = torch.tensor([True, False])  # the server has logits for class 0 only
    teacher, has, alpha = server[y], mask[y].float(), 0.7
    ce_logits = net(x)
    ref = torch.nn.functional.cross_entropy(ce_logits, y) + alpha * masked_logit_loss(ce_logits, teacher, has, "mse", 1.0)
    ref.backward()
    with torch.no_grad():
        want = {k: p - 0.1 * p.grad for k, p in net.named_parameters()}
    tm = _load_for_executorch_for_training_from_buffer(prog.buffer)
    loss, _ = tm.forward_backward("forward", (x, y, teacher, has, torch.tensor([alpha])))
    assert float(loss) == pytest.approx(float(ref), rel=RTOL, abs=ATOL)
    get_sgd_optimizer(tm.named_parameters(), 0.1, 0.0, 0.0, 0.0, False).step(tm.named_gradients())
    for p in prog.parameters:
        np.testing.assert_allclose(tm.named_parameters()[p["program_name"]].numpy(), want[p["state_dict_name"]].numpy(),
                                   rtol=RTOL, atol=ATOL, err_msg=p["state_dict_name"])


def test_fedhes_own_cnns_built_with_group_norm_export_and_train(fmnist, tmp_path):
    """A FedHe CNN (norm = "group": no batch norm) exports once its padding and stride-1 average
    pools are rewritten for the runtime's kernels; with dropout the runtime draws its own masks, so
    the gradients are checked on a dropout-free twin, both for the plain and the FedHe program."""
    torch.manual_seed(0)
    net = build_model("fedhe-cnn-0", num_classes=10, input_shape=(1, 28, 28), norm="group", width=0.25)
    src = from_module(net, "fedhe-cnn-0", 10, (1, 28, 28), norm="group", width=0.25)
    src.dataset = fmnist.name
    files = export_model(src, tmp_path, formats=("executorch-train",), dataset=fmnist, test_samples=64, latency_runs=0)
    assert sorted(f.path.name for f in files) == ["fedhe-cnn-0.fedhe.train.pte", "fedhe-cnn-0.pte", "fedhe-cnn-0.train.pte"]
    for name in ("fedhe-cnn-0.train.pte", "fedhe-cnn-0.fedhe.train.pte"):
        meta = read_sidecar(tmp_path / name)
        assert meta["step_parity"]["ok"] and meta["step_parity"]["checked_without_dropout"], meta["step_parity"]
        why = meta["rewritten_for_training"]
        assert any("average pool" in w for w in why.values()) and any("zero padding" in w for w in why.values()), why
