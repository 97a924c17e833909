"""Budget -> architecture on hand-made profiles: exactly fits, nothing fits, generator fallback."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgefl.models import model_info
from edgefl.profile import DeviceProfile, catalog
from edgefl.profile.assign import Budgets, assign
from edgefl.profile.cost import (OPTIMIZER_STATE_BYTES, ForwardStats, StepFit, activation_bytes_per_sample, estimate,
                                 fit_step_model, forward_stats)
from edgefl.profile.schema import Quantity
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
    # the candidates nearest to fitting, each by its own measure: cnn-small needs the least memory, lenet5 the fewest FLOPs
    assert result.chosen is None and "the one that needs the least memory, cnn-small, is bound by memory" in result.reason
    assert "the fewest FLOPs, lenet5, by memory" in result.reason
    assert "smallest" not in result.reason


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


def test_cli_assign_tells_a_microcontroller_what_to_do_instead_of_device_profile():
    res = edgefl("assign", "--profile", "esp32-s3", "--models", "lenet5,cnn-small")
    assert res.returncode == 1
    text = " ".join(res.stdout.split())  # rich wraps long lines
    assert "device-profile" not in text, "a microcontroller cannot run Python"
    assert "TFLite Micro" in text and "memory map" in text and "catalog" in text


def test_cli_assign_takes_its_budgets_from_a_run_config_and_agrees_with_the_run():
    from edgefl.build import assign_group, load_run_dataset
    from edgefl.config import load_config
    from edgefl.profile import load_profile

    from pathlib import Path

    path = str(Path(__file__).resolve().parent.parent / "examples" / "fleet_by_device_class.toml")
    cfg = load_config(path, [])
    ds = load_run_dataset(cfg)
    want, _ = assign_group(cfg, ds, cfg.fleet.groups[1], 1, load_profile("pi-zero-2w"))
    res = edgefl("assign", "--config", path, "--group", "1")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "pi-zero-2w: 600 samples x 1 epoch(s), batch 50, deadline 30 s" in text  # the group's train and clock settings
    assert f"pi-zero-2w -> {want}" in text, "the model the run itself assigns this group"
    mine = edgefl("assign", "--config", path, "--group", "1", "--batch", "16", "--models", "lenet5")
    assert "batch 16, deadline 30 s" in " ".join(mine.stdout.split())  # an option beats the config
    assert edgefl("assign", "--config", path, "--group", "7").returncode == 2
    assert "--group needs --config" in edgefl("assign", "--profile", "pi4-4gb", "--group", "1").stderr


def test_a_cache_file_two_processes_write_keeps_what_each_wrote(tmp_path):
    # each process reads the file once: one that loaded it before another saved must add to the
    # file, not put back its older copy (xdist workers lost each other's forward statistics so)
    from edgefl.models.registry import JsonFileCache

    path = tmp_path / "cache.json"
    first, second = JsonFileCache(lambda: path), JsonFileCache(lambda: path)
    first.load(), second.load()  # both started before either saved
    first.load()["a"] = 1
    first.save()
    second.load()["b"] = 2
    second.save()
    assert json.loads(path.read_text()) == {"a": 1, "b": 2}
    assert second.load() == {"a": 1, "b": 2}, "what the file gained is this process's too"


def test_forward_statistics_are_kept_on_disk_so_assign_does_not_count_them_again(monkeypatch):
    from edgefl.profile import cost

    first = forward_stats("cnn-small", (), (1, 28, 28), 10)  # counted, or read from the cache file
    assert cost._stats_path().is_file()
    forward_stats.cache_clear()
    monkeypatch.setattr(cost._STATS_CACHE, "data", None)  # as a new process starts: only the file remains

    def never(*args):
        raise AssertionError("counted again")

    monkeypatch.setattr(cost, "_count_forward", never)
    assert forward_stats("cnn-small", (), (1, 28, 28), 10) == first
    forward_stats.cache_clear()


HOST = StepFit(step_overhead_us=500, layer_overhead_us=3, conv_overhead_us=300, conv_gflops=250, transposed_conv_gflops=80,
               linear_gflops=90,
               random_ns_per_element=10, traffic_ns_per_byte=0.08, tensor_overhead_us=15, param_overhead_ns=1.5,
               activation_factor=1.6, memory_overhead_bytes=11e6, largest_tensor_factor=2.5)


def synthetic_rows(n: int = 14, staged: bool = True) -> list[dict]:
    """Steps a host with the terms of HOST would measure, for varied made-up models."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(n):
        stats = ForwardStats(operators=int(rng.integers(10, 300)), conv_operators=int(rng.integers(0, 50)),
                             conv_flops=float(rng.uniform(0, 1e7)), transposed_conv_flops=float(rng.uniform(0, 5e6)),
                             linear_flops=float(rng.uniform(0, 2e7)),
                             random_elements=float(rng.uniform(0, 1e5)), traffic_bytes=float(rng.uniform(1e4, 1e7)),
                             new_bytes=float(rng.uniform(1e4, 3e6)), param_tensors=int(rng.integers(4, 160)),
                             largest_param_bytes=int(rng.uniform(1e4, 2e7)))
        params = int(rng.uniform(1e4, 5e6))
        optimizer = (HOST.step_overhead_us * 0.2 + stats.param_tensors * HOST.tensor_overhead_us) * 1e-6 + params * HOST.param_overhead_ns * 1e-9
        rows.append({"stats": stats, "params": params, "batch": 32, "step_s": HOST.step_seconds(stats, params, 32),
                     "memory_measured": HOST.memory_bytes(params, 8, stats, 32),
                     **({"optimizer_s": optimizer} if staged else {})})
    return rows


@pytest.mark.parametrize("staged", [True, False], ids=["optimizer-timed-apart", "one-stage"])
def test_step_model_fit_recovers_known_host_terms(staged):
    rows = synthetic_rows(staged=staged)
    fit = fit_step_model(rows)
    for key, value in vars(HOST).items():
        assert getattr(fit, key) == pytest.approx(value, rel=1e-3), key
    r = rows[3]
    assert fit.step_seconds(r["stats"], r["params"], 32) == pytest.approx(r["step_s"], rel=1e-6)


def test_profile_overheads_enter_the_estimate():
    base = board(1e9, gflops=10.0)
    tuned = board(1e9, gflops=10.0)
    tuned.compute.layer_overhead_us = tuned.compute.layer_overhead_us.model_validate({"value": 100, "kind": "measured", "source": "t"})
    tuned.memory.step_overhead_bytes = tuned.memory.step_overhead_bytes.model_validate({"value": 5e6, "kind": "measured", "source": "t"})
    a = estimate("lenet5", profile=base, batch=32, samples=64)
    b = estimate("lenet5", profile=tuned, batch=32, samples=64)
    assert b.train_memory_bytes - a.train_memory_bytes == 5_000_000
    # 2 steps x 15 forward operators (LeNet-5: 2 conv, 3 addmm, 4 relu_, 2 pools, 3 transposes, 1 view) x 100 us
    assert b.compute_s - a.compute_s == pytest.approx(2 * 15 * 100e-6)


def test_a_measured_profile_estimates_with_its_full_step_fit():
    profile = board(1e9, gflops=10.0)
    measured = {"kind": "measured", "source": "t"}
    for key in ("step_overhead_us", "layer_overhead_us", "conv_overhead_us", "conv_gflops", "transposed_conv_gflops", "linear_gflops",
                "random_ns_per_element", "traffic_ns_per_byte", "tensor_overhead_us", "param_overhead_ns"):
        setattr(profile.compute, key, Quantity(value=getattr(HOST, key), **measured))
    for key, attr in (("activation_factor", "activation_factor"), ("step_overhead_bytes", "memory_overhead_bytes"),
                      ("largest_tensor_factor", "largest_tensor_factor")):
        setattr(profile.memory, key, Quantity(value=getattr(HOST, attr), **measured))
    assert StepFit.from_profile(profile) == HOST
    stats = forward_stats("vgg9", (), (1, 28, 28), 10)
    assert stats.conv_operators == 4 and stats.param_tensors == 14 and stats.random_elements > 0
    info = model_info("vgg9")
    e = estimate("vgg9", profile=profile, batch=32, samples=100, optimizer="adam")
    assert e.compute_s == pytest.approx(4 * HOST.step_seconds(stats, info.params, 32))  # 100 samples: 4 steps of 32
    assert e.train_memory_bytes == int(HOST.memory_bytes(info.params, 8, stats, 32))
    # an SGD estimate holds no optimizer state
    assert estimate("vgg9", profile=profile, batch=32, optimizer="sgd").train_memory_bytes == pytest.approx(
        e.train_memory_bytes - 8 * info.params, abs=1)


def test_operator_statistics_sort_work_by_kind():
    """Dropout draws one random number per element; a CVAE's noise too; residual additions are
    in place (no new bytes) but move memory; a transposed convolution counts as a convolution."""
    fedhe = forward_stats("fedhe-cnn-0", (), (1, 28, 28), 10)
    assert fedhe.random_elements > 1000 and fedhe.conv_operators == 2
    resnet = forward_stats("resnet10", (), (1, 28, 28), 10)
    assert resnet.random_elements == 0 and resnet.traffic_bytes > resnet.new_bytes > 0
    cvae = forward_stats("cvae-large", (), (1, 28, 28), 10)
    assert cvae.conv_flops > 0 and cvae.transposed_conv_flops > 0 and cvae.linear_flops > 0 and cvae.random_elements > 0
    assert resnet.transposed_conv_flops == 0


def test_the_client_runtime_footprint_caps_the_training_budget():
    from edgefl.profile.assign import training_budget

    prof = board(300 * 2**20)
    assert training_budget(prof) == 300 * 2**20  # no runtime known: the profile's budget
    raw = prof.model_dump(by_alias=True)
    raw["memory"]["ram_bytes"] = {"value": 512 * 2**20, "kind": "spec", "source": "test"}
    raw["memory"]["runtime_bytes"] = {"value": 400 * 2**20, "kind": "measured", "source": "test"}
    capped = DeviceProfile.model_validate(raw)
    assert training_budget(capped) == 112 * 2**20  # a budget that forgot the runtime is capped
    lean = [("cnn-small", {}), ("vgg9", {})]
    assert assign(capped, Budgets(deadline_s=1e9), candidates=lean).chosen.label == "cnn-small"
