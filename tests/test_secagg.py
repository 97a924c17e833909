"""Secure aggregation (the ``secagg`` filter) through the real runners: the same numbers as the
plain run within the fixed-point tolerance, for FedAvg (per architecture group), FedHe (every
class from every device) and CHFL; devices that drop out after sharing their keys, before or
after their masked upload, leave exactly the survivors' sum; fewer than t survivors fail the
round with the reason; what the server and the broker see of one device cannot be unmasked; the
methods whose server needs individual uploads are refused before anything starts."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from edgefl.config import validate_config
from edgefl.errors import ConfigError
from edgefl.filters.secagg import MASKED, SecAgg
from edgefl.rundir import RunDir
from edgefl.secagg import fixedpoint, prg, shamir
from edgefl.secagg.forms import from_sum, to_sum_form
from tests.conftest import digits_config, method_config
from tests.test_every_method import _records


def _config(method: str = "fedavg", secagg: dict | None = None, rounds: int = 2, mlps_only: bool = False, **extra):
    raw = method_config(method, rounds=rounds)
    raw["threads"] = 1
    raw["network"] = {"federation": f"secagg-{method}", "round_deadline_s": 60}
    if mlps_only:
        raw["fleet"] = {"groups": [{"model": "mlp", "count": 5, "options": {"hidden": [32, 16]}},
                                   {"model": "mlp", "count": 5, "options": {"hidden": [24]}}]}
    if secagg is not None:
        raw["filters"] = [{"name": "secagg", **secagg}]
    raw.update(extra)
    return validate_config(raw)


def _overall(records: list[dict]) -> list[float]:
    return [r["accuracy"]["overall"] for r in records if r.get("accuracy")]


@pytest.mark.parametrize("method", ["fedavg", "fedhe", "chfl", "felo"])
def test_a_secured_run_gives_the_plain_run_s_numbers(method, tmp_path):
    from edgefl.sim import Simulation

    plain, secured = _config(method), _config(method, {})
    Simulation(plain, RunDir.create(tmp_path / "plain", plain.name, plain.seed), show_progress=False).run()
    Simulation(secured, RunDir.create(tmp_path / "secured", secured.name, secured.seed), show_progress=False).run()
    a, b = _records(tmp_path / "plain"), _records(tmp_path / "secured")
    assert [r["outcome"] for r in b] == ["complete"] * len(b)
    # 32-bit fixed point over +-2^20: one step is 2^21 / (2^32 - 1) ~ 4.9e-4 per device and value (a weight
    # times the sample count); divided by the summed sample counts (hundreds) the means the server halves
    # compute differ from the plain ones by ~1e-5, which moves an accuracy only at near ties
    assert np.allclose(_overall(a), _overall(b), atol=0.02), (_overall(a), _overall(b))
    stages = b[0]["stages"]
    assert set(stages) == {"secagg-keys", "secagg-shares", "secagg-unmask"}
    assert all(s["dropped"] == [] for s in stages.values())


def test_the_unmasked_sum_is_the_plain_sum_of_the_survivors_when_devices_drop_out(monkeypatch):
    """client-1 dies after sending its shares (no masked upload), client-7 after its masked upload
    (no answer to the unmasking): the round closes with the sum of the nine that uploaded."""
    from edgefl.sim import Simulation

    cfg = _config("fedavg", {"neighbours": 4, "threshold": 2}, rounds=1, mlps_only=True)
    sim = Simulation(cfg, show_progress=False)
    plain_uploads: dict[str, object] = {}
    released = []
    real_out, real_answer, real_release = SecAgg.upload_out, SecAgg.answer_stage, SecAgg.release

    def upload_out(self, message):
        if self.device == "client-1":
            raise RuntimeError("killed after sharing its keys")
        plain_uploads[self.device] = message
        return real_out(self, message)

    def answer_stage(self, stage, request):
        if stage == "secagg-unmask" and self.device == "client-7":
            return None  # killed after its masked upload
        return real_answer(self, stage, request)

    def release(self, round_no):
        out = real_release(self, round_no)
        released.extend(out)
        return out

    monkeypatch.setattr(SecAgg, "upload_out", upload_out)
    monkeypatch.setattr(SecAgg, "answer_stage", answer_stage)
    monkeypatch.setattr(SecAgg, "release", release)
    record = sim.run_round(1)
    assert record["outcome"] in ("complete", "deadline"), record.get("failure")  # client-1 never reports: the deadline closes it
    assert "client-1" not in record["reported"]
    assert record["stages"]["secagg-unmask"]["dropped"] == ["client-7"]
    assert sorted(plain_uploads) == [f"client-{i}" for i in (0, 2, 3, 4, 5, 6, 7, 8, 9)]
    facts = record["filters"]["secagg"]["groups"]
    assert [g["dropped_after_sharing"] for g in facts.values()] in (
        [["client-1"], []], [[], ["client-1"]])
    by_arch: dict[str, list] = {}
    for device, message in plain_uploads.items():
        by_arch.setdefault(sim.parts.slot(device).arch if hasattr(sim.parts, "slot") else
                           next(s.arch for s in sim.parts.slots if s.client_id == device), []).append(message)
    assert len(released) == 2  # one sum per architecture group
    for message in released:
        group = [m for ms in by_arch.values() for m in ms if set(m.tensors) == set(message.tensors)
                 and all(m.tensors[k].shape == message.tensors[k].shape for k in m.tensors)]
        vectors = [to_sum_form(m) for m in group]
        total = sum(v for v, _ in vectors)
        expected = from_sum(total, vectors[0][1], 1, message.sender, len(group))
        step = 2 * float(1 << 20) / ((1 << 32) - 1)
        for name, value in expected.tensors.items():
            if value.is_floating_point():
                bound = len(group) * step / expected.num_samples + 1e-6
                assert torch.allclose(message.tensors[name], value, atol=bound), name
        assert message.num_samples == expected.num_samples


def test_fewer_than_t_survivors_fail_the_round_with_the_reason(monkeypatch):
    from edgefl.sim import Simulation

    cfg = _config("fedavg", {"neighbours": 2, "threshold": 2}, rounds=1, mlps_only=True)
    sim = Simulation(cfg, show_progress=False)
    real_answer = SecAgg.answer_stage

    def answer_stage(self, stage, request):
        if stage == "secagg-unmask" and self.device != "client-0":
            return None  # one device alone reveals its shares: one per secret, below t = 2
        return real_answer(self, stage, request)

    monkeypatch.setattr(SecAgg, "answer_stage", answer_stage)
    record = sim.run_round(1)
    assert record["outcome"] == "failed"
    assert "needs 2 shares" in record["failure"] and "threshold" in record["failure"]


def test_one_masked_upload_reveals_nothing_without_t_shares():
    """What the server and the broker hold of one device (its masked vector, fewer than t shares
    of its self-mask seed) cannot be unmasked: fewer shares do not combine, and the masked values
    are the mask, not the input."""
    vector = torch.linspace(-3, 3, 1000, dtype=torch.float64)
    m = fixedpoint.modulus_bits_for(10, 32)
    codes = fixedpoint.encode(vector, clip=float(1 << 20), value_bits=32, modulus_bits=m, generator=torch.Generator().manual_seed(0))
    seed = bytes(range(32))
    masked = (codes + prg.mask(seed, len(codes), m)) & np.uint64((1 << m) - 1)
    shares = shamir.split(seed, 3, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError):
        shamir.combine({x: shares[x] for x in (1, 2)}, 3)
    # two shares interpolated as if they were enough give another seed, whose mask leaves noise
    assert not np.array_equal(masked, codes)
    wrong = shamir.combine({x: shares[x] for x in (1, 2, 3)}, 3)
    assert wrong == seed
    unmasked = (masked - prg.mask(wrong, len(codes), m)) & np.uint64((1 << m) - 1)
    assert np.array_equal(unmasked, codes)
    # the masked vector is spread over the whole modulus, unlike the codes (a narrow band)
    assert float(np.std(masked.astype(np.float64))) > 100 * float(np.std(codes.astype(np.float64)))


@pytest.mark.parametrize("method", ["fedin", "velo", "fedmho", "fedcvae", "local"])
def test_methods_whose_server_needs_individual_uploads_are_refused_before_the_run(method):
    with pytest.raises(ConfigError, match="cannot be secured by summing") as caught:
        _config(method, {})
    if method == "velo":
        assert "CVAE" in str(caught.value) and 'method.name = "felo"' in str(caught.value)  # the alternative, named
    if method in ("fedmho", "fedcvae"):
        assert "FedAvg" in str(caught.value)


def test_an_asynchronous_run_and_fedhe_count_weighting_are_refused():
    raw = digits_config("fedhe", rounds=2)
    raw["mode"] = "async"
    raw["filters"] = [{"name": "secagg"}]
    with pytest.raises(ConfigError, match='mode = "sync"'):
        validate_config(raw)
    raw = digits_config("fedhe", rounds=2)
    raw["method"]["server_weighting"] = "count"
    raw["filters"] = [{"name": "secagg"}]
    with pytest.raises(ConfigError, match="uniform weighting"):
        validate_config(raw)


def test_a_masked_upload_is_all_the_server_and_the_broker_see(monkeypatch):
    """On the wire an upload is one I64 vector and its layout: no weights, no class counts."""
    from edgefl.sim import Simulation
    from edgefl.messages import decode
    from edgefl.transport.envelope import unpack

    cfg = _config("fedhe", {}, rounds=1)
    sim = Simulation(cfg, show_progress=False)
    seen = []
    real = sim.network._push

    def push(at, item):
        if item.channel == "message" and item.payload:
            env = unpack(item.payload, 1 << 26)
            if env.type == "upload" and env.codec == "safetensors":
                seen.append(decode(env.body, 1 << 26))
        return real(at, item)

    monkeypatch.setattr(sim.network, "_push", push)
    sim.run_round(1)
    uploads = [m for m in seen if m.kind == "class_logits"]
    assert len(uploads) == 4
    for message in uploads:
        assert set(message.tensors) == {MASKED} and message.tensors[MASKED].dtype == torch.uint8
        assert "class_counts" not in message.meta and message.meta["num_samples"] == 1


def test_a_secured_fleet_writes_the_simulation_s_records(tmp_path):
    """Server and devices in this process (threads) over a real mosquitto."""
    from edgefl.fleet.launcher import run_device, serve
    from edgefl.sim import Simulation
    from tests.mosquitto import mosquitto

    cfg = _config("fedavg", {}, mlps_only=True)
    Simulation(cfg, RunDir.create(tmp_path / "sim", cfg.name, cfg.seed), show_progress=False).run()
    with mosquitto(tmp_path) as broker:
        results: dict = {}
        server = threading.Thread(target=lambda: results.update(
            summary=serve(cfg, broker, RunDir.create(tmp_path / "fleet", cfg.name, cfg.seed), join_timeout_s=60)), daemon=True)
        server.start()
        devices = [threading.Thread(target=run_device, args=(cfg, f"client-{i}", broker), kwargs={"timeout_s": 120}, daemon=True)
                   for i in range(10)]
        for d in devices:
            d.start()
        server.join(240)
        for d in devices:
            d.join(30)
    assert "summary" in results
    assert _records(tmp_path / "fleet") == _records(tmp_path / "sim")


def test_a_secured_fedhe_fleet_of_edgefl_client_processes_matches_the_simulation(tmp_path):
    """The devices as separate `edgefl client` processes over mosquitto, FedHe with every class
    from every device."""
    from edgefl.fleet.launcher import run_fleet
    from edgefl.sim import Simulation

    cfg = _config("fedhe", {})
    Simulation(cfg, RunDir.create(tmp_path / "sim", cfg.name, cfg.seed), show_progress=False).run()
    fleet = run_fleet(cfg, None, RunDir.create(tmp_path / "fleet", cfg.name, cfg.seed), device_timeout_s=240)
    assert set(fleet["device_exit_codes"].values()) == {0}, fleet["logs"]
    sim_records, fleet_records = _records(tmp_path / "sim"), _records(tmp_path / "fleet")
    assert fleet_records == sim_records
    assert all(r["filters"]["secagg"]["secured"] for r in sim_records)


def test_a_device_that_restarts_mid_round_drops_out_of_that_round_only(monkeypatch):
    """A device process that restarts after sharing its keys has lost them: it refuses the round's
    download (its shares name keys it no longer holds), counts as dropped after sharing, and the
    round closes with the others' sum; in the next round it takes part again."""
    from edgefl.sim import Simulation

    cfg = _config("fedavg", {"neighbours": 4, "threshold": 2}, rounds=2, mlps_only=True)
    sim = Simulation(cfg, show_progress=False)
    real_in = SecAgg.download_in

    def download_in(self, message):
        if self.device == "client-2" and message.round == 1 and ".secagg/shares" in message.tensors:
            self._mine = None  # the process restarted: its round-1 keys are gone
        return real_in(self, message)

    monkeypatch.setattr(SecAgg, "download_in", download_in)
    first = sim.run_round(1)
    assert first["outcome"] in ("complete", "deadline") and "client-2" not in first["reported"]
    groups = first["filters"]["secagg"]["groups"]
    assert sorted(d for g in groups.values() for d in g["dropped_after_sharing"]) == ["client-2"]
    second = sim.run_round(2)
    assert second["outcome"] == "complete" and "client-2" in second["reported"]


def test_the_forms_know_felo_s_knowledge_prefix():
    from edgefl.algorithms.felo import KNOWLEDGE
    from edgefl.secagg import forms

    assert forms.KNOWLEDGE == KNOWLEDGE


def test_fedin_without_in_training_is_secured_layer_wise_and_with_it_refused(tmp_path):
    """FedIN without IN training sends weights only: the secure sums per architecture reach its
    layer-wise aggregation (weighted by the groups' summed sample counts) and give the plain run's
    numbers; with IN training its pairs cannot be summed and the run is refused with the way out."""
    from edgefl.sim import Simulation

    raw = method_config("fedin", rounds=2)
    raw["method"]["in_training"] = False
    raw["threads"] = 1
    plain = validate_config(raw)
    secured = validate_config({**raw, "filters": [{"name": "secagg"}]})
    Simulation(plain, RunDir.create(tmp_path / "plain", plain.name, plain.seed), show_progress=False).run()
    Simulation(secured, RunDir.create(tmp_path / "secured", secured.name, secured.seed), show_progress=False).run()
    a, b = _records(tmp_path / "plain"), _records(tmp_path / "secured")
    assert [r["outcome"] for r in b] == ["complete"] * len(b)
    assert np.allclose(_overall(a), _overall(b), atol=0.02), (_overall(a), _overall(b))
    with pytest.raises(ConfigError, match="in_training = false"):
        _config("fedin", {})


def test_masked_values_travel_in_as_few_bytes_as_the_modulus_needs():
    from edgefl.filters.secagg import pack_values, unpack_values, value_bytes

    values = np.array([0, 1, (1 << 36) - 1, 123456789012], dtype=np.uint64)
    packed = pack_values(values, 36)
    assert value_bytes(36) == 5 and packed.dtype == np.uint8 and packed.size == 20
    assert packed[:5].tolist() == [0, 0, 0, 0, 0] and packed[5:10].tolist() == [1, 0, 0, 0, 0]
    assert np.array_equal(unpack_values(packed, 5), values)


def test_what_the_server_receives_of_a_real_round_unmasks_only_as_the_sum(monkeypatch):
    """A secured FedAvg round in simulation, everything the server received kept: each device's
    masked upload (the bytes the broker relays) and the self-mask shares of the unmask stage.
    With t - 1 of a device's shares its self-mask seed is not recovered (combining them as if enough
    gives another number); even with its seed, its vector minus the self mask is not its input (the
    pair masks stay); the sum of all of them minus every self mask is the sum of the inputs."""
    from edgefl.filters import secagg as secagg_module
    from edgefl.filters.secagg import unpack_values, value_bytes
    from edgefl.sim import Simulation

    inputs, wire, seen = {}, {}, {}
    upload_out, unmasked_sum = SecAgg.upload_out, secagg_module._unmasked_sum

    def keep_upload(self, message):
        out = upload_out(self, message)
        if MASKED in out.tensors:
            inputs[message.sender] = to_sum_form(message)[0].double()
            wire[message.sender] = out.tensors[MASKED].clone()
        return out

    def keep_sum(side, name, g, b_parts, s_parts, round_no):
        seen[name] = (g, {u: dict(p) for u, p in b_parts.items()})
        return unmasked_sum(side, name, g, b_parts, s_parts, round_no)

    monkeypatch.setattr(SecAgg, "upload_out", keep_upload)
    monkeypatch.setattr(secagg_module, "_unmasked_sum", keep_sum)
    cfg = _config("fedavg", {}, rounds=1, mlps_only=True)
    assert Simulation(cfg, show_progress=False).run_round(1)["outcome"] == "complete"
    o = cfg.filters[0].options()
    clip, bits = o.get("clip", secagg_module.SecAggOptions().clip), o.get("bits", secagg_module.SecAggOptions().bits)
    for g, b_parts in seen.values():
        m, n = g.m, len(g.masked)
        total = np.zeros(g.layout.length, dtype=np.uint64)
        for u, masked in g.masked.items():
            # what the server holds is what the device sent through the broker
            assert np.array_equal(unpack_values(wire[u].numpy(), value_bytes(m)), masked)
            parts = sorted(b_parts[u].items())
            assert len(parts) >= g.t >= 2
            with pytest.raises(ValueError):
                shamir.combine(dict(parts[: g.t - 1]), g.t)
            seed = shamir.combine(dict(parts[: g.t]), g.t)
            guess = shamir.combine_int([(x, int.from_bytes(s, "big")) for x, s in parts[: g.t - 1]], g.t - 1)
            assert guess != int.from_bytes(seed, "big")  # t - 1 shares interpolate to another polynomial's value
            alone = fixedpoint.sub_mod(masked, prg.mask(seed, len(masked), m), m)
            mine = fixedpoint.encode(inputs[u], clip=clip, value_bits=bits, modulus_bits=m,
                                     generator=torch.Generator().manual_seed(0))
            assert np.mean(alone == mine) < 0.01  # the pair masks still hide the device's codes
            total = fixedpoint.add_mod(total, alone, m)
        got = fixedpoint.decode_sum(total, count=n, clip=clip, value_bits=bits, modulus_bits=m)
        want = sum(inputs[u] for u in g.masked)
        assert torch.allclose(got, want, atol=n * fixedpoint.step(clip, bits))  # stochastic rounding: < 1 step each


def test_a_group_too_small_to_survive_a_drop_out_is_said_at_the_start(caplog):
    """Three devices a round share with both others and need both shares: one device lost after the key
    exchange fails the round. An outside trial met that with no warning; the server now says it at the
    start, and stays quiet for a group that tolerates drop-outs."""
    import logging

    from edgefl.filters import build_chain

    (server_side,) = build_chain([("secagg", {})], "server", 0)
    with caplog.at_level(logging.WARNING, logger="edgefl.secagg"):
        server_side.prepare({"groups": {}, "seed": 0, "federation": "f", "expected_per_group": {"all": 3}})
    assert "group all of 3 devices a round" in caplog.text and "survives no device that drops out" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgefl.secagg"):
        server_side.prepare({"groups": {}, "seed": 0, "federation": "f", "expected_per_group": {"all": 10}})
    assert "survives no device" not in caplog.text
