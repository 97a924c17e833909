"""The clock a round policy runs on, handed to it apart from the transport.

On a real network it is the transport's monotonic clock and nothing is known about work under
way. The simulation hands its virtual clock instead (:meth:`edgefl.sim.network.InMemoryNetwork.run_clock`):
virtual seconds, and which device is still training which round and for how long, so a round's
record can name its stragglers. Keeping this off the transport interface means a transport only
moves bytes.
"""

from __future__ import annotations

from typing import Protocol

from edgefl.transport.base import ServerTransport


class RunClock(Protocol):
    #: whether :meth:`now` is simulated (virtual seconds) rather than the wall clock
    virtual: bool

    def now(self) -> float:
        """Seconds on this clock (monotonic)."""
        ...

    def in_flight(self) -> dict[str, tuple[int, float | None]]:
        """Work known to be on its way: device -> (round, seconds of work); empty when unknowable."""
        ...

    def idle(self) -> bool:
        """True when nothing can reach the server any more unless it sends something (known
        only to a virtual clock: a real network is never known to be idle)."""
        ...


class TransportClock:
    """A real network's clock: the transport's own, and no knowledge of work in flight."""

    virtual = False

    def __init__(self, transport: ServerTransport) -> None:
        self.transport = transport

    def now(self) -> float:
        return self.transport.now()

    def in_flight(self) -> dict[str, tuple[int, float | None]]:
        return {}

    def idle(self) -> bool:
        return False
