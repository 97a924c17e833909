"""An exchange besides training (an evaluate request, a stage) stops waiting for devices that went
offline: after ``network.offline_grace_s``, not at its deadline (a fleet lost a full deadline per
round to a dead device before)."""

from __future__ import annotations

import time

from edgefl.config import NetworkSettings
from edgefl.methods import METHODS
from edgefl.server.endpoint import Exchange, ServerEndpoint
from edgefl.transport.memory import MemoryDeviceTransport, MemoryServerTransport, hub
from edgefl.transport.topics import Topics


def _endpoint(name: str, devices: list[str], grace_s: float) -> tuple[ServerEndpoint, dict[str, MemoryDeviceTransport]]:
    topics = Topics(name)
    net = NetworkSettings(offline_grace_s=grace_s)
    server = MemoryServerTransport(hub(name), topics)
    endpoint = ServerEndpoint(net, METHODS["fedavg"], server, devices, name, num_classes=10, max_epochs=1, partial_max_age_s=60)
    connected = {d: MemoryDeviceTransport(hub(name), topics, d) for d in devices}
    return endpoint, connected


def test_a_request_stops_waiting_once_every_device_left_is_offline_past_the_grace():
    endpoint, devices = _endpoint("offline-eval", ["client-0", "client-1"], grace_s=0.5)
    endpoint.pump(0.1)
    endpoint.pump(0.1)  # both are online now
    for transport in devices.values():
        transport.close()  # both die
    t0 = time.monotonic()
    answers = endpoint.request(Exchange("evaluate", 1, frozenset(devices)), "evaluate", {}, {}, deadline_s=30)
    assert answers == {}
    assert time.monotonic() - t0 < 10, "the request waited for its deadline, not the offline grace"


def test_a_request_waits_for_an_online_device_until_its_deadline():
    endpoint, devices = _endpoint("online-eval", ["client-0"], grace_s=0.1)
    endpoint.pump(0.1)
    t0 = time.monotonic()
    assert endpoint.request(Exchange("evaluate", 1, frozenset(devices)), "evaluate", {}, {}, deadline_s=1.5) == {}
    assert time.monotonic() - t0 >= 1.4  # online and silent: the deadline, as before
    devices["client-0"].close()


def test_a_device_dead_before_the_rounds_does_not_hold_up_every_round_by_the_grace():
    """Without fleet.per_round every device is selected each round: a device that died long ago
    used to cost each round offline_grace_s; its grace counts from when it went offline."""
    import uuid

    from edgefl.config import RunConfig
    from edgefl.transport.registry import device_transport
    from tests.conftest import digits_config, serve_with_device_threads

    raw = digits_config("fedavg", rounds=3)
    raw["fleet"] = {"groups": [{"model": "mlp", "count": 3, "options": {"hidden": [16]}}]}
    grace = 4.0
    raw["network"] = {"round_deadline_s": 60, "offline_grace_s": grace, "federation": f"dead-{uuid.uuid4().hex[:8]}"}
    raw["threads"] = 1
    cfg = RunConfig.model_validate(raw)
    url = f"memory://dead-{uuid.uuid4().hex[:8]}"
    dead = device_transport(url, Topics(cfg.network.federation), "client-2")
    dead.close()  # online once, then gone: its presence says offline from now on
    time.sleep(grace + 0.5)  # gone for longer than the grace before the run starts
    summary, _ = serve_with_device_threads(cfg, url, ["client-0", "client-1"], join_timeout_s=10)
    history = summary["history"]
    assert [h["outcome"] for h in history] == ["offline"] * 3, history
    # after the first (the devices' start), each round closed once the two live devices reported,
    # without waiting out client-2's grace again
    assert all(h["round_time_s"] < grace for h in history[1:]), [h["round_time_s"] for h in history]


def test_a_device_that_never_connects_does_not_hold_up_every_round_by_the_deadline():
    """A device never heard from had no offline time, so no grace applied to it: the server said
    "starting without client-2" and then waited the whole round deadline for it every round. It
    counts as offline since the server began waiting for the devices."""
    import uuid

    from edgefl.config import RunConfig
    from tests.conftest import digits_config, serve_with_device_threads

    raw = digits_config("fedavg", rounds=3)
    raw["fleet"] = {"groups": [{"model": "mlp", "count": 3, "options": {"hidden": [16]}}]}
    deadline = 20.0
    raw["network"] = {"round_deadline_s": deadline, "offline_grace_s": 1.0, "federation": f"never-{uuid.uuid4().hex[:8]}"}
    raw["threads"] = 1
    cfg = RunConfig.model_validate(raw)
    url = f"memory://never-{uuid.uuid4().hex[:8]}"
    summary, _ = serve_with_device_threads(cfg, url, ["client-0", "client-1"], join_timeout_s=3)
    history = summary["history"]
    assert [h["outcome"] for h in history] == ["offline"] * 3, history
    assert all(h["round_time_s"] < deadline / 2 for h in history), [h["round_time_s"] for h in history]
    assert all(h["receipts"]["client-2"].startswith("missing: offline") for h in history)
