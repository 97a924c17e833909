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
