"""edgefl device-profile measured on this host: real numbers, a child-process peak, a real broker."""

from __future__ import annotations

import sys

import pytest

from edgefl.errors import EdgeflError
from edgefl.profile import load_profile
from edgefl.profile.cost import StepFit, estimate, forward_stats
from edgefl.profile.measure import ModelCandidate, broker_round_trip, matmul_gflops, measure_model
from tests.mosquitto import free_port, mosquitto
from tests.test_cli import edgefl


def test_model_step_is_measured_in_a_child_process():
    m = measure_model(ModelCandidate("vgg9", {"width": 0.25}), (1, 28, 28), batch=8, steps=2, device="cpu")
    assert "error" not in m, m
    assert m["params"] > 4_000_000 and m["step_s"] > 0 and m["train_gflops"] > 0 and m["infer_s_per_sample"] > 0
    # weights, gradients and Adam's two moments alone exceed the parameter bytes
    assert m["train_memory_bytes"] > m["param_bytes"] > 0
    assert m["peak_rss_bytes"] > m["baseline_rss_bytes"]


def test_generator_and_failure_are_reported_as_data():
    cvae = measure_model(ModelCandidate("cvae-small"), (1, 28, 28), batch=8, steps=2, device="cpu")
    assert cvae["flops_per_sample"] > 0 and cvae["train_memory_bytes"] > 0
    bad = measure_model(ModelCandidate("lenet5"), (1, 8, 8), batch=4, steps=1, device="cpu")
    assert "error" in bad


def test_matmul_speed_is_positive():
    import torch

    assert matmul_gflops(128, 0.05, torch.device("cpu")) > 0


def test_candidate_parsing():
    c = ModelCandidate.parse("resnet18:width=0.25,stem=small")
    assert c.name == "resnet18" and c.options == {"width": 0.25, "stem": "small"}
    assert c.label == "resnet18(stem=small,width=0.25)"
    with pytest.raises(EdgeflError, match="key=value"):
        ModelCandidate.parse("resnet18:width")
    with pytest.raises(EdgeflError, match="did you mean 'resnet18'"):
        ModelCandidate.parse("resnet19")


def test_cli_quick_profile_writes_a_loadable_measured_profile(tmp_path):
    out = tmp_path / "host.toml"
    res = edgefl("device-profile", "--quick", "--models", "cnn-small,lenet5,cvae-small", "--out", str(out), "--id", "test-host")
    assert res.returncode == 0, res.stderr
    assert "training step" in res.stdout and "cnn-small" in res.stdout
    p = load_profile(out)
    assert p.id == "test-host"
    for q in (p.cpu.cores, p.memory.ram_bytes, p.memory.storage_bytes, p.compute.matmul_gflops, p.compute.effective_gflops):
        assert q.kind == "measured" and q.value > 0 and "edgefl device-profile" in q.source
    # the client runtime's own footprint is measured and taken out of the training budget
    assert p.memory.runtime_bytes.kind == "measured" and 50 * 2**20 < p.memory.runtime_bytes.value < p.memory.ram_bytes.value
    assert "client runtime's footprint" in p.memory.training_budget_bytes.source
    m = p.measurements["models"][0]
    assert m["train_memory_bytes"] > 0 and 0 < m["optimizer_s"] < m["step_s"]
    if sys.platform == "linux":  # anonymous memory: file-backed library pages vary with the page cache
        assert m["memory_method"] == "RssAnon"
    # three models are too few for the step fit: its terms stay unknown, estimates use the effective speed
    assert StepFit.from_profile(p) is None and not p.compute.conv_gflops.known
    e = estimate("lenet5", profile=p, batch=32, samples=64)
    assert e.compute_s == pytest.approx(3 * e.flops_per_sample * 64 / (p.compute.effective_gflops.value * 1e9))


def test_profile_with_enough_models_carries_the_step_fit_used_by_estimates(tmp_path):
    out = tmp_path / "host.toml"
    models = "cnn-small,lenet5,cvae-small,fedhe-cnn-5:width=0.25,resnet10:width=0.125,vgg9:width=0.125"
    res = edgefl("device-profile", "--quick", "--batch", "8", "--models", models, "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "step fit" in res.stdout and "memory fit" in res.stdout  # the fitted terms are shown
    p = load_profile(out)
    fit = StepFit.from_profile(p)
    assert fit is not None and p.compute.conv_gflops.kind == "measured" and p.memory.largest_tensor_factor.known
    e = estimate("lenet5", profile=p, batch=8, samples=16)
    assert e.compute_s == pytest.approx(2 * fit.step_seconds(forward_stats("lenet5", (), (1, 28, 28), 10), e.params, 8))


def test_broker_round_trip_against_real_mosquitto(tmp_path):
    with mosquitto(tmp_path) as url:
        r = broker_round_trip(url, messages=5, size=16 * 1024)
    assert r["rtt_ms_p50"] > 0 and r["throughput_mbps"] > 0


def test_unreachable_broker_and_bad_url():
    with pytest.raises(EdgeflError, match="cannot reach the broker"):
        broker_round_trip(f"mqtt://127.0.0.1:{free_port()}", messages=1)
    with pytest.raises(EdgeflError, match="expected mqtt://HOST:PORT"):
        broker_round_trip("http://127.0.0.1:1", messages=1)


def test_cli_bad_model_is_a_clear_error():
    res = edgefl("device-profile", "--models", "resnet19")
    assert res.returncode == 2 and "did you mean 'resnet18'" in res.stderr and "Traceback" not in res.stderr
