"""The simulation engine end to end on real (small) data: determinism, run directory, bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgefl.config import load_config, validate_config
from edgefl.errors import ConfigError, EdgeflError
from edgefl.messages import encode
from edgefl.report import draw_plots
from edgefl.rundir import RunDir, load_model_file
from edgefl.sim import Simulation
from edgefl.methods import METHODS
from tests.conftest import digits_config, method_config


def run(raw, out=None):
    cfg = validate_config(raw)
    sim = Simulation(cfg, RunDir.create(out, cfg.name, cfg.seed) if out else None, show_progress=False)
    return sim, sim.run()


def accuracies(history):
    return [(h["round"], h["accuracy"]["per_client"] if h["accuracy"] else None, h["train_loss"]) for h in history]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_same_seed_same_numbers(method):
    a, _ = run(method_config(method, rounds=2))
    b, _ = run(method_config(method, rounds=2))
    assert accuracies(a.history) == accuracies(b.history)
    c, _ = run({**method_config(method, rounds=2), "seed": 1})
    assert accuracies(a.history) != accuracies(c.history)


def test_same_seed_same_model_files(tmp_path):
    """Byte for byte, so a model's SHA-256 identifies it: safetensors wrote the metadata keys in a
    hash map's order, different from one file to the next."""
    for out in ("a", "b"):
        run(digits_config("fedavg", rounds=1), tmp_path / out)
    files = sorted(p.name for p in (tmp_path / "a" / "models").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "b" / "models").glob("*.safetensors"))
    for name in files:
        assert (tmp_path / "a" / "models" / name).read_bytes() == (tmp_path / "b" / "models" / name).read_bytes(), name


def test_run_directory_contents(tmp_path):
    sim, summary = run(digits_config("fedhe", rounds=3, eval={"every": 2}), tmp_path / "run")
    root = tmp_path / "run"
    assert {p.name for p in root.iterdir()} >= {"config.toml", "run.json", "partition.json", "metrics.jsonl", "summary.json", "plots", "models"}
    lines = (root / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    records = [json.loads(x) for x in lines]
    assert records[0]["accuracy"] is None and records[1]["accuracy"] is not None and records[2]["accuracy"] is not None
    per_arch = records[-1]["accuracy"]["per_arch"]
    assert set(per_arch) == {"fedhe-cnn-0(width=0.125)", "mlp(hidden=[32, 16])"}
    summ = json.loads((root / "summary.json").read_text())
    assert summ["seed"] == 0 and summ["versions"]["torch"] and summ["machine"]["cpu_count"]
    if (Path(__file__).resolve().parents[1] / ".git").exists():  # which code of a checkout made these numbers
        assert isinstance(summ["edgefl_commit"], str) and len(summ["edgefl_commit"].split("-")[0]) >= 7
    assert summ["machine"]["torch_cpu_capability"] and "cpu" in summ["machine"]  # what decides the last digits
    assert summ["final_accuracy"]["overall"] == pytest.approx(sum(summ["final_accuracy"]["per_client"].values()) / 4)
    # the resolved config re-runs as is
    assert load_config(root / "config.toml").to_dict() == sim.cfg.to_dict()
    part = json.loads((root / "partition.json").read_text())
    assert sum(c["num_samples"] for c in part["clients"]) == len(sim.ds.y_train)
    models = sorted((root / "models").glob("client-*.safetensors"))  # each device's own, beside what ships (ship-*)
    assert len(models) == 4
    assert len(list((root / "models").glob("ship-*.safetensors"))) == 2 and (root / "ship.json").is_file()
    state, meta = load_model_file(models[0])
    assert meta["model"] == "fedhe-cnn-0" and meta["model_options"] == {"width": 0.125} and state
    assert {p.name for p in draw_plots(RunDir(root))} == {"accuracy.png", "communication.png", "partition.png"}


def test_fedavg_saves_one_global_model_per_group(tmp_path):
    run(digits_config("fedavg", rounds=1), tmp_path / "run")
    names = sorted(p.name for p in (tmp_path / "run" / "models").iterdir())
    assert names == ["global-fedhe-cnn-0_width_0.125.safetensors", "global-mlp_hidden__32__16.safetensors"]


def test_bytes_are_the_serialised_messages():
    sim, _ = run(digits_config("fedhe", rounds=2))
    r1, r2 = sim.history
    # round 1: the server has no logits yet, so it sends an empty message; round 2 a C x C table
    assert r1["bytes_down"] < r2["bytes_down"]
    expected_down = len(encode(sim.server.downlink(2, "client-0")))
    assert abs(r2["bytes_down_per_client"]["client-0"] - expected_down) < 64  # ids differ only
    assert all(n > 0 for n in r2["bytes_up_per_client"].values())
    local, _ = run(digits_config("local", rounds=1))
    assert local.history[0]["bytes_up"] == 0 and local.history[0]["bytes_down"] == 0


def test_fedhe_reports_are_accepted_and_distillation_starts():
    sim, _ = run(digits_config("fedhe", rounds=2))
    assert set(sim.history[1]["receipts"].values()) == {"accepted"}
    assert sim.history[1]["server"]["classes_known"] == 10
    assert all(c.server_logits is not None for c in sim.clients.values())


def test_sampling_ratio_selects_a_subset():
    raw = digits_config("fedhe", rounds=3)
    raw["fleet"]["sample_ratio"] = 0.5
    sim, _ = run(raw)
    assert all(len(h["selected"]) == 2 for h in sim.history)
    assert len({tuple(h["selected"]) for h in sim.history}) >= 2


def test_model_that_cannot_take_the_input_is_a_config_error():
    raw = digits_config("fedhe")
    raw["fleet"]["groups"][0] = {"model": "lenet5", "count": 1}
    with pytest.raises(ConfigError, match=r"fleet.groups\[0\]: model lenet5 cannot take digits input 1x8x8"):
        run(raw)


def test_existing_run_directory_is_not_overwritten(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("precious")
    with pytest.raises(EdgeflError, match="already exists"):
        RunDir.create(tmp_path / "run", "x", 0)
    assert (tmp_path / "run" / "keep.txt").read_text() == "precious"
