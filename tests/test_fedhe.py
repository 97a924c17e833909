"""FedHe's arithmetic against hand-computed values, and the asynchronous server."""

from __future__ import annotations

import random

import pytest
import torch

from edgefl.algorithms.fedhe import FedHeOptions, LogitCollector, fedhe_loss, logit_loss
from edgefl.messages import Message, decode, encode
from edgefl.server.methods import ClientInfo
from edgefl.server.methods.fedhe import FedHeServer

C = 3


def server(n_clients: int = 3, **opts) -> FedHeServer:
    infos = [ClientInfo(f"c{i}", "mlp", "mlp") for i in range(n_clients)]
    return FedHeServer(infos, FedHeOptions(**opts), seed=0, num_classes=C, input_shape=(4,))


def report(sender: str, round_no: int, classes: list[int], logits: list[list[float]]) -> Message:
    return Message("class_logits", round_no, sender, {
        "logits": torch.tensor(logits, dtype=torch.float32),
        "classes": torch.tensor(classes, dtype=torch.int64),
        "counts": torch.ones(len(classes), dtype=torch.int64),
    })


def test_client_averages_are_sum_over_count_plus_one():
    col = LogitCollector(C)
    col.add(torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]), torch.tensor([0, 0]))
    col.add(torch.tensor([[6.0, 0.0, 3.0]]), torch.tensor([2]))
    classes, avg, counts = col.averages()
    assert classes.tolist() == [0, 2] and counts.tolist() == [2, 1]
    # class 0: (1+3, 2+2, 3+1) / (2+1); class 2: (6, 0, 3) / (1+1); class 1 never seen: not sent
    torch.testing.assert_close(avg, torch.tensor([[4 / 3, 4 / 3, 4 / 3], [3.0, 0.0, 1.5]]))


def test_mse_logit_loss_hand_computed():
    logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    teacher = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    has = torch.tensor([1.0, 0.0])
    # sample 0: mean((1,0,0)^2) = 1/3; sample 1 has no teacher; mean over the batch of 2 -> 1/6
    assert float(logit_loss(logits, teacher, has, "mse", 1.0)) == pytest.approx(1 / 6)


def test_kl_logit_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[0.0, torch.log(torch.tensor(3.0))]])  # softmax -> (1/4, 3/4)
    expected = 0.25 * torch.log(torch.tensor(0.25 / 0.5)) + 0.75 * torch.log(torch.tensor(0.75 / 0.5))
    assert float(logit_loss(logits, teacher, torch.ones(1), "kl", 1.0)) == pytest.approx(float(expected), rel=1e-5)


def test_total_loss_is_ce_plus_alpha_times_logit_loss():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    y = torch.tensor([0, 1])
    server_logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([True, False, False])
    ce = torch.nn.functional.cross_entropy(logits, y)
    # only sample 0 has a teacher: mse = mean((1,0,0)^2) = 1/3, averaged over 2 samples
    total = fedhe_loss(logits, y, server_logits, mask, FedHeOptions(alpha=0.5))
    assert float(total) == pytest.approx(float(ce) + 0.5 * (1 / 3) / 2)
    assert float(fedhe_loss(logits, y, None, None, FedHeOptions())) == pytest.approx(float(ce))


def test_server_averages_per_class_over_reporting_clients():
    s = server()
    s.begin_round(1)
    assert s.receive(report("c0", 1, [0, 1], [[1, 1, 1], [2, 2, 2]])).status == "accepted"
    assert s.receive(report("c1", 1, [0], [[3, 3, 3]])).status == "accepted"
    logits, mask = s.global_logits()
    torch.testing.assert_close(logits[0], torch.tensor([2.0, 2.0, 2.0]))  # (1 + 3) / 2 clients
    torch.testing.assert_close(logits[1], torch.tensor([2.0, 2.0, 2.0]))  # only c0 has class 1
    assert mask.tolist() == [True, True, False]  # class 2: nobody reported it
    down = decode(encode(s.downlink(2, "c2")))
    assert down.tensors["mask"].tolist() == [True, True, False]


def test_count_weighted_server_mean():
    s = server(server_weighting="count")
    s.begin_round(1)
    a = report("c0", 1, [0], [[1, 1, 1]])
    a.tensors["counts"] = torch.tensor([3])
    b = report("c1", 1, [0], [[5, 5, 5]])
    b.tensors["counts"] = torch.tensor([1])
    s.receive(a), s.receive(b)
    torch.testing.assert_close(s.global_logits()[0][0], torch.tensor([2.0, 2.0, 2.0]))  # (3*1 + 1*5) / 4
    uniform = server()
    uniform.begin_round(1)
    uniform.receive(decode(encode(a))), uniform.receive(decode(encode(b)))
    torch.testing.assert_close(uniform.global_logits()[0][0], torch.tensor([3.0, 3.0, 3.0]))  # paper: (1 + 5) / 2


def test_empty_store_sends_no_logits():
    down = server().downlink(1, "c0")
    assert down.tensors == {} and down.meta == {"empty": True}


def _arrivals():
    return [
        report("c0", 1, [0, 1], [[1, 0, 0], [0, 1, 0]]),
        report("c1", 1, [1, 2], [[0, 2, 0], [0, 0, 2]]),
        report("c2", 1, [0], [[0.5, 0.25, 0.125]]),
        report("c0", 2, [0, 2], [[4, 0, 0], [0, 0, 4]]),
        report("c1", 2, [1], [[0, 8, 0]]),
    ]


def test_any_arrival_order_gives_the_same_logits():
    reference = server()
    reference.begin_round(3)
    for m in _arrivals():
        reference.receive(m)
    expected = reference.global_logits()
    for seed in range(20):
        msgs = _arrivals()
        random.Random(seed).shuffle(msgs)
        s = server()
        s.begin_round(3)
        for m in msgs:
            s.receive(m)
        got = s.global_logits()
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    # each client's latest report counts: c0 round 2, c1 round 2, c2 round 1
    torch.testing.assert_close(expected[0][0], torch.tensor([(4 + 0.5) / 2, 0.25 / 2, 0.125 / 2]))


def test_late_and_repeated_arrivals():
    s = server()
    s.begin_round(3)
    first = report("c0", 2, [0], [[1, 1, 1]])
    assert s.receive(first).status == "late"  # from a closed round: still used (asynchronous)
    assert s.receive(first).status == "duplicate"  # same message id again: ignored
    before = s.global_logits()[0].clone()
    stale = report("c0", 1, [0], [[9, 9, 9]])
    r = s.receive(stale)
    assert r.status == "late" and "not used" in r.reason  # older than what c0 already sent
    assert torch.equal(s.global_logits()[0], before)
    resend = decode(encode(first))  # a re-delivered copy (broker DUP) has the same id
    assert s.receive(resend).status == "duplicate"


def test_max_age_drops_stale_clients():
    s = server(max_age_rounds=1)
    s.begin_round(1)
    s.receive(report("c0", 1, [0], [[1, 1, 1]]))
    s.begin_round(5)
    s.receive(report("c1", 5, [0], [[3, 3, 3]]))
    torch.testing.assert_close(s.global_logits()[0][0], torch.tensor([3.0, 3.0, 3.0]))


@pytest.mark.parametrize(
    "msg, reason",
    [
        (Message("weights", 1, "c0", {}), "expected class_logits"),
        (report("c0", 1, [0, 0], [[1, 1, 1], [1, 1, 1]]), "repeated"),
        (report("c0", 1, [7], [[1, 1, 1]]), "out of range"),
        (report("c0", 1, [0], [[1, 1]]), "logits must be float"),
        (report("c0", 1, [0], [[float("nan"), 1, 1]]), "NaN"),
        (report("mallory", 1, [0], [[1, 1, 1]]), "unknown sender"),
    ],
)
def test_bad_reports_are_rejected_with_a_reason(msg, reason):
    s = server()
    s.begin_round(1)
    r = s.receive(msg)
    assert r.status == "rejected" and reason in r.reason
    assert not s.store
