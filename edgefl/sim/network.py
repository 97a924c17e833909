"""The simulation's transport: the device loops live in this process and a virtual clock stands in
for time.

The server side is a :class:`~edgefl.transport.base.ServerTransport` like MQTT's: it sends
envelope bytes and receives envelope bytes, so the round loop, the device loop, the codec and the
byte counts are exactly a fleet's. Instead of a broker, :meth:`InMemoryNetwork.receive` steps
the devices: each pending delivery is handed to its device's loop, in the order it was sent
(deterministic), and what the device sends back is queued for the server at the virtual time it
would arrive.

The clock: a device with a device class (``work_seconds`` prices it from the cost model and the
real message sizes) finishes a download ``work_s`` virtual seconds after it could start it: when
the download arrived, or when it finished its previous work, whichever is later (a Pi Zero still
training round r starts round r + 1 late). Devices without a class take no time. Messages from the
server arrive at once (their transfer is part of the device's priced work).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from edgefl.device import DeviceLoop, WorkDone
from edgefl.sim.batching import FitBatcher
from edgefl.sim.hosts import Host, Job
from edgefl.transport.base import Delivery, DeviceTransport, ServerTransport

WorkPricer = Callable[[str, WorkDone], "float | None"]


class _Endpoint(DeviceTransport):
    """One device's side: sends go to the network; it never blocks (the network steps it)."""

    def __init__(self, network: InMemoryNetwork, device: str) -> None:
        self.network = network
        self.device = device

    def send(self, data: bytes) -> None:
        self.network._outbox.append(data)

    def receive(self, timeout_s: float) -> Delivery | None:
        return None

    def now(self) -> float:
        return self.network._device_now


class VirtualClock:
    """The simulation's run clock (:class:`edgefl.server.clock.RunClock`): the network's virtual
    seconds, and the work it knows to be under way."""

    virtual = True

    def __init__(self, network: InMemoryNetwork) -> None:
        self.network = network

    def now(self) -> float:
        return self.network.clock

    def run_clock(self) -> VirtualClock:
        """The clock the round policies run on (apart from the transport interface)."""
        return VirtualClock(self)

    def in_flight(self) -> dict[str, tuple[int, float | None]]:
        """Work known to be on its way: device -> (round, seconds of work)."""
        return self.network.in_flight()

    def idle(self) -> bool:
        """Nothing queued for the server or for a device: the devices' loops have said all they will."""
        return not self.network._to_server and not self.network._runnable


class InMemoryNetwork(ServerTransport):

    def __init__(self, work_seconds: WorkPricer | None = None, timed: set[str] | frozenset[str] = frozenset(),
                 on_work: Callable[[str, WorkDone], None] | None = None, batcher: FitBatcher | None = None) -> None:
        """``work_seconds(device, work)``: virtual seconds of one download's work for the devices
        in ``timed`` (None: the device's speed is unknown); ``on_work``: called after each
        device's training (progress display)."""
        self.clock = 0.0
        self.work_seconds = work_seconds
        self.timed = set(timed)
        self.on_work = on_work
        self.batcher = batcher  # trains a pass's downloads together (simulation.batch_clients)
        self.hosts: dict[str, Host] = {}  # devices whose loops run elsewhere (simulation.workers, Ray)
        self.loops: dict[str, DeviceLoop] = {}
        self._inbox: dict[str, deque[Delivery]] = {}
        self._runnable: deque[str] = deque()
        self._busy_until: dict[str, float] = {}
        self._to_server: list[tuple[float, int, Delivery]] = []
        self._seq = 0
        self._in_flight: dict[str, tuple[int, float | None, float]] = {}  # device -> (round, work_s, arrival)
        self._outbox: list[bytes] = []
        self._device_now = 0.0

    def endpoint(self, device: str) -> DeviceTransport:
        return _Endpoint(self, device)

    def attach_remote(self, device: str, host: Host) -> None:
        """Add a device whose loop runs in ``host`` (a worker process or Ray actor); it comes online now."""
        self.hosts[device] = host
        self._inbox[device] = deque()
        self._push(self.clock, Delivery("presence", device, online=True))

    def attach(self, loop: DeviceLoop) -> None:
        """Add a device; it comes online now."""
        self.loops[loop.device] = loop
        if self.batcher is not None:
            loop.fit_later = self.batcher.take
        self._inbox[loop.device] = deque()
        self._push(self.clock, Delivery("presence", loop.device, online=True))

    def _push(self, at: float, item: Delivery) -> None:
        heapq.heappush(self._to_server, (at, self._seq, item))
        self._seq += 1

    # --- the server's side ----------------------------------------------------------------------
    def send(self, device: str, data: bytes) -> None:
        if device in self._inbox:
            self._inbox[device].append(Delivery("message", "server", data))
            self._runnable.append(device)

    def announce(self, data: bytes) -> None:
        for device in self._inbox:
            self._inbox[device].append(Delivery("announcement", "server", data))
            self._runnable.append(device)

    def receive(self, timeout_s: float) -> Delivery | None:
        self._run_devices()
        if self._to_server and self._to_server[0][0] <= self.clock + timeout_s:
            at, _, item = heapq.heappop(self._to_server)
            self.clock = max(self.clock, at)
            return item
        self.clock += max(timeout_s, 0.0)
        return None

    def now(self) -> float:
        return self.clock

    def run_clock(self) -> VirtualClock:
        """The clock the round policies run on (apart from the transport interface)."""
        return VirtualClock(self)

    def in_flight(self) -> dict[str, tuple[int, float | None]]:
        """Work known to be on its way: device -> (round, seconds of work)."""
        return {d: (r, work) for d, (r, work, arrival) in self._in_flight.items() if arrival > self.clock}

    # --- a checkpoint of an asynchronous run ---------------------------------------------------------
    def queued(self) -> dict:
        """What is on its way between the server's reads (an asynchronous run's checkpoint keeps
        it): deliveries queued for the server with their arrival times, those not yet read by
        their devices, and the work known to be under way."""
        return {"to_server": list(self._to_server), "seq": self._seq, "runnable": list(self._runnable),
                "inbox": {d: list(box) for d, box in self._inbox.items()}, "in_flight": dict(self._in_flight)}

    def restore_queued(self, saved: dict) -> None:
        """The inverse of :meth:`queued` (replaces the presence the devices said when attached)."""
        self._to_server = [(float(at), int(seq), item) for at, seq, item in saved["to_server"]]
        heapq.heapify(self._to_server)
        self._seq = int(saved["seq"])
        self._runnable = deque(saved["runnable"])
        self._inbox = {d: deque(saved["inbox"].get(d, ())) for d in self._inbox}
        self._in_flight = {d: (int(r), w, float(a)) for d, (r, w, a) in saved["in_flight"].items()}

    # --- the devices -----------------------------------------------------------------------------
    def _run_devices(self) -> None:
        """Hand every pending delivery to its device, in the order sent. With a batcher, the
        downloads of one pass are trained together after the pass (a device's later deliveries
        wait for its training); what the devices send reaches the server in delivery order
        either way, so the server sees the same sequence as one device after another."""
        while self._runnable:
            done: list[tuple[str, float, list[bytes], WorkDone | None] | None] = []
            training: dict[str, tuple[int, float]] = {}  # device -> (its entry in done, start)
            remote: dict[int, tuple[Host, list[Job]]] = {}  # per host: this pass's deliveries
            held: list[str] = []
            while self._runnable:
                device = self._runnable.popleft()
                if device in training:
                    held.append(device)
                    continue
                box = self._inbox[device]
                if not box:
                    continue
                item = box.popleft()
                start = max(self.clock, self._busy_until.get(device, 0.0))
                host = self.hosts.get(device)
                if host is not None:  # stepped in its host after the pass, with the host's other devices
                    remote.setdefault(id(host), (host, []))[1].append(Job(device, item, start))
                    training[device] = (len(done), start)
                    done.append(None)
                    continue
                loop = self.loops[device]
                self._device_now = start
                self._outbox = []
                loop.last_work = None
                loop.handle(item)
                if self.batcher is not None and self.batcher.holds(device):
                    training[device] = (len(done), start)
                    done.append(None)
                    continue
                done.append(self._settle(device, start, loop.last_work))
            if self.batcher is not None and training:
                for loop, env, message in self.batcher.run():
                    entry, start = training[loop.device]
                    self._device_now = start
                    self._outbox = []
                    loop.last_work = None
                    loop.complete(env, message)
                    done[entry] = self._settle(loop.device, start, loop.last_work)
            for host, jobs in remote.values():  # every host works at once ...
                host.submit(jobs)
            for host, jobs in remote.values():  # ... and is heard in turn
                for job, (sent, work) in zip(jobs, host.collect()):
                    self._outbox = list(sent)
                    done[training[job.device][0]] = self._settle(job.device, job.start, work)
            for device, done_at, sent, facts in (d for d in done if d is not None):
                for data in sent:
                    self._push(done_at, Delivery("message", device, data, facts=facts))
            self._runnable.extend(held)

    def _settle(self, device: str, start: float, work: WorkDone | None) -> tuple[str, float, list[bytes], dict]:
        """When the device's work on one delivery ends (virtual clock) and what it sent."""
        sent, self._outbox = self._outbox, []
        done, facts = start, {}
        if work is not None:
            if device in self.timed and self.work_seconds is not None:
                seconds = self.work_seconds(device, work)
                facts = {"work_s": seconds}
                done = start + (seconds or 0.0)
                self._in_flight[device] = (work.round, seconds, done)
            if self.on_work is not None:
                self.on_work(device, work)
        self._busy_until[device] = done
        return device, done, sent, facts
