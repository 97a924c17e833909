"""CHFL: only heads leave a device, head aggregation, modes, and devices with different inputs."""

from __future__ import annotations

import pytest
import torch

from edgefl.algorithms.chfl import CHFLOptions
from edgefl.config import validate_config
from edgefl.errors import ConfigError
from edgefl.messages import Message
from edgefl.server.methods import ClientInfo
from edgefl.server.methods.chfl import CHFLServer
from edgefl.sim import Simulation


def tabular(mode: str = "kd", rounds: int = 3, method: str = "chfl") -> dict:
    return {
        "name": "test-chfl", "seed": 0, "rounds": rounds,
        "method": {"name": method, **({"mode": mode, "embedding_dim": 16} if method == "chfl" else {})},
        "data": {"dataset": "breast-cancer", "partition": "dirichlet", "alpha": 0.5, "min_samples": 40, "client_test_fraction": 0.25},
        "train": {"batch_size": 16, "lr": 0.003},
        "fleet": {"groups": [
            {"model": "mlp", "count": 2, "options": {"hidden": "random", "feature_dim": 16}, "view": {"kind": "features", "fraction": 0.5}},
            {"model": "mlp", "count": 1, "options": {"hidden": [8], "feature_dim": 16}, "view": {"kind": "features", "count": 5}},
        ]},
    }


class Recording(Simulation):
    """Keeps every uplink so tests can inspect exactly what left the devices."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.uplinks: list[Message] = []
        for client in self.clients.values():
            fit = client.fit

            def recorded(down, r, _fit=fit):
                up = _fit(down, r)
                if up is not None:
                    self.uplinks.append(up)
                return up

            client.fit = recorded


def run(raw) -> Recording:
    sim = Recording(validate_config(raw), None, show_progress=False)
    sim.run()
    return sim


def test_only_head_parameters_leave_a_device():
    sim = run(tabular())
    assert len(sim.uplinks) == 3 * 3
    for up in sim.uplinks:
        client = sim.clients[up.sender]
        head = client.model.head.state_dict()
        assert up.kind == "head" and set(up.tensors) == set(head) == {"weight", "bias"}
        assert up.tensors["weight"].shape == (2, 16)
        # nothing else of the model, nor any data, is in the message
        assert up.payload_numbers() == 2 * 16 + 2
        assert set(up.meta) <= {"num_samples", "arch", "train_loss", "temperature"}


def test_devices_with_different_input_widths_train_together():
    sim = run(tabular(rounds=2))
    widths = {c.client_id: c.setup.x.shape[1] for c in sim.clients.values()}
    assert sorted(widths.values()) == [5, 15, 15]
    cols = [tuple(c.setup.view.columns.tolist()) for c in sim.clients.values()]
    assert len(set(cols)) == 3  # each device its own feature subset
    assert all(set(h["receipts"].values()) == {"accepted"} for h in sim.history)
    acc = sim.history[-1]["accuracy"]
    assert 0.5 < acc["overall"] <= 1.0 and len(acc["per_client"]) == 3
    # random MLP shapes are per device and reproducible
    again = run(tabular(rounds=1))
    assert [c.setup.arch for c in again.clients.values()] == [c.setup.arch for c in sim.clients.values()]


@pytest.mark.parametrize("mode", ["kd", "avg", "avgkd"])
def test_modes_run_and_distil_from_the_second_epoch(mode):
    sim = run(tabular(mode))
    temps = [u.meta["temperature"] for u in sim.uplinks if u.round == 1]
    later = [u.meta["temperature"] for u in sim.uplinks if u.round == 3]
    assert all(t is None for t in temps)  # epoch 1: CE only
    if mode == "avg":
        assert all(t is None for t in later)
    else:
        assert all(t == pytest.approx(1.0) for t in later)  # last epoch: T = 1


@pytest.mark.parametrize("mode, starts_from_global", [("avg", True), ("avgkd", True), ("kd", False)])
def test_which_modes_start_each_epoch_from_the_global_head(mode, starts_from_global, monkeypatch):
    import edgefl.algorithms.base as base  # ClientHalf.train_locally runs every local loop

    sim = run(tabular(mode, rounds=2))
    client = next(iter(sim.clients.values()))
    down = sim.server.downlink(3, client.client_id)
    seen = {}
    real = base.train_local

    def spy(model, *a, **kw):
        seen["head"] = model.head.weight.detach().clone()
        return real(model, *a, **kw)

    monkeypatch.setattr(base, "train_local", spy)
    client.fit(down, 3)
    assert torch.equal(seen["head"], down.tensors["weight"]) == starts_from_global


def test_solo_is_the_local_method_on_the_same_devices():
    sim = run(tabular(method="local"))
    assert sim.history[-1]["bytes_up"] == 0 and sim.history[-1]["accuracy"]["overall"] > 0.5


def server(weighted: bool = True) -> CHFLServer:
    infos = [ClientInfo(f"c{i}", "mlp", "mlp", num_samples=n) for i, n in enumerate((10, 30))]
    return CHFLServer(infos, CHFLOptions(embedding_dim=2, weighted=weighted), seed=0, num_classes=2, input_shape=(3,))


def head(sender: str, value: float, n: int, round_no: int = 1) -> Message:
    return Message("head", round_no, sender, {"weight": torch.full((2, 2), value), "bias": torch.full((2,), value)}, {"num_samples": n})


@pytest.mark.parametrize("weighted, expected", [(True, (1 * 10 + 5 * 30) / 40), (False, 3.0)])
def test_head_aggregation_is_the_mean(weighted, expected):
    s = server(weighted)
    s.begin_round(1)
    assert s.receive(head("c0", 1.0, 10)).status == "accepted"
    assert s.receive(head("c1", 5.0, 30)).status == "accepted"
    s.close_round(1)
    torch.testing.assert_close(s.global_head["weight"], torch.full((2, 2), expected))
    torch.testing.assert_close(s.downlink(2, "c0").tensors["bias"], torch.full((2,), expected))


def test_server_rejects_what_is_not_a_head():
    s = server()
    s.begin_round(2)
    bad = head("c0", 1.0, 10, round_no=2)
    bad.tensors["backbone.weight"] = torch.zeros(3)
    assert "head does not match: missing [], unexpected ['backbone.weight']" in s.receive(bad).reason
    wrong_shape = Message("head", 2, "c0", {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}, {"num_samples": 5})
    assert "expected (2, 2)" in s.receive(wrong_shape).reason
    again = head("c0", 1.0, 10, round_no=2)
    assert s.receive(again).status == "accepted"
    assert "one head upload per device" in s.receive(head("c0", 2.0, 10, round_no=2)).reason
    assert s.receive(head("c0", 1.0, 10, round_no=1)).status == "late"
    assert "NaN" in s.receive(head("c1", float("nan"), 10, round_no=2)).reason


def test_embedding_width_mismatch_is_a_clear_error():
    raw = tabular()
    raw["fleet"]["groups"][1]["options"]["feature_dim"] = 8
    with pytest.raises(ConfigError, match="emits 8-wide embeddings, the federation agreed on 16"):
        run(raw)


def test_more_than_one_epoch_per_round_is_refused():
    raw = tabular()
    raw["train"]["epochs"] = 2
    with pytest.raises(ConfigError, match="set train.epochs = 1"):
        run(raw)


def test_image_devices_with_different_feature_spaces():
    raw = {
        "name": "test-chfl-img", "seed": 0, "rounds": 2, "method": {"name": "chfl", "embedding_dim": 32},
        "data": {"dataset": "digits", "partition": "iid", "min_samples": 20},
        "train": {"batch_size": 32, "lr": 0.003},
        "fleet": {"groups": [
            {"model": "fedhe-cnn-0", "options": {"width": 0.125, "feature_dim": 32}, "view": {"kind": "permute"}},
            {"model": "mlp", "options": {"hidden": [32], "feature_dim": 32}},
            {"model": "fedhe-cnn-3", "options": {"width": 0.125, "feature_dim": 32}, "view": {"kind": "rgb"}},
            {"model": "fedhe-cnn-1", "options": {"width": 0.125, "feature_dim": 32}, "view": {"kind": "crop", "size": 6}},
        ]},
    }
    for mode in ("kd", "avg"):
        raw["method"]["mode"] = mode
        sim = run(raw)
        shapes = [tuple(c.setup.x.shape[1:]) for c in sim.clients.values()]
        assert shapes == [(1, 8, 8), (1, 8, 8), (3, 8, 8), (1, 6, 6)]
        # every head is accepted, including those of zoo models whose own head has no bias
        assert all(set(h["receipts"].values()) == {"accepted"} for h in sim.history)
        assert sim.history[-1]["server"]["heads_averaged"] == 4
        assert sim.history[-1]["accuracy"]["overall"] > 0.2
