"""The round loop without a broker: the in-memory network is a transport like MQTT's, so the
endpoint's refusals can be tested by handing it envelopes directly."""

from __future__ import annotations

import pytest

from edgefl.config import validate_config
from edgefl.messages import Message, encode
from edgefl.sim import Simulation
from edgefl.transport.base import Delivery
from edgefl.transport.envelope import Envelope, pack, tensor_manifest
from tests.conftest import digits_config


@pytest.fixture
def fedavg() -> Simulation:
    sim = Simulation(validate_config(digits_config("fedavg", rounds=2)), show_progress=False)
    sim.run_round(1)
    return sim


def _send(sim: Simulation, message: Message) -> str:
    """Hand ``message`` to the round loop as client-0's upload; the reason of its refusal."""
    orchestrator = sim.session.endpoint
    env = Envelope("upload", orchestrator.federation, message.round, message.sender, encode(message), message.message_id,
                   model_version=message.round, codec="safetensors", extra={"tensors": tensor_manifest(message.tensors)})
    before = len(orchestrator.rejections)
    orchestrator.handle(Delivery("message", message.sender, pack(env)))
    return orchestrator.rejections[-1][1] if len(orchestrator.rejections) > before else ""


def test_a_kind_the_method_does_not_upload_is_refused_with_the_kinds_it_does(fedavg):
    reason = _send(fedavg, Message("class_logits", 1, "client-0", {}, {"num_samples": 5}))
    assert reason == "fedavg devices upload weights, not 'class_logits'"
    reason = _send(fedavg, Message("status", 1, "client-0", {}, {"num_samples": 5}))
    assert reason == "fedavg devices upload weights, not 'status'"


@pytest.mark.parametrize("bad", [1.5, -0.1, "0.9", True])
def test_device_reported_accuracy_must_be_a_number_in_0_1(fedavg, bad):
    reason = _send(fedavg, Message("weights", 1, "client-0", {}, {"num_samples": 5, "eval_accuracy": bad}))
    assert reason.startswith("eval_accuracy must be a number in [0, 1]")


def test_a_non_finite_train_loss_is_refused(fedavg):
    # NaN is not JSON: the bounded decoder refuses it before the meta checks see it
    reason = _send(fedavg, Message("weights", 1, "client-0", {}, {"num_samples": 5, "train_loss": float("nan")}))
    assert reason == "message fields: NaN is not JSON"
    reason = _send(fedavg, Message("weights", 1, "client-0", {}, {"num_samples": 5, "train_loss": "abc"}))
    assert reason.startswith("train_loss must be a finite number")


def test_an_evaluation_nobody_asked_for_is_answered_late_and_not_used(fedavg):
    from edgefl.transport.envelope import unpack

    assert _send(fedavg, Message("evaluation", 1, "client-0", {}, {"num_samples": 5, "eval_accuracy": 0.5})) == ""
    reply = unpack(fedavg.network._inbox["client-0"][-1].payload, 1 << 20)  # queued for the device, not yet read
    assert (reply.type, reply.extra["status"]) == ("ack", "late")
    assert "no evaluation is being collected" in reply.extra["reason"]


def test_a_message_from_a_device_outside_the_fleet_is_refused(fedavg):
    orchestrator = fedavg.session.endpoint
    orchestrator.handle(Delivery("message", "client-99", b"anything"))
    assert "'client-99' is not in this federation's config" in orchestrator.rejections[-1][1]


def test_local_only_devices_report_without_sharing_anything():
    sim = Simulation(validate_config(digits_config("local", rounds=1)), show_progress=False)
    record = sim.run_round(1)
    assert record["outcome"] == "complete" and record["bytes_up"] == 0 and record["bytes_control"] > 0
    assert set(record["accuracy"]["per_client"]) == {"client-0", "client-1", "client-2", "client-3"}


def test_simulation_server_and_devices_name_the_same_federation_for_any_run_name():
    from edgefl.build import federation_name
    from edgefl.fleet.launcher import federation
    from edgefl.transport.topics import Topics

    cfg = validate_config({**digits_config("fedavg"), "name": "my run #1 " + "x" * 80})
    assert federation(cfg) == federation_name(cfg) == "my-run--1-" + "x" * 54
    Topics(federation(cfg))  # a valid topic level (a raw run name with spaces was a ValueError)


def test_a_device_loop_ignores_what_it_cannot_read(fedavg):
    loop = fedavg.network.loops["client-0"]
    for junk in (b"", b"JUNK" * 10, pack(Envelope("download", "elsewhere", 1, "client-3", b"x"))):
        loop.handle(Delivery("message", "server", junk))  # logged, never raised
    assert loop.pending == {} and not loop.finished


def test_a_method_name_is_registered_once():
    from edgefl.methods import METHODS, register_method

    spec = METHODS["fedavg"]
    assert register_method(spec) is spec  # the same spec again is harmless
    with pytest.raises(ValueError, match="already registered"):
        register_method(type(spec)(**{**spec.__dict__, "description": "another"}))


def test_resume_refuses_the_state_of_another_config_before_connecting(tmp_path):
    from edgefl.errors import ConfigError
    from edgefl.fleet.launcher import serve
    from edgefl.rundir import RunDir
    from edgefl.server.session import STATE_FILE, config_digest
    from edgefl.server.state import save_state

    first = validate_config(digits_config("fedavg", rounds=2))
    sim = Simulation(first, show_progress=False)
    save_state(sim.server, tmp_path / STATE_FILE, {"round": 1, "config_sha256": config_digest(first)})
    other = validate_config({**digits_config("fedavg", rounds=2), "seed": 5})
    with pytest.raises(ConfigError, match="belongs to another config"):
        serve(other, "mqtt://127.0.0.1:9", RunDir(tmp_path), resume=True)  # port 9: nothing listens, nothing is tried


def test_a_second_copy_of_an_accepted_upload_is_a_duplicate_not_a_late_upload():
    """After a server restart a device's resend (or the broker's queued copy) of the upload its
    round accepted used to be announced as a late upload while its receipt said accepted."""
    from edgefl.transport.envelope import unpack

    sim = Simulation(validate_config(digits_config("fedavg", rounds=2)), show_progress=False)
    policy = sim.session.policy
    seen: list[tuple] = []
    real = policy.on_upload

    def keep(device, env, message, size, facts):
        seen.append((device, env, message, size))
        return real(device, env, message, size, facts)

    policy.on_upload = keep
    events: list[tuple[str, dict]] = []
    policy.on_event = lambda kind, info: events.append((kind, info))
    sim.run_round(1)
    device, env, message, size = next(s for s in seen if s[2].kind == "weights")
    events.clear()
    policy.on_upload(device, env, message, size, {})  # the same upload again, the round closed
    reply = unpack(sim.network._inbox[device][-1].payload, 1 << 20)
    assert (reply.type, reply.extra["status"]) == ("ack", "duplicate")
    assert not [e for e in events if e[0] == "late"]
    other = Message("weights", 1, device, dict(message.tensors), dict(message.meta))  # another id: a late upload
    policy.on_upload(device, env, other, size, {})
    assert unpack(sim.network._inbox[device][-1].payload, 1 << 20).extra["status"] == "late"
    assert [e[0] for e in events] == ["late"]
