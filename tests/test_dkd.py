"""DKD against a hand-computed example, and CHFL's temperature schedule."""

from __future__ import annotations

import math

import pytest
import torch

from edgefl.algorithms.dkd import chfl_temperature, dkd_loss, tckd_nckd


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def softmax(z: list[float]) -> list[float]:
    e = [math.exp(v) for v in z]
    return [v / sum(e) for v in e]


def test_dkd_hand_computed_with_temperature_and_target_masking():
    student = [1.0, 2.0, 0.0]
    teacher = [3.0, 1.0, 1.0]
    target = 0
    t = 2.0
    ps, pt = softmax([v / t for v in student]), softmax([v / t for v in teacher])
    tckd = kl([pt[0], 1 - pt[0]], [ps[0], 1 - ps[0]]) * t * t
    # non-target classes 1 and 2, renormalised without class 0
    qs, qt = softmax([student[1] / t, student[2] / t]), softmax([teacher[1] / t, teacher[2] / t])
    nckd = kl(qt, qs) * t * t
    got_t, got_n = tckd_nckd(torch.tensor([student]), torch.tensor([teacher]), torch.tensor([target]), t)
    assert float(got_t) == pytest.approx(tckd, rel=1e-5)
    assert float(got_n) == pytest.approx(nckd, rel=1e-4)
    total = dkd_loss(torch.tensor([student]), torch.tensor([teacher]), torch.tensor([target]), t, alpha=0.5)
    assert float(total) == pytest.approx(0.5 * (tckd + nckd), rel=1e-4)


def test_nckd_ignores_the_target_logit():
    s, t, y = torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[0.0, 2.0, 1.0]]), torch.tensor([0])
    _, a = tckd_nckd(s, t, y, 1.0)
    _, b = tckd_nckd(s + torch.tensor([[50.0, 0, 0]]), t - torch.tensor([[50.0, 0, 0]]), y, 1.0)
    assert float(a) == pytest.approx(float(b), rel=1e-5)


def test_identical_student_and_teacher_give_zero_and_gradient_flows_to_student_only():
    s = torch.randn(5, 4, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 0])
    assert float(dkd_loss(s, s.detach().clone(), y, 3.0, 0.5)) == pytest.approx(0.0, abs=1e-6)
    teacher = torch.randn(5, 4, requires_grad=True)
    dkd_loss(s, teacher, y, 3.0, 0.5).backward()
    assert s.grad is not None and teacher.grad is None


def test_temperature_schedule_endpoints():
    assert chfl_temperature(0, 20, 5.0) == pytest.approx(11.0)  # 2 * beta + 1
    assert chfl_temperature(20, 20, 5.0) == pytest.approx(1.0)
    assert chfl_temperature(10, 20, 5.0) == pytest.approx(6.0)
    temps = [chfl_temperature(e, 20, 5.0) for e in range(21)]
    assert all(a >= b for a, b in zip(temps, temps[1:]))
