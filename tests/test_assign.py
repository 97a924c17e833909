"""Budget -> architecture on hand-made profiles: exactly fits, nothing fits, generator fallback."""

from __future__ import annotations

import pytest

from edgefl.models import model_info
from edgefl.profile import DeviceProfile, catalog
from edgefl.profile.assign import Budgets, assign
from edgefl.profile.cost import OPTIMIZER_STATE_BYTES, activation_bytes_per_sample, estimate
from tests.test_cli import edgefl

LADDER = [("vgg9", {}), ("lenet5", {}), ("cnn-small", {}), ("cvae-small", {})]


def board(budget: float | None, gflops: float | None = 10.0, storage: float | None = 1e12) -> DeviceProfile:
    def q(v):
        return {"kind": "unknown"} if v is None else {"value": v, "kind": "spec", "source": "test"}

    return DeviceProfile.model_validate({
        "schema": "edgefl-device-profile/1", "id": "test-board", "name": "test board", "class": "sbc",
        "memory": {"training_budget_bytes": q(budget), "storage_bytes": q(storage)},
        "compute": {"effective_gflops": q(gflops)},
    })


def test_cost_model_arithmetic():
    info = model_info("lenet5")
    act = activation_bytes_per_sample("lenet5", (), (1, 28, 28), 10)
    e = estimate("lenet5", profile=board(1e9, gflops=2.0), batch=16, samples=100, epochs=2, optimizer="sgd")
    assert e.train_memory_bytes == info.params * (8 + OPTIMIZER_STATE_BYTES["sgd"]) + act * 16
    assert e.compute_s == pytest.approx(3 * info.flops_per_sample * 100 * 2 / 2e9)
    assert e.storage_bytes == info.params * 4


def test_exactly_fitting_memory_is_chosen():
    ladder = [("vgg9", {}), ("fedhe-cnn-5", {}), ("lenet5", {})]  # memory grows with FLOPs here
    need = estimate("fedhe-cnn-5", batch=32).train_memory_bytes
    result = assign(board(need / 0.8), Budgets(headroom=0.8), candidates=ladder)
    assert result.chosen.label == "fedhe-cnn-5"
    assert "memory" in result.verdicts[0].bound  # vgg9 is refused by memory
    smaller = assign(board((need - 1) / 0.8), Budgets(headroom=0.8), candidates=ladder)
    assert smaller.chosen.label == "lenet5"
    assert smaller.verdicts[1].bound.startswith("memory")


def test_deadline_decides_between_fitting_models():
    result = assign(board(1e12, gflops=1.0), Budgets(deadline_s=10, samples=600), candidates=LADDER)
    vgg = next(v for v in result.verdicts if v.label == "vgg9")
    assert not vgg.fits and vgg.bound.startswith("deadline")
    assert result.chosen.label == "cnn-small"  # the larger FLOPs of the two small CNNs
    assert "next larger is bound by deadline" in result.reason


def test_nothing_fits_is_refused_with_the_reason():
    result = assign(board(10_000), candidates=LADDER)
    assert result.chosen is None and "even the smallest, lenet5, is bound by memory" in result.reason


def test_generator_fallback_only_for_methods_with_generator_clients():
    cvae = estimate("cvae-small", batch=32).train_memory_bytes
    cnn = estimate("cnn-small", batch=32).train_memory_bytes
    assert cnn < cvae  # so the test needs classifiers that are all larger than the generator
    ladder = [("vgg9", {}), ("fedhe-cnn-5", {}), ("cvae-small", {})]
    profile = board(cvae / 0.8 * 1.01)
    fedmho = assign(profile, candidates=ladder, method="fedmho")
    assert fedmho.chosen.label == "cvae-small" and "fedmho takes a generator client" in fedmho.reason
    fedavg = assign(profile, candidates=ladder, method="fedavg")
    assert fedavg.chosen is None and "a generator would fit" in fedavg.reason


def test_unknown_numbers_are_reported_unchecked():
    result = assign(board(None, gflops=None, storage=None), candidates=[("lenet5", {})])
    assert result.chosen.unchecked == ["memory", "storage", "deadline (speed unknown)"]


def test_catalog_devices_get_sensible_models():
    c = catalog()
    big = assign(c["pi5-8gb"], candidates=LADDER[:3]).chosen
    small = assign(c["pi-zero-2w"], candidates=LADDER[:3]).chosen
    assert big.estimate.flops_per_sample >= small.estimate.flops_per_sample


def test_cli_assign_prints_every_candidate_and_refuses_with_exit_1():
    res = edgefl("assign", "--profile", "pi4-4gb", "--models", "vgg9,lenet5,cnn-small")
    assert res.returncode == 0, res.stderr
    assert "pi4-4gb -> " in res.stdout and "vgg9" in res.stdout and "deadline" in res.stdout
    res = edgefl("assign", "--profile", "esp32-s3", "--models", "vgg9,lenet5")
    assert res.returncode == 1 and "cannot take part" in res.stdout
    res = edgefl("assign", "--profile", "pi4-4g", "--models", "lenet5")
    assert res.returncode == 2 and "did you mean 'pi4-4gb'" in res.stderr


def test_step_model_fit_recovers_known_host_terms():
    from edgefl.profile.cost import fit_step_model

    def row(layers, flops, mem_naive):
        return {"layers": layers, "flops": flops, "batch": 32, "step_s": layers * 40e-6 + 3 * flops * 32 / 25e9,
                "memory_measured": mem_naive + 8e6, "memory_naive": mem_naive}

    fit = fit_step_model([row(10, 1e6, 1e6), row(60, 5e7, 4e7), row(30, 2e8, 2e7)])
    assert fit.effective_gflops == pytest.approx(25, rel=1e-6)
    assert fit.layer_overhead_us == pytest.approx(40, rel=1e-6)
    assert fit.memory_overhead_bytes == pytest.approx(8e6)


def test_profile_overheads_enter_the_estimate():
    base = board(1e9, gflops=10.0)
    tuned = board(1e9, gflops=10.0)
    tuned.compute.layer_overhead_us = tuned.compute.layer_overhead_us.model_validate({"value": 100, "kind": "measured", "source": "t"})
    tuned.memory.step_overhead_bytes = tuned.memory.step_overhead_bytes.model_validate({"value": 5e6, "kind": "measured", "source": "t"})
    a = estimate("lenet5", profile=base, batch=32, samples=64)
    b = estimate("lenet5", profile=tuned, batch=32, samples=64)
    assert b.train_memory_bytes - a.train_memory_bytes == 5_000_000
    # 2 steps x 16 forward operators (LeNet-5: 2 conv, 3 addmm, 4 relu_, 2 pools, transposes...) x 100 us
    assert b.compute_s - a.compute_s == pytest.approx(2 * 16 * 100e-6)


def test_full_step_model_fit_recovers_per_parameter_cost_and_activation_factor():
    from edgefl.profile.cost import fit_step_model

    def row(layers, flops, params, act):
        return {"layers": layers, "flops": flops, "params": params, "activation_bytes": act, "batch": 32,
                "step_s": layers * 40e-6 + 3 * flops * 32 / 25e9 + params * 2e-9 + act * 32 * 0.5e-9,
                "memory_measured": params * 16 + 1.5 * act * 32 + 8e6}

    rows = [row(10, 1e6, 5e4, 2e4), row(60, 5e7, 1e6, 4e5), row(30, 2e8, 3e5, 1e6), row(20, 3e7, 5e7, 1e5), row(8, 4e6, 2e4, 3e6)]
    fit = fit_step_model(rows)
    assert fit.effective_gflops == pytest.approx(25, rel=1e-4)
    assert fit.layer_overhead_us == pytest.approx(40, rel=1e-4)
    assert fit.param_overhead_ns == pytest.approx(2, rel=1e-4)
    assert fit.activation_ns_per_byte == pytest.approx(0.5, rel=1e-4)
    assert fit.activation_factor == pytest.approx(1.5, rel=1e-4)
    assert fit.memory_overhead_bytes == pytest.approx(8e6, rel=1e-4)
    r = rows[3]
    assert fit.step_seconds(r["flops"], 32, r["layers"], r["params"], r["activation_bytes"]) == pytest.approx(r["step_s"], rel=1e-6)
