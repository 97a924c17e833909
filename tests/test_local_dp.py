"""Local DP of knowledge uploads (the ``local-dp`` filter): clipping and noise by hand, each
device's epsilon from the accountant, same seed same numbers, simulation and fleet alike, with
secure aggregation after it, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

from edgefl.config import validate_config
from edgefl.errors import ConfigError
from edgefl.filters.local_dp import LocalDP, LocalDPOptions
from edgefl.messages import Message
from edgefl.privacy.accounting import Gaussian
from edgefl.rundir import RunDir
from edgefl.seeding import derive_seed
from tests.conftest import method_config
from tests.test_every_method import _records


def _config(method: str = "fedhe", dp: dict | None = None, rounds: int = 2, secagg: bool = False):
    raw = method_config(method, rounds=rounds)
    raw["threads"] = 1
    raw["network"] = {"federation": f"local-dp-{method}", "round_deadline_s": 60}
    raw["filters"] = [{"name": "local-dp", **(dp or {"noise_multiplier": 0.5})}] + ([{"name": "secagg"}] if secagg else [])
    return validate_config(raw)


def test_fedhe_rows_are_clipped_and_noised_with_the_upload_s_sensitivity_by_hand():
    f = LocalDP(LocalDPOptions(clip=1.0, noise_multiplier=0.25), side="device", seed=4, device="client-0")
    logits = torch.tensor([[3.0, 4.0, 0.0], [0.3, 0.4, 0.0]])  # norms 5 and 0.5
    out = f.upload_out(Message("class_logits", 2, "client-0", {"logits": logits, "classes": torch.tensor([0, 2]),
                                                                "counts": torch.tensor([5, 1])}, {"num_samples": 6}))
    clipped = torch.tensor([[0.6, 0.8, 0.0], [0.3, 0.4, 0.0]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(derive_seed(4, "local-dp", "client-0", 2))
    noise = torch.randn((2, 3), generator=gen, dtype=torch.float64) * 0.25 * 2 * 1.0 * math.sqrt(3)
    assert torch.allclose(out.tensors["logits"].double(), (clipped + noise).float().double(), atol=1e-6)
    assert torch.equal(out.tensors["classes"], torch.tensor([0, 2]))


def test_chfl_s_head_change_is_clipped_and_noised_by_hand():
    f = LocalDP(LocalDPOptions(clip=1.0, noise_multiplier=0.5), side="device", seed=4, device="client-1")
    down = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    f.download_in(Message("head", 3, "server", down, {}))
    up = {"weight": torch.tensor([[3.0, 0.0], [0.0, 0.0]]), "bias": torch.tensor([0.0, 4.0])}  # change of norm 5
    out = f.upload_out(Message("head", 3, "client-1", up, {"num_samples": 9}))
    gen = torch.Generator().manual_seed(derive_seed(4, "local-dp", "client-1", 3))
    # sorted names: bias then weight, one noise stream over the flattened change, sd z x 2 clip
    flat = torch.tensor([0.0, 0.8, 0.6, 0.0, 0.0, 0.0], dtype=torch.float64)  # (bias, weight) scaled by 1/5
    flat = flat + torch.randn(6, generator=gen, dtype=torch.float64) * 0.5 * 2 * 1.0
    assert torch.allclose(out.tensors["bias"].double(), flat[:2].float().double(), atol=1e-6)
    assert torch.allclose(out.tensors["weight"].double(), flat[2:].reshape(2, 2).float().double(), atol=1e-6)


def test_felo_s_class_rows_are_clipped_over_feature_and_logits_together_by_hand():
    from edgefl.filters.local_dp import KNOWLEDGE

    f = LocalDP(LocalDPOptions(clip=2.0, noise_multiplier=0.25), side="device", seed=1, device="client-0")
    feats = torch.tensor([[3.0, 0.0], [0.0, 0.5]])  # rows with the logits: norms 5 and 0.5
    logits = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    weights = torch.ones(3)
    out = f.upload_out(Message("class_features", 2, "client-0", {KNOWLEDGE + "features": feats, KNOWLEDGE + "logits": logits,
                                                                  "w": weights}, {"num_samples": 5}))
    rows = torch.tensor([[1.2, 0.0, 0.0, 1.6], [0.0, 0.5, 0.0, 0.0]], dtype=torch.float64)  # the first scaled to norm 2
    gen = torch.Generator().manual_seed(derive_seed(1, "local-dp", "client-0", 2))
    rows = rows + torch.randn((2, 4), generator=gen, dtype=torch.float64) * 0.25 * 2 * 2.0 * math.sqrt(2)
    assert torch.allclose(out.tensors[KNOWLEDGE + "features"].double(), rows[:, :2].float().double(), atol=1e-6)
    assert torch.allclose(out.tensors[KNOWLEDGE + "logits"].double(), rows[:, 2:].float().double(), atol=1e-6)
    assert torch.equal(out.tensors["w"], weights)  # the weights are not local-dp's to noise


@pytest.mark.parametrize("method", ["fedhe", "chfl", "felo", "velo"])
def test_a_local_dp_run_records_each_device_s_epsilon_and_repeats_with_the_seed(method, tmp_path):
    from edgefl.sim import Simulation

    cfg = _config(method)
    for name in ("one", "two"):
        Simulation(cfg, RunDir.create(tmp_path / name, cfg.name, cfg.seed), show_progress=False).run()
    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert one == two
    facts = one[-1]["filters"]["local-dp"]
    assert set(facts["epsilon_per_device"]) == {f"client-{i}" for i in range(4)}
    assert math.isclose(facts["epsilon_max"], Gaussian(0.5, 1.0, 2).epsilon(1e-5), rel_tol=1e-4)


def test_local_dp_runs_under_secure_aggregation(tmp_path):
    from edgefl.sim import Simulation

    cfg = _config("fedhe", secagg=True)
    Simulation(cfg, RunDir.create(tmp_path / "run", cfg.name, cfg.seed), show_progress=False).run()
    records = _records(tmp_path / "run")
    assert [r["outcome"] for r in records] == ["complete", "complete"]
    assert records[-1]["filters"]["secagg"]["secured"] and records[-1]["filters"]["local-dp"]["epsilon_max"] > 0


def test_weight_methods_and_bad_options_are_refused():
    with pytest.raises(ConfigError, match="dp-fedavg"):
        _config("fedavg")
    from edgefl.algorithms.felo import KNOWLEDGE
    from edgefl.filters import local_dp

    assert local_dp.KNOWLEDGE == KNOWLEDGE
    with pytest.raises(ConfigError, match="noise_multiplier"):
        _config("fedhe", {"noise_multiplier": -1})
    with pytest.raises(ConfigError, match="clip"):
        _config("fedhe", {"noise_multiplier": 1, "clip": 0})
    with pytest.raises(ConfigError, match="delta"):
        _config("fedhe", {"noise_multiplier": 1, "delta": 2})


def test_a_target_epsilon_derives_each_devices_noise_or_refuses_a_run_that_would_pass_it():
    from edgefl.privacy.accounting import noise_for

    cfg = _config("fedhe", {"target_epsilon": 4.0}, rounds=3)
    (name, options), = cfg.filter_chain()  # what the server, a simulated device and a device's task build from
    assert name == "local-dp" and options["noise_multiplier"] == pytest.approx(noise_for(4.0, 1e-5, 1.0, 3), abs=2e-6)
    assert Gaussian(options["noise_multiplier"], 1.0, 3).epsilon(1e-5) <= 4.0  # rounded up, never past the target
    with pytest.raises(ConfigError, match="more than target_epsilon 1"):
        _config("fedhe", {"target_epsilon": 1.0, "noise_multiplier": 0.5}, rounds=3)
    with pytest.raises(ConfigError, match="noise_multiplier or target_epsilon"):
        _config("fedhe", {"clip": 1.0})


def test_a_fleet_writes_the_simulations_records_and_the_servers_accounting_survives_a_restart(tmp_path):
    """A resumed server (edgefl server --resume) goes on counting each device's releases from the
    saved state instead of from zero; a state saved without them is refused."""
    from edgefl.fleet.launcher import run_fleet
    from edgefl.server.session import STATE_FILE, RunSession
    from edgefl.server.state import load_state, save_state
    from edgefl.build import build_run

    cfg = _config("fedhe", {"noise_multiplier": 0.5}, rounds=2)
    run = RunDir.create(tmp_path / "fleet", cfg.name, cfg.seed)
    fleet = run_fleet(cfg, None, run, broker="memory://local-dp-resume", device_timeout_s=120)
    assert set(fleet["device_exit_codes"].values()) == {0}
    from edgefl.sim import Simulation

    Simulation(cfg, RunDir.create(tmp_path / "sim", cfg.name, cfg.seed), show_progress=False).run()
    assert _records(tmp_path / "fleet") == _records(tmp_path / "sim")  # a local-DP fleet writes the simulation's records
    spent = _records(tmp_path / "fleet")[-1]["filters"]["local-dp"]
    restarted = RunSession(build_run(cfg), None, "local-dp-resume", runner="fleet", run_dir=run, deadline_s=60,
                           save_state_each_round=True)
    assert restarted.resume() == 3
    (f,) = restarted.filters
    assert f.round_facts(3) == spent  # every device's two releases, as the first server counted them
    extra = load_state(restarted.server, run.path / STATE_FILE)
    del extra["filters"]
    save_state(restarted.server, run.path / STATE_FILE, extra)
    again = RunSession(build_run(cfg), None, "local-dp-resume", runner="fleet", run_dir=run, deadline_s=60)
    with pytest.raises(ConfigError, match="accounting must go on"):
        again.resume()


def test_an_asynchronous_run_records_each_devices_epsilon_counting_every_upload(tmp_path):
    """An outside trial found no epsilon in an asynchronous run's records (docs/privacy.md promises it
    in every record). Each upload is one release, also two uploads of one model version (a device
    trains again while the buffer waits), which a count by round would have taken for one."""
    from edgefl.sim import Simulation
    from tests.test_resume import _async_config

    cfg = _async_config("fedhe", rounds=12, filters=[{"name": "local-dp", "noise_multiplier": 0.5}], buffer_size=3)
    run = RunDir.create(tmp_path / "async", cfg.name, cfg.seed)
    Simulation(cfg, run, show_progress=False).run()
    records = _records(tmp_path / "async")
    assert records and all("local-dp" in r["filters"] for r in records)
    reports: dict[str, int] = {}
    for record in records:
        for device, n in record["reports_per_client"].items():
            reports[device] = reports.get(device, 0) + n
        spent = record["filters"]["local-dp"]["epsilon_per_device"]
        for device, n in reports.items():  # at least every accepted upload (a stale one refused was released too)
            assert spent[device] >= round(Gaussian(0.5, 1.0, n).epsilon(1e-5), 6) - 1e-6  # (recorded to 6 places)
    assert any(n > 1 for n in reports.values())
