"""Asynchronous runs (mode = "async"): FedBuff and FedAsync arithmetic, knowledge merged per report,
the staleness bound, the virtual clock driven by device classes, reproducibility, config errors,
and a fleet over a real mosquitto with a device joining late and one leaving mid-run."""

from __future__ import annotations

import threading

import pytest
import torch

from edgefl.config import RunConfig
from edgefl.messages import Message
from edgefl.server.asynchronous import AsyncAggregator, staleness_discount
from edgefl.server.methods.base import ClientInfo
from edgefl.server.session import TIMING_FIELDS
from tests.conftest import digits_config


def async_config(method: str = "fedhe", rounds: int = 12, **settings) -> RunConfig:
    raw = digits_config(method, rounds=rounds, mode="async", threads=1)
    raw["eval"] = {"every": 6}
    if settings:
        raw["asynchronous"] = settings
    return RunConfig.model_validate(raw)


def _fedavg_server():
    from edgefl.algorithms.fedavg import FedAvgOptions
    from edgefl.server.methods.fedavg import FedAvgServer

    clients = [ClientInfo(f"c{i}", "mlp", "mlp", {"hidden": [4]}, num_samples=10 * (i + 1)) for i in range(3)]
    return FedAvgServer(clients, FedAvgOptions(), seed=0, num_classes=3, input_shape=(1, 2, 2))


def _report(server, sender: str, start: dict[str, torch.Tensor], shift: float, round_no: int = 1) -> Message:
    tensors = {k: (v + shift) if v.is_floating_point() else v.clone() for k, v in start.items()}
    return Message("weights", round_no, sender, tensors, {"num_samples": server.clients[sender].num_samples})


def test_fedbuff_applies_the_sample_weighted_mean_of_discounted_deltas():
    from edgefl.config import AsyncSettings

    server = _fedavg_server()
    agg = AsyncAggregator(server, AsyncSettings(buffer_size=2, server_lr=0.5, staleness_exponent=0.5), True, 3)
    w0 = {k: v.clone() for k, v in server.global_models()["mlp"].items()}
    k0 = agg.handed_out("c0")
    agg.add(_report(server, "c0", w0, 1.0), k0, 0)  # delta +1, fresh
    assert agg.version == 0  # the buffer holds one of two
    k1 = agg.handed_out("c1")
    agg.add(_report(server, "c1", w0, 2.0), k1, 3)  # delta +2, 3 updates old
    assert agg.version == 1
    s0, s1 = 1.0, staleness_discount(3, 0.5)
    n0, n1 = 10, 20
    expected_step = 0.5 * (n0 * s0 * 1.0 + n1 * s1 * 2.0) / (n0 + n1)
    name = next(k for k, v in w0.items() if v.is_floating_point())
    got = server.global_models()["mlp"][name] - w0[name]
    assert torch.allclose(got, torch.full_like(got, expected_step), atol=1e-6)


def test_fedasync_mixes_each_report_in_at_a_discounted_rate_and_a_device_started_later_steps_from_its_own_start():
    from edgefl.config import AsyncSettings

    server = _fedavg_server()
    agg = AsyncAggregator(server, AsyncSettings(aggregation="fedasync", mixing=0.5, staleness_exponent=1.0), True, 3)
    assert agg.buffer_size == 1
    w0 = {k: v.clone() for k, v in server.global_models()["mlp"].items()}
    name = next(k for k, v in w0.items() if v.is_floating_point())
    k0 = agg.handed_out("c0")
    agg.add(_report(server, "c0", w0, 4.0), k0, 0)
    w1 = server.global_models()["mlp"][name].clone()
    assert torch.allclose(w1 - w0[name], torch.full_like(w1, 0.5 * 4.0), atol=1e-6)
    k2 = agg.handed_out("c2")
    agg.add(_report(server, "c2", w0, 4.0), k2, 1)  # mixes with the current model at 0.5 / 2
    w2 = server.global_models()["mlp"][name]
    assert torch.allclose(w2, w1 + 0.25 * ((w0[name] + 4.0) - w1), atol=1e-6)
    assert not agg._starts or all(n > 0 for n in agg._users.values())


def test_a_device_reporting_twice_before_the_buffer_fills_closes_it_first():
    from edgefl.config import AsyncSettings

    server = _fedavg_server()
    agg = AsyncAggregator(server, AsyncSettings(buffer_size=3), True, 3)
    w0 = {k: v.clone() for k, v in server.global_models()["mlp"].items()}
    assert agg.add(_report(server, "c0", w0, 1.0), agg.handed_out("c0"), 0).status == "accepted"
    assert agg.add(_report(server, "c0", w0, 1.0), agg.handed_out("c0"), 0).status == "accepted"
    assert agg.version == 1 and agg.collecting == {"c0"}


def test_fedhe_merges_every_report_and_the_same_seed_gives_the_same_numbers():
    from edgefl.sim import Simulation

    cfg = async_config("fedhe", rounds=12)
    runs = []
    for _ in range(2):
        sim = Simulation(cfg, show_progress=False)
        sim.run()
        runs.append([{k: v for k, v in h.items() if k not in TIMING_FIELDS} for h in sim.history])
    first = runs[0]
    assert first == runs[1]
    assert [h["round"] for h in first] == [6, 12]
    assert all(h["mode"] == "async" and h["updates"] == 6 and h["reports"] == 6 for h in first)  # one update per report
    assert first[-1]["accuracy"]["overall"] is not None
    assert first[-1]["downloads"] >= 12 + 4 - 1  # every report earns the device its next download


def test_reports_beyond_the_staleness_bound_are_refused_with_the_reason():
    from edgefl.sim import Simulation

    sim = Simulation(async_config("fedhe", rounds=12, staleness_bound=1), show_progress=False)
    summary = sim.run()
    refused = sum(h["refused_stale"] for h in sim.history)
    assert refused > 0
    reasons = summary["rejections"]["by_reason"]
    assert any(r.startswith("stale: trained from server version") for r in reasons), reasons
    results = [r for loop in sim.network.loops.values() for r in loop.results.values()]
    assert any(r["reply"] == "nack" and "staleness_bound 1" in r["status"] for r in results)
    assert all(h["staleness"]["max"] <= 1 for h in sim.history if h["staleness"])


def test_on_the_virtual_clock_a_fast_device_class_reports_more_often_and_a_time_budget_ends_the_run():
    from edgefl.sim import Simulation

    raw = digits_config("fedhe", rounds=10_000, mode="async", threads=1)
    raw["fleet"] = {"groups": [
        {"model": "fedhe-cnn-0", "count": 2, "profile": "pi4-4gb", "options": {"width": 0.125}},
        {"model": "fedhe-cnn-0", "count": 2, "profile": "pi-zero-2w", "options": {"width": 0.125}},
    ]}
    raw["asynchronous"] = {"time_budget_s": 1.0, "eval_every_s": 0.5}
    sim = Simulation(RunConfig.model_validate(raw), show_progress=False)
    summary = sim.run()
    assert not summary["interrupted"]
    by_class: dict[str, int] = {}
    for h in sim.history:
        for profile, n in h["reports_by_profile"].items():
            by_class[profile] = by_class.get(profile, 0) + n
    assert by_class["pi4-4gb"] > 2 * by_class.get("pi-zero-2w", 0), by_class
    clocks = [h["clock_s"] for h in sim.history]
    assert clocks == sorted(clocks) and clocks[-1] <= 1.0 + 1e-6 and len(clocks) >= 2
    assert sim.history[-1]["round"] < 10_000


def test_weight_methods_run_fedbuff_and_fedasync_end_to_end():
    from edgefl.sim import Simulation

    for aggregation in ("fedbuff", "fedasync"):
        sim = Simulation(async_config("fedavg", rounds=6, aggregation=aggregation), show_progress=False)
        summary = sim.run()
        assert summary["final_accuracy"]["overall"] is not None
        per_update = 2 if aggregation == "fedbuff" else 1  # buffer min(10, 4 // 2)
        assert sum(h["reports"] for h in sim.history) == 6 * per_update


@pytest.mark.parametrize("change, message", [
    ({"method": {"name": "fedmho"}, "rounds": 1}, "one-shot"),
    ({"fleet": {"groups": [{"model": "mlp", "count": 4}], "per_round": 2}}, "concurrency"),
    ({"mode": "sync"}, "apply to mode"),
])
def test_config_refuses_what_async_cannot_do(change, message):
    raw = digits_config("fedhe", mode="async")
    raw["asynchronous"] = {"concurrency": 2}
    raw.update(change)
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate(raw)


def test_when_every_device_at_work_refuses_its_download_the_run_fails_with_the_reason_instead_of_waiting(monkeypatch):
    """A device that cannot use a download (a model that turned non-finite, say) restores its model
    and says nothing, as a real device does; on the virtual clock nothing can then arrive. The work
    is given up and handed out again; three times in a row with no report and the run fails."""
    from edgefl.device import DeviceLoop
    from edgefl.errors import PayloadError
    from edgefl.sim import Simulation

    real = DeviceLoop.fit
    fits = [0]

    def fails_after_four(self, env, downlink=None):
        fits[0] += 1
        if fits[0] > 4:
            raise PayloadError(f"round {env.round}: the model was restored and the download refused (NaN)")
        return real(self, env, downlink)

    monkeypatch.setattr(DeviceLoop, "fit", fails_after_four)
    sim = Simulation(async_config("fedhe", rounds=50), show_progress=False)
    summary = sim.run()
    last = sim.history[-1]
    assert last["outcome"] == "failed" and "no report can arrive" in last["failure"]
    assert last["round"] == 4 and set(last["silent"]) == {"client-0", "client-1", "client-2", "client-3"}
    assert summary["failed_rounds"] == [4] and not summary["interrupted"]


def test_fedbuff_moves_batch_norm_statistics_toward_the_reports_so_a_variance_stays_positive():
    """A step from a stale origin can drive a running variance below zero (FedIN's ResNets went
    NaN asynchronously): statistics take a convex share of the report's value instead."""
    from edgefl.config import AsyncSettings

    server = _fedavg_server()
    agg = AsyncAggregator(server, AsyncSettings(buffer_size=1), True, 3)
    current = {"layer.running_var": torch.full((2,), 0.2), "layer.weight": torch.full((2,), 0.2)}
    server.shared_weights = lambda device: current
    agg._starts[("mlp", 0)] = {"layer.running_var": torch.full((2,), 1.0), "layer.weight": torch.full((2,), 1.0)}
    report = Message("weights", 1, "c0", {"layer.running_var": torch.full((2,), 0.1), "layer.weight": torch.full((2,), 0.1)}, {})
    rebased = agg.rebase(report, ("mlp", 0), staleness=0)
    assert torch.allclose(rebased.tensors["layer.weight"], torch.full((2,), 0.2 - 0.9))  # a parameter: the delta
    assert torch.allclose(rebased.tensors["layer.running_var"], torch.full((2,), 0.1))  # a statistic: the report's


def test_a_fleet_runs_asynchronously_with_a_late_joiner_and_a_leaver(tmp_path):
    """Real device processes over mosquitto: client-3 starts after the run has begun, client-2 is
    killed after it reported; the run goes on, counts both, and the leaver is not waited for."""
    from edgefl.fleet.launcher import serve
    from tests.mosquitto import mosquitto
    from tests.test_fleet import _device, fleet_config, wait_online

    base = fleet_config("fedhe", rounds=10_000, federation="async-fleet")
    raw = base.to_dict()
    raw.update(mode="async", asynchronous={"time_budget_s": 25.0, "eval_every_s": 5.0})
    cfg = RunConfig.model_validate(raw)
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    with mosquitto(tmp_path) as broker:
        procs = {d: _device(path, broker, d, timeout=120) for d in ("client-0", "client-1", "client-2")}
        wait_online(broker, "async-fleet", list(procs))
        reports: dict[str, int] = {}
        lock = threading.Lock()

        def on_event(kind, info):
            if kind != "update":
                return
            with lock:
                reports[info["device"]] = reports.get(info["device"], 0) + 1
                if "client-3" not in procs:
                    procs["client-3"] = _device(path, broker, "client-3", timeout=120)
                if info["device"] == "client-2" and reports["client-2"] == 3:
                    procs["client-2"].kill()

        try:
            summary = serve(cfg, broker, None, on_event=on_event, join_timeout_s=5)
            for d in ("client-0", "client-1", "client-3"):
                assert procs[d].wait(timeout=60) == 0, procs[d].stderr.read().decode()[-2000:]
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    history = summary["history"]
    assert history and all(h["mode"] == "async" for h in history)
    total = {}
    for h in history:
        for d, n in h["reports_per_client"].items():
            total[d] = total.get(d, 0) + n
    assert total.get("client-3", 0) > 0, total  # joined late and took part
    assert total["client-2"] == 3, total  # left after its third report; the run went on without it
    assert total["client-0"] > 3 and total["client-1"] > 3
    assert summary["final_accuracy"] is not None and not summary["interrupted"]


def test_one_device_at_a_time_as_fedhe_s_paper_with_idle_devices_asked_at_each_record():
    from edgefl.sim import Simulation

    raw = digits_config("fedhe", rounds=12, mode="async", threads=1)
    raw["train"]["max_steps"] = 3
    raw["eval"] = {"every": 6}
    raw["asynchronous"] = {"concurrency": 1, "device_accuracy": "at_records"}
    sim = Simulation(RunConfig.model_validate(raw), show_progress=False)
    sim.run()
    assert [h["round"] for h in sim.history] == [6, 12]
    assert [h["downloads"] for h in sim.history] == [6, 12]  # one device at work at any time
    assert all(h["in_flight"] == 0 for h in sim.history)
    assert all(len(h["accuracy"]["per_client"]) == 4 for h in sim.history)  # every device judged, idle ones asked


def test_the_fedhe_paper_preset_is_asynchronous_one_client_at_a_time():
    from edgefl.config import load_config

    cfg = load_config(None, preset="fedhe-paper")
    assert cfg.mode == "async" and cfg.asynchronous.concurrency == 1
    assert (cfg.train.max_steps, cfg.train.batch_size, cfg.train.lr, cfg.train.optimizer) == (3, 50, 1e-3, "adam")
    assert cfg.train.optimizer_state == "kept"  # each client's Adam lives for the run, as in the authors' code
    assert len(cfg.fleet.groups) == 10 and cfg.method.name == "fedhe"


def test_uploads_that_are_not_a_device_s_current_work_are_refused_and_a_resend_gets_the_same_answer():
    from edgefl.messages import encode
    from edgefl.sim import Simulation
    from edgefl.transport.base import Delivery
    from edgefl.transport.envelope import Envelope, pack, tensor_manifest, unpack

    sim = Simulation(async_config("fedhe", rounds=3), show_progress=False)
    orch = sim.session.endpoint
    loop = sim.session.policy
    loop.wait_for_devices(1.0)
    sent: list[tuple[str, Envelope]] = []
    real_send = sim.network.send
    sim.network.send = lambda device, data: (sent.append((device, unpack(data, 1 << 20))), real_send(device, data))[1]
    loop.fill()
    ticket = loop.tickets["client-0"]

    def upload(round_no: int) -> Envelope:
        message = Message("class_logits", round_no, "client-0", {
            "logits": torch.zeros(1, 10), "classes": torch.tensor([3]), "counts": torch.tensor([5])}, {"num_samples": 50})
        body = encode(message)
        env = Envelope("upload", orch.federation, round_no, "client-0", body, message.message_id, model_version=round_no,
                       codec="safetensors", extra={"tensors": tensor_manifest(message.tensors)})
        sent.clear()
        orch.handle(Delivery("message", "client-0", pack(env)))
        (reply,) = [e for d, e in sent if d == "client-0" and e.type in ("ack", "nack")]
        return reply

    wrong = upload(ticket.number + 50)
    assert wrong.type == "nack" and "not client-0's current work" in wrong.extra["reason"]
    assert loop.tickets["client-0"] is ticket  # a refused stranger's upload does not end the real work
    message = Message("class_logits", ticket.number, "client-0", {
        "logits": torch.zeros(1, 10), "classes": torch.tensor([3]), "counts": torch.tensor([5])}, {"num_samples": 50})
    env = Envelope("upload", orch.federation, ticket.number, "client-0", encode(message), message.message_id,
                   model_version=ticket.number, codec="safetensors", extra={"tensors": tensor_manifest(message.tensors)})
    for expected in ("accepted", "duplicate"):
        sent.clear()
        orch.handle(Delivery("message", "client-0", pack(env)))
        (reply,) = [e for d, e in sent if d == "client-0" and e.type in ("ack", "nack")]
        assert reply.type == "ack" and reply.extra["status"] == expected
        assert reply.extra["info"]["staleness"] == 0
    assert loop.version == 1


def test_an_asynchronous_run_s_tables_count_per_record_and_per_report(tmp_path):
    """An asynchronous record selects no one: its bytes are shared out over the reports it counted."""
    from rich.console import Console

    from edgefl.report import accuracy_table, communication_table, human_bytes
    from edgefl.rundir import RunDir
    from edgefl.sim import Simulation

    cfg = async_config("fedhe", rounds=12)
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    Simulation(cfg, run, show_progress=False).run()
    console = Console(width=200, record=True)
    console.print(communication_table(run), accuracy_table(run))
    text = console.export_text()
    assert "per report" in text and "per client per round" not in text and "best (update)" in text
    metrics = run.metrics()
    up = sum(m["bytes_up"] for m in metrics) / sum(m["reports"] for m in metrics)
    assert human_bytes(up) in text


def test_an_asynchronous_simulation_without_device_classes_says_its_clock_stays_at_zero(caplog):
    """Without profiles every download takes no virtual time: records said "t=0.0s" and nothing
    explained it (an outside trial read it as a stuck clock)."""
    import logging

    from edgefl.sim import Simulation

    with caplog.at_level(logging.WARNING, logger="edgefl.sim"):
        Simulation(async_config("fedhe", rounds=2), show_progress=False).run()
    assert any("virtual clock stays at 0" in r.getMessage() for r in caplog.records)
