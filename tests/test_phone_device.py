"""Issue 37: a phone-runtime device (examples/phone_device.py: ExecuTorch's runtime, paho-mqtt,
numpy and the wire codec only) joins a real FedAvg or FedHe fleet over mosquitto beside `edgefl client`
devices, trains with the exported training program on its own data share and is counted by the
server like any other device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("executorch")

from edgefl import build
from edgefl.build import device_slots, federation_name, load_run_dataset
from edgefl.config import RunConfig
from edgefl.exporters import export_model, from_module
from edgefl.models import build_model
from tests.conftest import digits_config
from tests.mosquitto import mosquitto
from tests.test_fleet import _device, _server_thread, wait_online

ROOT = Path(__file__).resolve().parents[1]
PHONE = "client-2"


def _config(method: str = "fedavg") -> RunConfig:
    raw = digits_config(method, rounds=2)
    raw["name"] = f"phone-fleet-{method}"
    raw["train"] = {"epochs": 1, "batch_size": 32, "optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "lr_milestones": [0.5]}
    raw["fleet"] = {"groups": [{"model": "mlp", "count": 3, "options": {"hidden": [32, 16]}}]}
    raw["network"] = {"round_deadline_s": 90}
    raw["threads"] = 1
    return RunConfig.model_validate(raw)


def _phone_files(cfg: RunConfig, out: Path, program: str = ".train.pte") -> tuple[Path, Path]:
    """What the phone is given: its training program (exported from its group's model) and its data share."""
    ds = load_run_dataset(cfg)
    slot = next(s for s in device_slots(cfg, ds) if s.client_id == PHONE)
    torch.manual_seed(0)
    model = build_model(slot.model, num_classes=ds.num_classes, input_shape=slot.input_shape(ds), **slot.model_options)
    src = from_module(model, slot.model, ds.num_classes, slot.input_shape(ds), **slot.model_options)
    src.dataset = ds.name
    files = export_model(src, out, formats=("executorch-train",), dataset=ds, test_samples=64, latency_runs=0)
    program = next(f.path for f in files if f.path.name == f"{src.name}{program}")
    idx = torch.from_numpy(slot.sample_indices)
    x_test, y_test = build.test_subset(cfg, ds)
    share = out / f"{PHONE}.npz"
    np.savez(share, x_train=ds.model_input(ds.x_train[idx]).numpy(), y_train=ds.y_train[idx].numpy(),
             x_test=x_test.numpy(), y_test=y_test.numpy())
    return program, share


@pytest.mark.parametrize("method,program", [("fedavg", ".train.pte"), ("fedhe", ".fedhe.train.pte")])
def test_a_phone_runtime_device_is_counted_in_a_fleet(method, program, tmp_path):
    """FedAvg: the phone starts from the global weights and uploads its trained ones. FedHe: it keeps
    its own model, distils toward the server's class logits from round 2 and uploads its per-class
    logits from the program's outputs."""
    cfg = _config(method)
    program, share = _phone_files(cfg, tmp_path / "phone", program)
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    fed = federation_name(cfg)
    report = tmp_path / "phone-report.json"
    with mosquitto(tmp_path) as broker:
        results: dict = {}
        procs = [_device(path, broker, f"client-{i}") for i in range(2)]
        phone = subprocess.Popen([sys.executable, str(ROOT / "examples" / "phone_device.py"), "--broker", broker, "--federation", fed,
                                  "--device-id", PHONE, "--program", str(program), "--data", str(share), "--lr", "0.05",
                                  "--momentum", "0.9", "--lr-milestones", "0.5", "--epochs", "1", "--timeout", "150", "--report", str(report)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        wait_online(broker, fed, ["client-0", "client-1", PHONE])
        t = _server_thread(cfg, broker, results)
        t.join(timeout=240)
        phone_err = phone.communicate(timeout=60)[1].decode()
        for p in procs:
            p.wait(timeout=60)
    assert "error" not in results, results.get("error")
    assert phone.returncode == 0, phone_err
    history = results["summary"]["history"]
    assert [h["outcome"] for h in history] == ["complete", "complete"], history
    assert all(PHONE in h["reported"] for h in history), history
    got = json.loads(report.read_text())
    assert got["rounds_served"] == [1, 2] and set(got["acks"].values()) == {"accepted"}, (got, phone_err)
    assert got["lr"] == pytest.approx({"1": 0.05, "2": 0.005})  # the run's schedule, from its announced length
    # only wire code of edgefl: no model, training or algorithm module in the phone's process
    assert not [m for m in got["edgefl_modules"] if m.startswith(("edgefl.models", "edgefl.algorithms", "edgefl.sim", "edgefl.device"))]
    if method == "fedavg":
        assert results["summary"]["final_accuracy"] is not None
    else:  # FedHe is judged by the devices' own reports: the phone's accuracy is among them
        assert PHONE in results["summary"]["final_accuracy"]["per_client"], results["summary"]["final_accuracy"]
