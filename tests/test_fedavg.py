"""FedAvg-groups: weighted averaging, groups never mix, a shared starting point."""

from __future__ import annotations

import pytest
import torch

from edgefl.algorithms.fedavg import FedAvgOptions
from edgefl.messages import Message
from edgefl.server.methods import ClientInfo
from edgefl.server.methods.fedavg import FedAvgServer, weighted_average


def make_server() -> FedAvgServer:
    infos = [
        ClientInfo("a0", "mlp(hidden=[4])", "mlp", {"hidden": [4]}, 10),
        ClientInfo("a1", "mlp(hidden=[4])", "mlp", {"hidden": [4]}, 30),
        ClientInfo("b0", "mlp(hidden=[6])", "mlp", {"hidden": [6]}, 5),
    ]
    return FedAvgServer(infos, FedAvgOptions(), seed=0, num_classes=2, input_shape=(3,))


def test_weighted_average_hand_computed():
    out = weighted_average(
        [{"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}, {"w": torch.tensor([5.0, 6.0]), "n": torch.tensor(7)}], [1, 3]
    )
    torch.testing.assert_close(out["w"], torch.tensor([4.0, 5.0]))  # (1*1 + 3*5)/4, (2 + 18)/4
    assert int(out["n"]) == 7  # integer buffers take the max


def test_group_members_share_initial_weights_and_groups_differ():
    s = make_server()
    d0, d1, db = s.downlink(1, "a0"), s.downlink(1, "a1"), s.downlink(1, "b0")
    assert all(torch.equal(d0.tensors[k], d1.tensors[k]) for k in d0.tensors)
    assert d0.tensors["extractor.1.weight"].shape != db.tensors["extractor.1.weight"].shape
    again = make_server().downlink(1, "a0")  # same seed, same start
    assert all(torch.equal(d0.tensors[k], again.tensors[k]) for k in d0.tensors)


def _update(s: FedAvgServer, sender: str, value: float, n: int, round_no: int = 1) -> Message:
    tensors = {k: torch.full_like(v, value) if v.is_floating_point() else v for k, v in s.downlink(round_no, sender).tensors.items()}
    return Message("weights", round_no, sender, tensors, {"num_samples": n})


def test_averaging_stays_within_architecture():
    s = make_server()
    s.begin_round(1)
    b_before = {k: v.clone() for k, v in s.group_weights["mlp(hidden=[6])"].items()}
    assert s.receive(_update(s, "a0", 1.0, 10)).status == "accepted"
    assert s.receive(_update(s, "a1", 5.0, 30)).status == "accepted"
    s.close_round(1)
    a = s.group_weights["mlp(hidden=[4])"]
    assert float(a["head.weight"][0, 0]) == pytest.approx((1 * 10 + 5 * 30) / 40)
    # group b sent nothing: unchanged, and never touched by group a's values
    assert all(torch.equal(v, b_before[k]) for k, v in s.group_weights["mlp(hidden=[6])"].items())


def test_wrong_architecture_late_and_repeated_updates():
    s = make_server()
    s.begin_round(2)
    wrong = _update(s, "b0", 1.0, 5, round_no=2)
    wrong.sender = "a0"  # b-shaped weights claimed by an a-client
    assert s.receive(wrong).status == "rejected"
    assert s.receive(_update(s, "a0", 1.0, 10, round_no=1)).status == "late"
    assert s.receive(_update(s, "a0", 1.0, 10, round_no=2)).status == "accepted"
    r = s.receive(_update(s, "a0", 2.0, 10, round_no=2))
    assert r.status == "rejected" and "one weights upload per device per round" in r.reason
    nan = _update(s, "a1", float("nan"), 10, round_no=2)
    assert "NaN" in s.receive(nan).reason
