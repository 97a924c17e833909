"""Device loops in other processes: the simulation's client halves spread over worker processes
(``simulation.workers``) or Ray actors (``simulation.backend = "ray"``).

A host holds some of the run's devices: it builds them from the config exactly as the simulation
does in-process (same partition, weights and seeds) and steps their device loops on the
deliveries it is sent. What crosses the process boundary is the fleet's own wire format: a
request is a JSON header plus the envelope bytes of each delivery; a reply is a JSON header plus
the envelope bytes each device sent. No pickle: the frames are bytes with a length in front
(processes) or one ``bytes`` argument and result (Ray, which carries bytes as they are).

The in-memory network hands a host all deliveries of one pass at once (:meth:`Host.submit`) and
collects the replies (:meth:`Host.collect`), so several hosts train at the same time; devices do
not interact within a pass, so the replies are those of stepping them one after another.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from edgefl.device import DeviceLoop, WorkDone
from edgefl.messages import Message, decode, encode
from edgefl.transport.base import Delivery, DeviceTransport

#: a frame: 8-byte big-endian length, then that many bytes
_LENGTH = struct.Struct(">Q")
MAX_FRAME = 1 << 34  # 16 GiB: a pass of a thousand devices' weights, and a bound on a corrupt length


def pack_frame(header: dict[str, Any], blobs: list[bytes]) -> bytes:
    """One message between the simulation and a host: its JSON header (with each blob's length) and the blobs."""
    head = json.dumps({**header, "blobs": [len(b) for b in blobs]}).encode()
    return b"".join([_LENGTH.pack(len(head)), head, *blobs])


def unpack_frame(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    (n,) = _LENGTH.unpack_from(data, 0)
    head = json.loads(data[8 : 8 + n])
    blobs, at = [], 8 + n
    for size in head.pop("blobs"):
        blobs.append(data[at : at + size])
        at += size
    if at != len(data):
        raise ValueError(f"a host frame of {len(data)} bytes holds {at}")
    return head, blobs


def write_frame(out: BinaryIO, data: bytes) -> None:
    out.write(_LENGTH.pack(len(data)))
    out.write(data)
    out.flush()


def read_frame(inp: BinaryIO) -> bytes | None:
    raw = inp.read(8)
    if len(raw) < 8:
        return None
    (n,) = _LENGTH.unpack(raw)
    if n > MAX_FRAME:
        raise ValueError(f"a host frame announces {n} bytes")
    data = inp.read(n)
    if len(data) != n:
        raise EOFError("the other side closed mid-frame")
    return data


@dataclass
class Job:
    """One delivery for one device, at the virtual time the device starts on it."""

    device: str
    item: Delivery
    start: float


class _CapturingEndpoint(DeviceTransport):
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.at = 0.0

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def receive(self, timeout_s: float) -> Delivery | None:
        return None

    def now(self) -> float:
        return self.at


class HostCore:
    """What runs inside a host: the devices it holds and one request at a time."""

    def __init__(self, config_toml: str, devices: list[str], threads: int | None) -> None:
        from edgefl.build import build_run, federation_name
        from edgefl.config import tomllib, validate_config
        from edgefl.filters import build_chain

        if threads:
            torch.set_num_threads(threads)
        cfg = validate_config(tomllib.loads(config_toml), "the simulation's config")
        parts = build_run(cfg, check=False)
        self.loops: dict[str, DeviceLoop] = {}
        self.endpoints: dict[str, _CapturingEndpoint] = {}
        federation = federation_name(cfg)
        for device in devices:
            endpoint = self.endpoints[device] = _CapturingEndpoint()
            self.loops[device] = DeviceLoop(parts.client(device), endpoint, federation, cfg.network, parts.x_test, parts.y_test,
                                            cfg.eval.batch_size, filters=build_chain(cfg.filter_chain(), "device", cfg.seed, device))

    def handle(self, request: bytes) -> bytes:
        head, blobs = unpack_frame(request)
        if head["op"] == "step":
            results, out = [], []
            for job, payload in zip(head["jobs"], blobs):
                loop, endpoint = self.loops[job["device"]], self.endpoints[job["device"]]
                endpoint.sent, endpoint.at = [], job["start"]
                loop.last_work = None
                loop.handle(Delivery(job["channel"], job["peer"], payload, online=job["online"]))
                work = loop.last_work
                results.append({"sent": len(endpoint.sent), "work": None if work is None else vars(work)})
                out.extend(endpoint.sent)
            return pack_frame({"results": results}, out)
        if head["op"] == "states":  # each device's trained model, in the wire codec
            devices = list(self.loops)
            return pack_frame({"devices": devices}, [encode(Message("state", 0, d, self.loops[d].client.carry_state(), {}))
                                                     for d in devices])
        raise ValueError(f"unknown host request {head['op']!r}")


def check_reply(data: bytes) -> bytes:
    """The reply, unless it reports the host's failure (raised here, in the simulation)."""
    (n,) = _LENGTH.unpack_from(data, 0)
    head = json.loads(data[8 : 8 + n])
    if "error" in head:
        raise RuntimeError(f"a simulation worker failed: {head['error']}")
    return data


def step_request(jobs: list[Job]) -> bytes:
    return pack_frame({"op": "step", "jobs": [{"device": j.device, "channel": j.item.channel, "peer": j.item.peer,
                                               "online": j.item.online, "start": j.start} for j in jobs]},
                      [j.item.payload for j in jobs])


def step_reply(data: bytes) -> list[tuple[list[bytes], WorkDone | None]]:
    head, blobs = unpack_frame(data)
    out, at = [], 0
    for r in head["results"]:
        out.append((blobs[at : at + r["sent"]], None if r["work"] is None else WorkDone(**r["work"])))
        at += r["sent"]
    return out


def states_reply(data: bytes) -> dict[str, dict[str, torch.Tensor]]:
    head, blobs = unpack_frame(data)
    return {d: decode(b, MAX_FRAME).tensors for d, b in zip(head["devices"], blobs)}


class Host:
    """A set of devices stepped somewhere else; ``submit`` then ``collect``, one request at a time."""

    devices: list[str]

    def submit(self, jobs: list[Job]) -> None: ...

    def collect(self) -> list[tuple[list[bytes], WorkDone | None]]: ...

    def states(self) -> dict[str, dict[str, torch.Tensor]]: ...

    def close(self) -> None: ...


class ProcessHost(Host):
    """A worker process (``python -m edgefl.sim.worker``) speaking frames over its stdin/stdout."""

    def __init__(self, config_toml: str, devices: list[str], threads: int) -> None:
        self.devices = devices
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen([sys.executable, "-m", "edgefl.sim.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._send(pack_frame({"op": "init", "devices": devices, "threads": threads}, [config_toml.encode()]))

    def _send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        write_frame(self.proc.stdin, data)

    def _reply(self) -> bytes:
        assert self.proc.stdout is not None
        data = read_frame(self.proc.stdout)
        if data is None:
            raise RuntimeError(f"a simulation worker process exited (code {self.proc.poll()}); its error is above")
        return check_reply(data)

    def submit(self, jobs: list[Job]) -> None:
        self._send(step_request(jobs))

    def collect(self) -> list[tuple[list[bytes], WorkDone | None]]:
        return step_reply(self._reply())

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        self._send(pack_frame({"op": "states"}, []))
        return states_reply(self._reply())

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """A worker process's loop: an ``init`` frame, then one reply per request until stdin closes."""
    first = read_frame(inp)
    if first is None:
        return
    head, blobs = unpack_frame(first)
    core = HostCore(blobs[0].decode(), head["devices"], head.get("threads"))
    while (request := read_frame(inp)) is not None:
        try:
            reply = core.handle(request)
        except Exception as exc:  # said to the simulation, which stops the run with it
            reply = pack_frame({"error": f"{type(exc).__name__}: {exc}"[:2000]}, [])
        write_frame(out, reply)

