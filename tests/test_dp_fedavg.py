"""Device-level DP-FedAvg (the ``dp-fedavg`` filter): clipping and noise by hand on small tensors,
the accountant's epsilon against Opacus' own, same seed same noise, simulation and fleet equal,
with secure aggregation the noise added on the devices, bad options refused with the key named."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from edgefl.config import validate_config
from edgefl.errors import ConfigError, PayloadError
from edgefl.filters.dp import META, DPFedAvg, DPFedAvgOptions
from edgefl.messages import Message
from edgefl.privacy.accounting import Gaussian, noise_for
from edgefl.rundir import RunDir
from tests.conftest import method_config
from tests.test_every_method import _records


def _config(dp: dict | None = None, rounds: int = 2, secagg: bool = False, mlps_only: bool = False, **extra):
    raw = method_config("fedavg", rounds=rounds)
    raw["threads"] = 1
    raw["network"] = {"federation": "dp-fedavg-test", "round_deadline_s": 60}
    if mlps_only:
        raw["fleet"] = {"groups": [{"model": "mlp", "count": 3, "options": {"hidden": [32, 16]}},
                                   {"model": "mlp", "count": 3, "options": {"hidden": [24]}}]}
    raw["filters"] = ([{"name": "dp-fedavg", **dp}] if dp is not None else []) + ([{"name": "secagg"}] if secagg else [])
    raw.update(extra)
    return validate_config(raw)


def _device(options: dict, chain=("dp-fedavg",)) -> DPFedAvg:
    f = DPFedAvg(DPFedAvgOptions(**options), side="device", seed=0, device="client-0")
    f.chain = tuple(chain)
    return f


def test_an_update_is_clipped_to_the_l2_norm_by_hand():
    f = _device({"clip": 1.0, "noise_multiplier": 1.0})
    start = {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0])}
    f.download_in(Message("weights", 1, "server", start, {}))
    trained = {"w": torch.tensor([4.0, 5.0]), "b": torch.tensor([0.0])}  # update (3, 4, 0): norm 5
    out = f.upload_out(Message("weights", 1, "client-0", trained, {"num_samples": 37}))
    assert torch.allclose(out.tensors["w"], torch.tensor([1.0 + 0.6, 1.0 + 0.8]))  # (3, 4) / 5 x 1
    assert out.meta["num_samples"] == 1 and out.meta[META] == {"clipped": True}
    small = f.upload_out(Message("weights", 1, "client-0", {"w": torch.tensor([1.3, 1.4]), "b": torch.tensor([0.0])},
                                 {"num_samples": 3}))
    assert torch.allclose(small.tensors["w"], torch.tensor([1.3, 1.4]))  # norm 0.5 <= 1: unchanged


def test_the_server_adds_noise_of_z_times_clip_to_the_sum_by_hand():
    server = DPFedAvg(DPFedAvgOptions(clip=2.0, noise_multiplier=0.5), side="server", seed=3)
    server.prepare({"groups": {"a": "g", "b": "g"}, "rounds": 1, "sample_rate": 1.0, "expected_per_group": {"g": 2}})
    ref = {"w": torch.zeros(4)}
    for d in ("a", "b"):
        server.download_out(d, Message("weights", 1, "server", ref, {}))
    assert server.collect(Message("weights", 1, "a", {"w": torch.tensor([1.0, 0, 0, 0])}, {"num_samples": 1})).status == "accepted"
    assert server.collect(Message("weights", 1, "b", {"w": torch.tensor([0, 1.0, 0, 0])}, {"num_samples": 1})).status == "accepted"
    over = server.collect(Message("weights", 1, "b", {"w": torch.tensor([0, 3.0, 0, 0])}, {"num_samples": 1}, message_id="x"))
    assert over.status == "rejected"
    (mean,) = server.release(1)
    gen = torch.Generator().manual_seed(__import__("edgefl.seeding", fromlist=["derive_seed"]).derive_seed(3, "dp-fedavg", 1, "g"))
    noise = torch.randn(4, generator=gen, dtype=torch.float64) * 0.5 * 2.0
    expected = (torch.tensor([1.0, 1.0, 0, 0], dtype=torch.float64) + noise) / 2
    assert torch.allclose(mean.tensors["w"].double(), expected.float().double(), atol=1e-6)
    assert mean.num_samples == 2 and mean.sender == "a"
    unclipped = DPFedAvg(DPFedAvgOptions(clip=1.0, noise_multiplier=1.0), side="server", seed=0)
    unclipped.prepare({"groups": {"a": "g"}})
    unclipped.download_out("a", Message("weights", 1, "server", ref, {}))
    refused = unclipped.collect(Message("weights", 1, "a", {"w": torch.tensor([2.0, 0, 0, 0])}, {"num_samples": 1}))
    assert refused.status == "rejected" and "exceeds clip" in refused.reason


def test_the_accountant_agrees_with_opacus_own_and_derives_the_noise_for_a_target():
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for _ in range(30):
        accountant.step(noise_multiplier=1.1, sample_rate=0.1)
    assert math.isclose(Gaussian(1.1, 0.1, 30).epsilon(1e-5), accountant.get_epsilon(1e-5), rel_tol=0.02)
    # an independent implementation: Google's dp-accounting 0.6.0 (RdpAccountant, PoissonSampledDpEvent of a
    # GaussianDpEvent, composed 1,000 times) gives 1.7117701662429012 for z = 1.1, q = 0.01, delta = 1e-5
    assert math.isclose(Gaussian(1.1, 0.01, 1000).epsilon(1e-5), 1.7117701662429012, rel_tol=1e-4)
    z = noise_for(8.0, 1e-5, 0.1, 30)
    assert Gaussian(z, 0.1, 30).epsilon(1e-5) <= 8.0 + 0.05
    assert Gaussian(z * 0.9, 0.1, 30).epsilon(1e-5) > 8.0  # not far more noise than needed


def test_a_dp_run_records_epsilon_every_round_and_the_same_seed_gives_the_same_numbers(tmp_path):
    from edgefl.sim import Simulation

    cfg = _config({"clip": 1.0, "noise_multiplier": 0.8})
    runs = []
    for name in ("one", "two"):
        Simulation(cfg, RunDir.create(tmp_path / name, cfg.name, cfg.seed), show_progress=False).run()
        runs.append(_records(tmp_path / name))
    assert runs[0] == runs[1]
    facts = [r["filters"]["dp-fedavg"] for r in runs[0]]
    assert [f["releases"] for f in facts] == [1, 2]
    assert math.isclose(facts[-1]["epsilon"], Gaussian(0.8, 1.0, 2).epsilon(1e-5), rel_tol=1e-4)
    assert facts[0]["epsilon"] < facts[1]["epsilon"]


def test_noise_changes_the_model_and_no_noise_with_a_large_clip_is_uniform_fedavg(tmp_path):
    from edgefl.sim import Simulation

    quiet = Simulation(_config({"clip": 1e5, "noise_multiplier": 0.0}, rounds=1), show_progress=False)
    quiet.run()
    noisy = Simulation(_config({"clip": 1e5, "noise_multiplier": 1e-3}, rounds=1), show_progress=False)
    noisy.run()
    a, b = quiet.server.global_models(), noisy.server.global_models()
    assert any(not torch.equal(a[g][k], b[g][k]) for g in a for k in a[g] if a[g][k].is_floating_point())


def test_a_target_epsilon_derives_the_noise_or_refuses_a_run_that_would_pass_it():
    cfg = _config({"clip": 1.0, "target_epsilon": 4.0}, rounds=5)
    assert cfg.filters[0].name == "dp-fedavg"
    with pytest.raises(ConfigError, match="spends epsilon .* more than target_epsilon 1"):
        _config({"clip": 1.0, "noise_multiplier": 0.3, "target_epsilon": 1.0}, rounds=50)


@pytest.mark.parametrize("bad, key", [({"clip": 0, "noise_multiplier": 1.0}, "clip"), ({"noise_multiplier": -1.0}, "noise_multiplier"),
                                      ({"noise_multiplier": 1.0, "delta": 1.0}, "delta"), ({}, "target_epsilon")])
def test_bad_options_are_refused_with_the_key_named(bad, key):
    with pytest.raises(ConfigError, match=key):
        _config(bad)


def test_knowledge_methods_and_asynchronous_runs_are_refused():
    raw = method_config("fedhe", rounds=1)
    raw["filters"] = [{"name": "dp-fedavg", "noise_multiplier": 1.0}]
    with pytest.raises(ConfigError, match="local-dp"):
        validate_config(raw)


def test_under_secure_aggregation_the_devices_add_the_noise_and_the_sum_carries_it(monkeypatch, tmp_path):
    from edgefl.sim import Simulation

    shares = []
    real = DPFedAvg.upload_out

    def upload_out(self, message):
        out = real(self, message)
        shares.append(getattr(self, "_share", None))
        return out

    monkeypatch.setattr(DPFedAvg, "upload_out", upload_out)
    cfg = _config({"clip": 1.0, "noise_multiplier": 0.5}, rounds=2, secagg=True, mlps_only=True)
    Simulation(cfg, RunDir.create(tmp_path / "run", cfg.name, cfg.seed), show_progress=False).run()
    records = _records(tmp_path / "run")
    assert [r["outcome"] for r in records] == ["complete", "complete"]
    assert set(shares) == {3}  # each of a group's three devices adds a third of the variance
    assert records[-1]["filters"]["dp-fedavg"]["releases"] == 2 and records[-1]["filters"]["secagg"]["secured"]
    with pytest.raises(ConfigError, match="before secagg"):
        raw = method_config("fedavg", rounds=1)
        raw["filters"] = [{"name": "secagg"}, {"name": "dp-fedavg", "noise_multiplier": 1.0}]
        validate_config(raw)


def test_under_secure_aggregation_a_sum_short_of_devices_is_counted_at_its_lower_noise(monkeypatch, caplog):
    """Devices split the noise over the e a round expects; a sum of m < e carries noise multiplier
    z sqrt(m / e), and the accountant must count that, not z (the record and the log say so)."""
    import logging

    from edgefl.filters.secagg import SecAgg
    from edgefl.privacy.accounting import composed_epsilon
    from edgefl.sim import Simulation

    raw = method_config("fedavg", rounds=2)
    raw.update(threads=1, network={"federation": "dp-fedavg-short", "round_deadline_s": 60},
               fleet={"groups": [{"model": "mlp", "count": 5, "options": {"hidden": [16]}}]},
               filters=[{"name": "dp-fedavg", "clip": 1.0, "noise_multiplier": 0.5}, {"name": "secagg", "neighbours": 4, "threshold": 2}])
    sim = Simulation(validate_config(raw), show_progress=False)
    real_in = SecAgg.download_in

    def download_in(self, message):
        if self.device == "client-2" and message.round == 1 and ".secagg/shares" in message.tensors:
            self._mine = None  # the process restarted after sharing: it drops out of round 1's sum
        return real_in(self, message)

    monkeypatch.setattr(SecAgg, "download_in", download_in)
    with caplog.at_level(logging.WARNING, logger="edgefl.server"):
        first = sim.run_round(1)
    second = sim.run_round(2)
    assert "client-2" not in first["reported"] and "client-2" in second["reported"]
    dp1, dp2 = first["filters"]["dp-fedavg"], second["filters"]["dp-fedavg"]
    assert first["outcome"] in ("complete", "deadline"), first.get("failure")
    reduced = round(0.5 * math.sqrt(4 / 5), 6)
    assert dp1["released_noise_multiplier"] == reduced and "held 4 of the 5 devices" in dp1["short_because"]
    assert "not 0.5" in caplog.text and "over_select" in caplog.text
    from edgefl.report import privacy_notes

    assert f"noise multiplier {reduced:.3g} this round" in privacy_notes(first)[0]
    assert "released_noise_multiplier" not in dp2 and dp2["short_releases"] == 1 and dp2["releases"] == 2
    q = dp2["sample_rate"]
    honest = composed_epsilon([Gaussian(0.5, q, 1), Gaussian(reduced, q, 1)], 1e-5)
    assert math.isclose(dp2["epsilon"], honest, rel_tol=1e-5) and dp2["epsilon"] > Gaussian(0.5, q, 2).epsilon(1e-5)
    # a resumed server counts it too
    dp = next(f for f in sim.session.filters if f.name == "dp-fedavg")
    again = DPFedAvg(DPFedAvgOptions(clip=1.0, noise_multiplier=0.5), side="server", seed=0)
    again.load_server_state(dp.server_state())
    again.noise_multiplier, again._sample_rate = 0.5, q
    assert math.isclose(again._epsilon(), honest, rel_tol=1e-9)
    with pytest.raises(PayloadError, match="short releases"):
        again.load_server_state({"released": 1, "clip": 1.0, "short_releases": [[0.4, 2]]})


def test_a_dp_fleet_writes_the_simulation_s_records(tmp_path):
    from edgefl.fleet.launcher import run_device, serve
    from edgefl.sim import Simulation
    from tests.mosquitto import mosquitto

    cfg = _config({"clip": 1.0, "noise_multiplier": 0.5}, mlps_only=True)
    Simulation(cfg, RunDir.create(tmp_path / "sim", cfg.name, cfg.seed), show_progress=False).run()
    with mosquitto(tmp_path) as broker:
        results: dict = {}
        server = threading.Thread(target=lambda: results.update(
            summary=serve(cfg, broker, RunDir.create(tmp_path / "fleet", cfg.name, cfg.seed), join_timeout_s=60)), daemon=True)
        server.start()
        devices = [threading.Thread(target=run_device, args=(cfg, f"client-{i}", broker), kwargs={"timeout_s": 120}, daemon=True)
                   for i in range(6)]
        for d in devices:
            d.start()
        server.join(240)
        for d in devices:
            d.join(30)
    assert "summary" in results
    assert _records(tmp_path / "fleet") == _records(tmp_path / "sim")


def test_the_summary_carries_the_epsilon_the_run_spent(tmp_path):
    import json

    from edgefl.sim import Simulation

    cfg = _config({"clip": 1.0, "noise_multiplier": 0.8})
    Simulation(cfg, RunDir.create(tmp_path / "run", cfg.name, cfg.seed), show_progress=False).run()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert math.isclose(summary["privacy"]["dp-fedavg"]["epsilon"], Gaussian(0.8, 1.0, 2).epsilon(1e-5), rel_tol=1e-4)


def test_adaptive_clipping_moves_the_clip_toward_the_quantile_of_update_norms():
    """Every update under a huge clip: the noised share of unclipped updates is about 1 > 0.5, so
    the clip shrinks by about exp(-0.2 x 0.5) a round; a tiny clip grows."""
    from edgefl.sim import Simulation

    big = Simulation(_config({"clip": 100.0, "noise_multiplier": 0.01, "adaptive": True, "count_noise": 0.05}, rounds=3),
                     show_progress=False)
    clips = [r["filters"]["dp-fedavg"]["clip"] for r in (big.run_round(n) for n in (1, 2, 3))]
    assert clips[0] < 100.0 and clips[1] < clips[0] and clips[2] < clips[1]
    assert math.isclose(clips[0], 100.0 * math.exp(-0.2 * 0.5), rel_tol=0.02)
    small = Simulation(_config({"clip": 1e-4, "noise_multiplier": 0.01, "adaptive": True, "count_noise": 0.05}, rounds=2),
                       show_progress=False)
    grown = small.run_round(1)["filters"]["dp-fedavg"]["clip"]
    assert math.isclose(grown, 1e-4 * math.exp(0.2 * 0.5), rel_tol=0.02)


def test_adaptive_clipping_spends_no_more_than_its_noise_multiplier_and_is_refused_with_secagg():
    f = DPFedAvg(DPFedAvgOptions(clip=1.0, noise_multiplier=1.0, adaptive=True, count_noise=2.0), side="server", seed=0)
    f.prepare({"expected_per_group": {"g": 10}})
    assert math.isclose(f._update_noise(), (1.0 - (2 * 2.0) ** -2) ** -0.5)
    raw = method_config("fedavg", rounds=1)
    raw["filters"] = [{"name": "dp-fedavg", "noise_multiplier": 1.0, "adaptive": True}, {"name": "secagg"}]
    with pytest.raises(ConfigError, match="adaptive clipping"):
        validate_config(raw)
    with pytest.raises(ConfigError, match="raise count_noise"):
        _config({"clip": 1.0, "noise_multiplier": 1.0, "adaptive": True, "count_noise": 0.1})


def test_the_console_line_the_report_and_the_dashboard_say_the_epsilon_spent(tmp_path):
    from edgefl.dashboard.app import snapshot
    from edgefl.sim import Simulation
    from edgefl.sim.engine import round_line

    cfg = _config({"clip": 1.0, "noise_multiplier": 0.8})
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    Simulation(cfg, run, show_progress=False).run()
    records = _records(tmp_path / "run")
    eps = records[-1]["filters"]["dp-fedavg"]["epsilon"]
    line = round_line(json_record := __import__("json").loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1]), 2)
    assert f"dp-fedavg epsilon {eps:.3g} (delta 1e-05)" in line, line
    snap = snapshot(run.path)
    assert snap["rounds"][-1]["privacy"]["dp-fedavg"]["epsilon"] == json_record["filters"]["dp-fedavg"]["epsilon"]
    script = (__import__("pathlib").Path(__file__).resolve().parent.parent / "edgefl/dashboard/static/app.js").read_text()
    assert "epsilon spent" in script and "privacy-now" in script
