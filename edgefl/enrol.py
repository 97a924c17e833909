"""A device that holds its own data joins a run: ask for the task, read the data against it,
build the client half, say ready (or decline with the reason). docs/your-data.md.

This runs before the device loop (:mod:`edgefl.device`) over the same transport: what comes back
is a client half built exactly as the simulation builds one (the same seeds for the initial
weights and the batch order), but on the device's own samples.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgefl.algorithms import ClientHalf, ClientSetup
from edgefl.errors import ConfigError, DataError, EdgeflError, PayloadError
from edgefl.messages import DEFAULT_MAX_BYTES
from edgefl.seeding import GLOBAL_RNG_LOCK, derive_seed
from edgefl.task import Task, parse_task
from edgefl.transport.base import DeviceTransport
from edgefl.transport.envelope import Envelope, pack, unpack
from edgefl.transport.signing import Verifier

log = logging.getLogger("edgefl.device")

HELLO_FIRST_WAIT_S = 2.0
HELLO_MAX_WAIT_S = 30.0


class Declined(EdgeflError):
    """The device cannot take part in this run (its data or profile does not fit the task)."""


@dataclass
class Enrolment:
    """What joining gave the device: its task, its client half and what it read."""

    task: Task
    client: ClientHalf
    source: str
    notes: list[str]
    samples: int
    validation: int
    class_counts: list[int]


def task_digest(task: Task) -> str:
    """What makes a device's saved state belong to a task: everything but the run id."""
    facts = {k: v for k, v in task.to_info().items() if k != "run"}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


class Joiner:
    """The device's side of joining, over a connected transport."""

    def __init__(self, transport: DeviceTransport, device: str, federation: str, *, profile: dict[str, Any] | None = None,
                 say: Callable[[str], None] = log.warning, verifier: Verifier | None = None) -> None:
        self.verifier = verifier
        self.transport = transport
        self.device = device
        self.federation = federation
        self.profile = profile
        self.say = say

    def _join(self, stage: str, **facts: Any) -> Envelope:
        env = Envelope("join", self.federation, 0, self.device, extra={"info": {"stage": stage, **facts}})
        self.transport.send(pack(env))
        return env

    def _reply(self, asked: set[str], wait_s: float, kinds: tuple[str, ...]) -> Envelope | None:
        """The server's answer to one of ``asked`` (a message id), waiting at most ``wait_s``."""
        end = self.transport.now() + wait_s
        while self.transport.now() < end:
            item = self.transport.receive(min(0.5, max(end - self.transport.now(), 0.0)))
            if item is None or item.channel != "message":
                continue
            try:
                if self.verifier is not None:
                    self.verifier.verify(item.payload, self.device)
                env = unpack(item.payload, DEFAULT_MAX_BYTES)
            except PayloadError as exc:
                log.warning("%s: ignoring a malformed message while joining: %s", self.device, str(exc)[:200])
                continue
            if env.sender == "server" and env.type in kinds and env.reply_to in asked:
                return env
        return None

    def ask_task(self, timeout_s: float | None = None) -> Task:
        """Send ``hello`` (again, with growing waits: the server may not be up yet) until the
        server answers with this device's task or refuses it."""
        asked: set[str] = set()
        wait = HELLO_FIRST_WAIT_S
        started = self.transport.now()
        while timeout_s is None or self.transport.now() - started < timeout_s:
            asked.add(self._join("hello", **({"profile": self.profile} if self.profile is not None else {})).message_id)
            left = math.inf if timeout_s is None else timeout_s - (self.transport.now() - started)
            reply = self._reply(asked, max(min(wait, left), 0.0), ("task", "nack"))  # no wait past --timeout
            if reply is None:
                if wait >= 8:  # a server that is up but under another federation never answers: say what to check
                    self.say(f"{self.device}: no answer from the server of federation {self.federation!r} yet; asking again "
                             "(is the server up, and is --federation its network.federation?)")
                wait = min(wait * 2, HELLO_MAX_WAIT_S)
                continue
            if reply.type == "nack":
                raise Declined(f"the server refused {self.device}: {str(reply.extra.get('reason'))[:500]}",
                               hint="the reason says what to change (the device id, its profile, or the server's config)")
            info = (reply.extra.get("info") or {}).get("task")
            try:
                task = parse_task(info)
            except PayloadError as exc:
                run = info.get("run") if isinstance(info, dict) else None
                if isinstance(run, str) and 0 < len(run) <= 200:  # once, unacknowledged: the server hears why this device is not joining
                    self._join("decline", run=run, reason=" ".join(str(exc).split())[:500])
                raise
            if task.device != self.device or task.federation != self.federation:
                raise PayloadError(f"the task names device {task.device!r} of {task.federation!r}, not this one")
            return task
        raise EdgeflError(f"no task from the server of federation {self.federation!r} within {timeout_s:g} s",
                          hint="start edgefl server (with data.partition = \"devices\"), check --broker and --federation")

    def confirm(self, stage: str, task: Task, timeout_s: float, **facts: Any) -> Envelope | None:
        """Send ``ready`` or ``decline`` until the server acknowledges it (or ``timeout_s``)."""
        asked: set[str] = set()
        started = self.transport.now()
        while self.transport.now() - started < timeout_s:
            asked.add(self._join(stage, run=task.run, **facts).message_id)
            reply = self._reply(asked, task.network.ack_timeout_s, ("ack", "nack"))
            if reply is not None:
                return reply
        return None


def split_validation(task: Task, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, validation indices) of a device's n samples, drawn from (seed, device)."""
    order = np.random.default_rng(derive_seed(task.seed, "validation", task.device)).permutation(n)
    n_val = max(1, int(round(task.data.validation_fraction * n)))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def build_client_from_task(task: Task, x: torch.Tensor, y: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor) -> ClientHalf:
    """The client half a task describes, on the device's own samples: seeded as the simulation
    seeds a device of the same id (edgefl.build.build_client)."""
    from edgefl.compute import resolve_device
    from edgefl.methods import get_method
    from edgefl.models import build_model

    method = get_method(task.method.name)
    shape = tuple(task.data.input_shape)
    num_classes = len(task.data.class_names)
    with GLOBAL_RNG_LOCK:
        torch.manual_seed(derive_seed(task.seed, "client-init", task.device))
        model = build_model(task.model.name, num_classes=num_classes, input_shape=shape, **task.model.options)
    device = resolve_device(task.compute)
    if device.type != "cpu":
        model.to(device)
        x, y, x_val, y_val = x.to(device), y.to(device), x_val.to(device), y_val.to(device)
    setup = ClientSetup(client_id=task.device, arch=task.model.arch, model=model, x=x, y=y, num_classes=num_classes, train=task.train,
                        seed=task.seed, total_rounds=task.rounds, x_test=x_val, y_test=y_val)
    return method.client_class()(setup, method.parse_options(task.method.options))


def _decline(joiner: Joiner, task: Task, reason: str, hint: str | None) -> Declined:
    """Tell the server why this device cannot take part (until acknowledged, briefly), and the error to raise."""
    joiner.confirm("decline", task, min(task.network.ack_timeout_s * 2, 30.0), reason=reason[:500])
    return Declined(f"{task.device} cannot take part: {reason}", hint=hint)


def join_run(transport: DeviceTransport, device: str, federation: str, data: str | Path, *, loader: str | None = None,
             profile: dict[str, Any] | None = None, timeout_s: float | None = None,
             say: Callable[[str], None] = log.warning, verifier: Verifier | None = None) -> Enrolment:
    """Ask for the task, read the device's data against it and build its client half; declined
    (:class:`Declined`, after telling the server why) when the data does not fit."""
    from edgefl.data.held import DataSpec, load_held_data

    joiner = Joiner(transport, device, federation, profile=profile, say=say, verifier=verifier)
    task = joiner.ask_task(timeout_s)
    d = task.data
    spec = DataSpec(kind=d.kind, class_names=tuple(d.class_names), input_shape=tuple(d.input_shape), pixel_divisor=d.pixel_divisor,
                    mean=tuple(d.mean) if d.mean is not None else None, std=tuple(d.std) if d.std is not None else None,
                    feature_names=tuple(d.feature_names) if d.feature_names is not None else None, label_column=d.label_column,
                    resize=d.resize)
    try:
        held = load_held_data(data, spec, loader=loader)
        if len(held.y) < 2:
            raise DataError(f"{data} holds {len(held.y)} sample: a device needs at least two (one to train on, one to validate)",
                            hint="add samples to the device's data")
    except DataError as exc:
        raise _decline(joiner, task, exc.message, exc.hint) from None
    train_idx, val_idx = split_validation(task, len(held.y))
    t, v = torch.from_numpy(train_idx), torch.from_numpy(val_idx)
    try:
        client = build_client_from_task(task, held.x[t], held.y[t], held.x[v], held.y[v])
    except ConfigError as exc:  # a task this device cannot train (the method refuses its settings): the server hears why
        raise _decline(joiner, task, f"the task it was given: {exc.message}", exc.hint) from None
    counts = torch.bincount(held.y, minlength=len(d.class_names)).tolist()
    reply = joiner.confirm("ready", task, task.network.round_deadline_s, samples=len(held.y), validation=len(val_idx),
                           class_counts=counts, source=held.source[:200])
    if reply is None:
        raise EdgeflError(f"the server did not acknowledge {device}'s ready within {task.network.round_deadline_s:g} s",
                          hint="the server may have stopped; start the device again")
    if reply.type == "nack":
        raise Declined(f"the server refused {device}'s data: {str(reply.extra.get('reason'))[:500]}")
    return Enrolment(task, client, held.source, list(held.notes), len(held.y), len(val_idx), counts)
