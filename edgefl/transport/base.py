"""The transport interface the round loop and the device loop run over.

Two sides, each a handful of calls: the server sends envelope bytes to one device, announces to
every device, and receives what devices send plus their presence; a device sends to the server
and receives what the server sends it. Everything above this line (envelopes, chunks, acks,
quorum, deadlines) is written once, in :mod:`edgefl.server.endpoint` (with the round policies
over it) and :mod:`edgefl.device`; implementations only move bytes (a simulated clock is handed
to the policies apart: :mod:`edgefl.server.clock`):

* :mod:`edgefl.transport.mqtt`: MQTT through a broker (fleets, real devices; ``mqtt://``, ``mqtts://``);
* :mod:`edgefl.transport.memory`: an in-process hub (``memory://NAME``: server and devices as threads);
* :mod:`edgefl.sim.network`: in memory, the device loops stepped in this process, a virtual clock
  (the simulation).

A broker URL's scheme picks one through :mod:`edgefl.transport.registry`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

Channel = Literal["message", "presence", "announcement", "unknown"]


@dataclass
class Delivery:
    """One thing a transport hands up.

    ``message``: envelope bytes from ``peer``; ``presence``: ``peer`` came online or went offline;
    ``announcement``: the server's round announcement (device side); ``unknown``: something on a
    channel that belongs to nobody in this federation (``where`` says which)."""

    channel: Channel
    peer: str | None
    payload: bytes = b""
    online: bool | None = None
    where: str = ""
    #: what the transport knows about the sender's work (the simulation's virtual clock:
    #: ``{"work_s": seconds or None}``); empty on a real network
    facts: dict[str, Any] = field(default_factory=dict)
    #: the broker replayed this from its retained store (a device never retains an upload)
    retained: bool = False
    #: a presence's process ("<start time>-<random>", MQTT 5): tells two processes of one device id apart
    instance: str | None = None


class _Endpoint(ABC):
    """What both sides have: deliveries to receive, a clock, a connection to release."""

    @abstractmethod
    def receive(self, timeout_s: float) -> Delivery | None:
        """The next delivery, waiting at most ``timeout_s``; None when nothing came (the server
        receives uploads and presence, a device the server's messages and announcements)."""

    def now(self) -> float:
        """Seconds on this transport's clock (monotonic)."""
        return time.monotonic()

    def close(self) -> None:  # noqa: B027  (optional: an in-memory transport holds nothing)
        """Release the connection."""


class ServerTransport(_Endpoint):
    """The server's side: one endpoint, every device of the federation behind it."""

    @abstractmethod
    def send(self, device: str, data: bytes) -> None:
        """Queue ``data`` for one device (delivered even if it is offline now, when it returns)."""

    @abstractmethod
    def announce(self, data: bytes) -> None:
        """Tell every device, including ones that join later (MQTT: a retained message)."""

    @property
    def connects(self) -> int:
        """How often this side has (re)connected: after a reconnect, presence is unknown again."""
        return 1


class DeviceTransport(_Endpoint):
    """A device's side: it talks to the server only."""

    @abstractmethod
    def send(self, data: bytes) -> None:
        """Queue ``data`` for the server."""
