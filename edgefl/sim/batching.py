"""The simulation's side of batched training: downloads that arrive together are trained together,
one batched computation per architecture (:func:`edgefl.algorithms.batched.train_together`).

The in-memory network hands every download of a pass to :meth:`FitBatcher.take` instead of
letting each device train at once, then calls :meth:`FitBatcher.run`, which trains them (grouped
where the method and model allow, one at a time otherwise) and returns each device's upload in
the order the downloads came. Why a group could not be batched is logged once per run.
"""

from __future__ import annotations

import json
import logging

from edgefl.algorithms.batched import NotBatchable, describe, train_together
from edgefl.device import DeviceLoop
from edgefl.messages import Message
from edgefl.transport.envelope import Envelope

log = logging.getLogger("edgefl.sim")


class FitBatcher:
    def __init__(self) -> None:
        self.pending: list[tuple[DeviceLoop, Envelope]] = []
        self.batched = 0  # clients trained as part of a batch (run.json / tests)
        self.alone = 0  # clients trained one at a time
        self._said: set[str] = set()
        self._devices: set[str] = set()

    def take(self, loop: DeviceLoop, env: Envelope) -> bool:
        self.pending.append((loop, env))
        self._devices.add(loop.device)
        return True

    def holds(self, device: str) -> bool:
        return device in self._devices

    def _once(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            log.warning("%s: these clients train one at a time", why)

    def run(self) -> list[tuple[DeviceLoop, Envelope, Message]]:
        """Train every pending download; (loop, download, upload) in the order they were taken."""
        pending, self.pending = self.pending, []
        self._devices = set()
        done: dict[int, Message] = {}
        groups: dict[tuple, list[tuple[int, object]]] = {}
        for k, (loop, env) in enumerate(pending):
            client = loop.client
            if client.setup.train.dp_sgd is not None:
                self._once("DP-SGD (train.dp_sgd) computes per-sample gradients one client at a time")
                continue
            if client.setup.train.optimizer_state == "kept":
                self._once('train.optimizer_state = "kept": each device steps its own optimizer, one client at a time')
                continue
            inherited = _plan_not_for_fit(type(client))
            if inherited:
                self._once(inherited)
                continue
            plan = client.batch_plan(loop.downlink(env), env.round)
            if plan is None:
                self._once(f"{type(client).__name__} with these options has no batched form")
                continue
            shapes = tuple((name, tuple(t.shape)) for name, t in sorted(plan.consts.items()))
            # the round's settings: clients train together only at the same learning rate (train.lr_milestones)
            key = (type(client), client.setup.arch, describe(client.model), client.round_train(env.round).model_dump_json(),
                   json.dumps(plan.key, default=str), shapes, str(client.device))
            groups.setdefault(key, []).append((k, plan))
        for members in groups.values():
            if len(members) < 2:
                continue
            clients = [pending[k][0].client for k, _ in members]
            try:
                uploads = train_together(clients, [plan for _, plan in members],
                                         clients[0].round_train(pending[members[0][0]][1].round))
            except NotBatchable as exc:
                self._once(f"{clients[0].setup.arch}: {exc}")
                continue
            done.update({k: up for (k, _), up in zip(members, uploads)})
            self.batched += len(members)
        out = []
        for k, (loop, env) in enumerate(pending):
            if k not in done:  # one at a time (a group of one, or not batchable)
                done[k] = loop.fit(env)
                self.alone += 1
            out.append((loop, env, done[k]))
        return out


def _plan_not_for_fit(cls: type) -> str:
    """Why a client class's ``batch_plan`` cannot stand for its ``fit``: a subclass that changes
    ``fit`` (a plug-in's FedProx over FedAvg's client) but inherits its parent's ``batch_plan`` would
    train with the parent's loss in a batched round. Empty when the two are defined together."""
    def owner(name: str) -> type | None:
        return next((c for c in cls.__mro__ if name in c.__dict__), None)

    from edgefl.algorithms.base import ClientHalf

    fit, plan = owner("fit"), owner("batch_plan")
    if plan is None or fit is None or plan is fit or plan is ClientHalf or not issubclass(fit, plan):
        return ""  # ClientHalf's batch_plan is "no batched form": nothing to stand in
    return (f"{cls.__name__} overrides fit ({fit.__module__}) but inherits batch_plan from {plan.__name__}, whose loss "
            f"would stand in for its own")
