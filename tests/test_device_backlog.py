"""A device that comes back after missing rounds trains only the newest download it finds waiting.

Over MQTT a device's persistent session queues the downloads sent while it was offline, and on
reconnect the broker delivers them all at once. Before, the device trained each in turn: minutes
of training for rounds the server had already closed, after which the current round's upload was
late too. Now :meth:`DeviceLoop.run` reads every delivery at hand first and trains the newest."""

from __future__ import annotations

import threading
import time
from collections import deque

from edgefl.build import build_run
from edgefl.config import validate_config
from edgefl.device import DeviceLoop
from edgefl.messages import Message, encode
from edgefl.transport.base import Delivery, DeviceTransport
from edgefl.transport.envelope import Envelope, pack, unpack
from tests.conftest import method_config

FED = "backlog"


class Queued(DeviceTransport):
    """A device's wire whose deliveries are all waiting when the device starts reading."""

    def __init__(self, waiting: list[Delivery]) -> None:
        self.waiting = deque(waiting)
        self.sent: list[bytes] = []
        self.clock = 0.0

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def receive(self, timeout_s: float):
        self.clock += timeout_s
        return self.waiting.popleft() if self.waiting else None

    def now(self) -> float:
        return self.clock


def _download(message: Message) -> Delivery:
    env = Envelope("download", FED, message.round, "server", encode(message), model_version=message.round,
                   codec="safetensors", extra={"info": {"run": "run-1"}})
    return Delivery("message", "server", pack(env))


def _served(arrival: list[int]) -> tuple[list[int], list[int]]:
    """Rounds uploaded and rounds skipped by a device that finds these rounds' downloads waiting."""
    from edgefl.sim import Simulation

    raw = method_config("fedavg", rounds=3)
    raw["network"] = {"federation": FED}
    cfg = validate_config(raw)
    parts = build_run(cfg)
    sim = Simulation(cfg, show_progress=False)  # its server half makes real downloads
    downloads = {r: _download(sim.server.downlink(r, "client-0")) for r in sorted(arrival)}
    loop = DeviceLoop(parts.client("client-0"), Queued([downloads[r] for r in arrival]), FED, cfg.network)
    loop.run(timeout_s=5.0)
    uploads = sorted({e.round for e in (unpack(d, 1 << 30) for d in loop.transport.sent) if e.type == "upload"})
    return uploads, sorted(loop.skipped)


def test_of_downloads_waiting_together_only_the_newest_is_trained():
    assert _served([1, 2, 3]) == ([3], [1, 2])


def test_an_older_download_arriving_after_a_newer_one_is_skipped():
    assert _served([2, 1]) == ([2], [1])


def test_a_download_alone_is_trained():
    assert _served([1]) == ([1], [])


class Flooded(Queued):
    """A wire that never pauses after its first deliveries: garbage forever (a flood)."""

    def receive(self, timeout_s: float):
        return self.waiting.popleft() if self.waiting else Delivery("message", "server", b"not an envelope")

    def now(self) -> float:
        return time.monotonic()


def test_a_download_is_trained_under_a_flood_that_never_pauses():
    """Reading every delivery at hand first must not mean reading forever: under a stream that
    never pauses the device trains what it holds after a bounded read (and its run can time out)."""
    from edgefl.sim import Simulation

    raw = method_config("fedavg", rounds=1)
    raw["network"] = {"federation": FED}
    cfg = validate_config(raw)
    parts = build_run(cfg)
    download = _download(Simulation(cfg, show_progress=False).server.downlink(1, "client-0"))
    loop = DeviceLoop(parts.client("client-0"), Flooded([download]), FED, cfg.network)
    runner = threading.Thread(target=loop.run, kwargs={"timeout_s": 8.0}, daemon=True)
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "the device kept reading the flood"
    assert any(unpack(d, 1 << 30).type == "upload" for d in loop.transport.sent)
    assert loop.refused > 100  # the flood was read, and refused


def test_a_state_folder_that_refuses_writes_costs_the_crash_insurance_not_the_round(tmp_path, monkeypatch, caplog):
    """The saved state only serves a restart: a device whose --state-dir refuses writes says so with
    the hint, and still uploads every round it trains (it used to drop the round with a traceback)."""
    import logging

    from safetensors import SafetensorError
    from edgefl.sim import Simulation

    import edgefl.device_state as device_state
    from edgefl.device_state import DeviceStateStore

    def refuse(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 1, kind: PermissionDenied })")

    raw = method_config("fedavg", rounds=1)
    raw["network"] = {"federation": FED}
    cfg = validate_config(raw)
    parts = build_run(cfg)
    sim = Simulation(cfg, show_progress=False)
    monkeypatch.setattr(device_state, "save_file", refuse)
    store = DeviceStateStore(tmp_path, "client-0", FED, "a" * 64)
    loop = DeviceLoop(parts.client("client-0"), Queued([_download(sim.server.downlink(1, "client-0"))]), FED, cfg.network, state=store)
    with caplog.at_level(logging.WARNING, logger="edgefl.device"):
        loop.run(timeout_s=5.0)
    assert [e.round for e in (unpack(d, 1 << 30) for d in loop.transport.sent) if e.type == "upload"] == [1]
    assert "cannot save the device state" in caplog.text and "writable --state-dir" in caplog.text and "Traceback" not in caplog.text
