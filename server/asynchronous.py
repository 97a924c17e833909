"""Asynchronous runs (``mode = "async"``): no rounds; a device trains whenever it is free and the
server changes with every report, as FedHe's paper runs it.

The loop, over the same transport, checks, receipts and device loop as a synchronous run:

* a free device (online, no download outstanding) gets a download at once: the server's newest
  knowledge or weights, numbered by a run-wide counter (the envelope's ``round``; it never
  repeats, so a device's seeds and its resend bookkeeping work unchanged) and tagged with the
  server version it carries (``info.version``). ``asynchronous.concurrency`` caps how many train
  at once; free devices are drawn with the seed;
* its report is checked as every upload is, then judged by its staleness: the server updates
  since its download. Beyond ``staleness_bound`` it is refused with the reason; otherwise the
  :class:`AsyncAggregator` hands it to the method's server half, and the device gets its next
  download;
* the run is judged every ``eval.every`` server updates (or every ``eval_every_s`` seconds of the
  transport's clock: virtual in a simulation) and ends after ``rounds`` updates or
  ``time_budget_s``, whichever comes first.

Server halves are not rewritten for this: the aggregator calls their synchronous contract with
one "round" per server update (``begin_round`` / ``receive`` / ``close_round``). What makes it
asynchronous is what it feeds them: a report's shared weights (:meth:`ServerHalf.shared_weights`)
are rebased onto the current ones as a discounted step, so averaging the buffered reports is
FedBuff (Nguyen et al. 2022: ``w += lr * mean_i s(t_i) * delta_i``, sample-weighted here; batch
norms' running statistics move toward the reports' values instead, by ``min(1, lr * s(t))``) and
a buffer of one with ``aggregation = "fedasync"`` is FedAsync (Xie et al. 2019:
``w = (1 - a_t) w + a_t w_i``, ``a_t = mixing * s(t)``), with ``s(t) = (1 + t) ** -exponent``.
Knowledge (FedHe's logits, Felo's features, CHFL's head ...) is merged by the method itself,
one report per update by default.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edgefl.config import AsyncSettings
from edgefl.messages import Message
from edgefl.seeding import derive_seed
from edgefl.server.methods.base import Receipt
from edgefl.server.policy import AfterRecord, RoundPolicy
from edgefl.server.records import Tally, timing_fields
from edgefl.server.rejections import Rejections
from edgefl.transport.envelope import Envelope


#: times in a row every device at work may go silent before an asynchronous run fails
MAX_STALLS = 3


def is_running_statistic(name: str) -> bool:
    """A batch norm's running mean or variance (kept by the layer, not trained)."""
    return name.rsplit(".", 1)[-1] in ("running_mean", "running_var")


def staleness_discount(staleness: int, exponent: float) -> float:
    """FedBuff's and FedAsync's polynomial discount: a report ``staleness`` updates old counts this much."""
    return float((1 + max(staleness, 0)) ** -exponent)


def default_buffer_size(settings: AsyncSettings, weight_method: bool, devices: int) -> int:
    """Reports per server update: one for knowledge methods and FedAsync, else ``buffer_size``
    or min(10, devices // 2) (FedBuff's paper uses 10 with far more devices)."""
    if weight_method and settings.aggregation == "fedasync":
        return 1
    if settings.buffer_size is not None:
        return settings.buffer_size
    return max(1, min(10, devices // 2)) if weight_method else 1


class AsyncAggregator:
    """Turns reports into server updates through a method's synchronous server half."""

    def __init__(self, server, settings: AsyncSettings, weight_method: bool, devices: int) -> None:
        self.server = server
        self.settings = settings
        self.buffer_size = default_buffer_size(settings, weight_method, devices)
        self.version = 0  # server updates so far
        self.collecting: set[str] = set()  # devices whose report waits in the buffer
        self.last_facts: dict[str, Any] = {}
        self._starts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # (arch, version) -> weights handed out
        self._users: Counter[tuple[str, int]] = Counter()
        server.begin_round(1)

    # --- what a device started from -----------------------------------------------------------
    def handed_out(self, device: str) -> tuple[str, int]:
        """Note the weights ``device`` downloads now (kept, shared by devices of one
        architecture, while a report may still be rebased on them)."""
        key = (self.server.clients[device].arch, self.version)
        if key not in self._starts:
            self._starts[key] = dict(self.server.shared_weights(device))
        self._users[key] += 1
        return key

    def release(self, key: tuple[str, int]) -> None:
        self._users[key] -= 1
        if self._users[key] <= 0:
            del self._users[key]
            self._starts.pop(key, None)

    # --- reports ----------------------------------------------------------------------------
    def discount(self, staleness: int) -> float:
        return staleness_discount(staleness, self.settings.staleness_exponent)

    def rebase(self, message: Message, start: tuple[str, int], staleness: int) -> Message:
        """The report as the server half should see it in the current update: its shared
        weights replaced by the current ones plus a discounted step (FedBuff's delta from what the
        device started from, or FedAsync's mix with the current model). Tensors that do not fit
        the shared weights are passed on untouched: the method's own checks refuse them."""
        now = self.server.shared_weights(message.sender)
        began = self._starts.get(start, {})
        tensors = dict(message.tensors)
        s = self.discount(staleness)
        fedasync = self.settings.aggregation == "fedasync"
        for name, current in now.items():
            mine = tensors.get(name)
            if mine is None or not current.is_floating_point() or mine.shape != current.shape or mine.dtype != current.dtype:
                continue
            if fedasync:
                step = self.settings.mixing * s * (mine.double() - current.double())
            elif is_running_statistic(name):
                # a norm layer's running mean / variance is a statistic, not a parameter: a step from
                # a stale origin can drive a variance below zero (NaN at the next forward pass), so
                # it moves toward the device's value by a convex share
                step = min(1.0, self.settings.server_lr * s) * (mine.double() - current.double())
            else:
                origin = began.get(name, current)
                step = self.settings.server_lr * s * (mine.double() - origin.double())
            tensors[name] = (current.double() + step).to(current.dtype)
        return Message(message.kind, self.version + 1, message.sender, tensors, message.meta, message.message_id)

    def add(self, message: Message, start: tuple[str, int], staleness: int) -> Receipt:
        """Hand one report to the server half; update when the buffer is full. A device reporting
        again before the buffer fills closes it first (a server half holds one report per device)."""
        if message.sender in self.collecting:
            self.update()
        receipt = self.server.receive(self.rebase(message, start, staleness))
        if receipt.status == "accepted":
            self.collecting.add(message.sender)
            if len(self.collecting) >= self.buffer_size:
                self.update()
        return receipt

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the aggregator (taken with an empty buffer: see
        :meth:`AsyncUpdates.quiescent`); the server half is saved by itself."""
        return {"version": self.version, "last_facts": self.last_facts, "starts": self._starts, "users": self._users}

    def load(self, saved: dict[str, Any]) -> None:
        self.version = int(saved["version"])
        self.last_facts = dict(saved["last_facts"])
        self._starts = dict(saved["starts"])
        self._users = Counter(saved["users"])
        self.collecting = set()

    def update(self) -> None:
        """One server update: the method aggregates or merges what the buffer holds."""
        self.version += 1
        self.last_facts = self.server.close_round(self.version) or {}
        self.collecting = set()
        self.server.begin_round(self.version + 1)


@dataclass
class Ticket:
    """A download outstanding: what a device is training on."""

    number: int  # the envelope's round: unique in the run
    version: int  # the server version it carries
    start: tuple[str, int]  # the aggregator's key of the weights it carries
    sent: float  # run clock
    envelope: Envelope


@dataclass
class Window:
    """What happened since the last record (the traffic and refusals in its tally)."""

    tally: Tally = field(default_factory=Tally)
    staleness: list[int] = field(default_factory=list)
    refused_stale: int = 0
    updates_from: int = 0
    silent: list[str] = field(default_factory=list)  # devices whose work was given up (see AsyncUpdates.give_up_silent)


class AsyncUpdates(RoundPolicy):
    """Plays an asynchronous run over the endpoint (see the module docstring)."""

    mode_info = {"mode": "async"}

    def __init__(self, *args: Any, collectors: list | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the run's filters: what each reports in a record (local DP's epsilon so far), as a round's record has it
        self.collectors = list(collectors or [])
        self.settings = self.cfg.asynchronous
        weight_method = "weights" in self.spec.uploads
        self.aggregator = AsyncAggregator(self.server, self.settings, weight_method, len(self.endpoint.device_ids))
        self.tickets: dict[str, Ticket] = {}
        self.answered: dict[str, deque[tuple[str, str, dict[str, Any]]]] = {}  # device -> (upload id, kind, fields)
        self.counter = 0  # downloads handed out
        self.window = Window()
        self.asked: set[str] = set()  # devices asked to report their accuracy since the last record
        self.stopping = False
        self.started = 0.0
        self._dirty = True  # something may have freed a device: look for work to hand out
        # where play() stands: the next record by updates / by clock, the update last recorded
        self.next_version = self.cfg.eval.every
        self.next_time = self.settings.eval_every_s if self.settings.eval_every_s is not None else math.inf
        self.recorded = -1
        #: called with no argument to save a checkpoint (set by the run's session); taken every
        #: ``checkpoint_every`` records, at the first moment no report waits in the buffer
        self.checkpoint: Callable[[], None] | None = None
        self.checkpoint_every = 0
        self._checkpoint_due = False
        self._resumed = False
        self.stalls = 0  # times in a row every device at work went silent (see give_up_silent)
        self.failure: str | None = None  # why the run could not go on (its last record fails)

    @property
    def version(self) -> int:
        return self.aggregator.version

    def elapsed(self) -> float:
        return self.clock.now() - self.started

    def needed_to_start(self) -> int:
        return 1  # an asynchronous run starts with the first device: the others join when they come

    def rejections_now(self) -> Rejections | None:
        return self.window.tally.rejected

    # --- handing out work ---------------------------------------------------------------------
    def fill(self) -> None:
        """Give every free online device a download, up to ``concurrency`` devices at work."""
        if self.stopping or not self._dirty:
            return
        self._dirty = False
        ep = self.endpoint
        working = sum(1 for d in self.tickets if ep.is_online(d))
        limit = self.settings.concurrency or len(ep.device_ids)
        free = [d for d in ep.device_ids if d not in self.tickets and ep.can_take_part(d)]
        slots = limit - working
        if slots <= 0 or not free:
            return
        if slots < len(free):
            rng = np.random.default_rng(derive_seed(self.cfg.seed, "async-pick", self.counter))
            free = sorted(rng.choice(free, slots, replace=False).tolist())
        for device in free:
            self.dispatch(device)

    def dispatch(self, device: str) -> None:
        ep = self.endpoint
        self.counter += 1
        number = self.counter
        info: dict[str, Any] = {"run": ep.run_id, "mode": "async", "version": self.version}
        if self.evaluator.devices_report(self.server) and (self.settings.device_accuracy == "every_report" or device not in self.asked):
            info["evaluate"] = True  # its report carries its accuracy (the run is judged by them)
            self.asked.add(device)
        start = self.aggregator.handed_out(device)  # before sending: the weights this download carries
        env, body_bytes, sent = ep.send_download(device, number, self.server.downlink(number, device), {"info": info})
        self.tickets[device] = Ticket(number, self.version, start, self.clock.now(), env)
        self.window.tally.download(device, body_bytes, sent)

    def on_presence(self, device: str, online: bool, was: bool) -> None:
        if online and not was and device in self.tickets and not self.stopping:
            # back after a drop: it may have missed its download (a second copy is ignored)
            self.endpoint.send(device, self.tickets[device].envelope)
        self._dirty = True

    def _end_ticket(self, device: str) -> None:
        ticket = self.tickets.pop(device)
        self.aggregator.release(ticket.start)
        self._dirty = True

    # --- reports ------------------------------------------------------------------------------
    def _answer(self, device: str, env: Envelope, upload_id: str, kind: str, **fields: Any) -> None:
        if kind == "nack":
            self.endpoint.refuse(device, env, fields["reason"])
        else:
            self.endpoint.reply(device, env, "ack", **fields)
        self.answered.setdefault(device, deque(maxlen=4)).append((upload_id, kind, fields))

    def on_upload(self, device: str, env: Envelope, message: Message, size: int, facts: dict[str, Any]) -> None:
        """One decoded, checked upload (not an evaluation answer)."""
        ep = self.endpoint
        ticket = self.tickets.get(device)
        if ticket is None or message.round != ticket.number:
            for upload_id, kind, fields in self.answered.get(device, ()):
                if upload_id == message.message_id:  # a resend: the same answer again
                    if kind == "nack":
                        ep.refuse(device, env, fields["reason"])
                    else:
                        ep.reply(device, env, "ack", **{**fields, "status": "duplicate"})
                    return
            current = f"download {ticket.number}" if ticket is not None else "no download"
            ep.refuse(device, env, f"download {message.round} is not {device}'s current work ({current} outstanding); not used")
            return
        staleness = self.version - ticket.version
        bound = self.settings.staleness_bound
        if bound is not None and staleness > bound:
            self.window.refused_stale += 1
            self._end_ticket(device)
            self._answer(device, env, message.message_id, "nack",
                         reason=f"stale: trained from server version {ticket.version}, now {self.version} ({staleness} updates > "
                                f"staleness_bound {bound}); not used, the next download carries the newest")
            self.on_event("stale", {"device": device, "staleness": staleness})
            return
        try:
            receipt = self.aggregator.add(message, ticket.start, staleness)
        except Exception as exc:  # a method's check that raised instead of answering: still a refusal
            receipt = Receipt("rejected", f"server could not use the upload: {type(exc).__name__}: {exc}")
        self._end_ticket(device)
        ep.model_version = self.version
        if receipt.status == "rejected":
            self._answer(device, env, message.message_id, "nack", reason=receipt.reason)
            return
        fields: dict[str, Any] = {"status": receipt.status, "info": {"version": self.version, "staleness": staleness}}
        if receipt.reason:
            fields["reason"] = receipt.reason
        self._answer(device, env, message.message_id, "ack", **fields)
        if message.meta.get("eval_accuracy") is not None:
            self.evaluator.device_reported(device, message.meta["eval_accuracy"], self.version)
        w = self.window
        if receipt.status != "accepted":
            w.tally.late.append(device)
            return
        w.staleness.append(staleness)
        self.stalls = 0
        w.tally.upload(device, env, message, size, accepted=True)
        self.on_event("update", {"device": device, "version": self.version, "staleness": staleness})

    # --- records --------------------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """The metrics record of the updates since the last one, with the run judged now."""
        w = self.window
        version, clock_s = self.version, self.elapsed()  # reports answered while judging are counted in this record
        train_s = time.perf_counter() - w.tally.wall0
        self.on_event("evaluating", {"round": version})
        t1 = time.perf_counter()
        if self.settings.device_accuracy == "at_records" and self.evaluator.devices_report(self.server):
            self.judge_idle(self.version, self.tickets)  # busy devices keep their last value
        # a report counts as current when made in this record's window (after its first update):
        # each device reports at its own update, so "before this very update" would list nearly all
        accuracy = self.evaluate(self.version, current_from=w.updates_from + 1)
        eval_s = time.perf_counter() - t1
        accepted = w.tally.accepted
        by_profile: Counter[str] = Counter()
        for device, n in accepted.items():
            by_profile[self.profiles.get(device, "-")] += n
        record = {
            "round": version,
            "mode": "async",
            "outcome": "async",
            "updates": version - w.updates_from,
            "clock_s": round(clock_s, 4),
            "virtual_clock": bool(self.clock.virtual),
            "downloads": self.counter,
            "in_flight": len(self.tickets),
            "reports": sum(accepted.values()),
            "reports_per_client": dict(sorted(accepted.items())),
            "reports_by_profile": dict(sorted(by_profile.items())),
            "staleness": {"mean": round(statistics.fmean(w.staleness), 3), "max": max(w.staleness)} if w.staleness else None,
            "refused_stale": w.refused_stale,
            **({"silent": sorted(set(w.silent))} if w.silent else {}),
            "selected": [],
            "reported": sorted(accepted),
            "missing": [],
            "receipts": {},
            **w.tally.fields(),
            "accuracy": accuracy,
            "server": self.aggregator.last_facts,
            **timing_fields(train_s, eval_s, train_s + eval_s),
        }
        facts = {type(c).name: f for c in self.collectors if (f := c.round_facts(version))}
        if facts:
            record["filters"] = facts
        if self.failure is not None:
            record.update(outcome="failed", failure=self.failure)
        self.window = Window(updates_from=version)
        self.asked = set()
        self._dirty = True
        return record

    # --- checkpoints ----------------------------------------------------------------------------
    def quiescent(self) -> bool:
        """Nothing half-done on the server's side: no report waiting in the buffer, no upload half
        reassembled, no evaluation being collected. A checkpoint is taken only then, so what it
        holds is the server half's state between updates and the tickets of the work out."""
        ep = self.endpoint
        return not self.aggregator.collecting and not ep.reassembler.partial and ep.exchange is None

    def state(self) -> dict[str, Any]:
        """What the run carries between updates besides the server half: the work handed out
        (each ticket's download, sent again to a device that comes back), the answers kept for
        resends, the open record's tally, the draws' counter and where play() stands."""
        return {"aggregator": self.aggregator.state(), "tickets": self.tickets, "answered": self.answered,
                "counter": self.counter, "window": self.window, "asked": self.asked, "started": self.started,
                "elapsed": self.elapsed(), "virtual": bool(self.clock.virtual), "dirty": self._dirty,
                "next_version": self.next_version, "next_time": self.next_time, "recorded": self.recorded,
                "last_round": self.last_round, "stalls": self.stalls}

    def restore(self, saved: dict[str, Any]) -> None:
        """Go on from :meth:`state` (the server half already loaded). On a virtual clock (restored
        with the devices) the start is the saved one; on a wall clock the run's elapsed time goes
        on from where it stopped."""
        self.aggregator.load(saved["aggregator"])
        self.tickets = dict(saved["tickets"])
        self.answered = {d: deque(q, maxlen=4) for d, q in saved["answered"].items()}
        self.counter = int(saved["counter"])
        self.window = saved["window"]
        self.window.tally.wall0 = time.perf_counter()  # a time of the process that saved it
        self.asked = set(saved["asked"])
        virtual = bool(self.clock.virtual) and saved["virtual"]
        self.started = float(saved["started"]) if virtual else self.clock.now() - float(saved["elapsed"])
        shift = 0.0 if virtual else self.started - float(saved["started"])
        self._dirty = bool(saved["dirty"])
        self.next_version = int(saved["next_version"])
        self.next_time = float(saved["next_time"])  # on the run's elapsed time, which goes on where it stopped
        self.recorded = int(saved["recorded"])
        self.last_round = int(saved["last_round"])
        self.stalls = int(saved["stalls"])
        for ticket in self.tickets.values():
            ticket.sent += shift
        self.endpoint.model_version = self.version
        self._resumed = True

    def give_up_silent(self) -> bool:
        """On a virtual clock with nothing left on its way, the devices holding work will never
        report: each refused its download (a model that turned non-finite in training is
        restored and the download refused; the device's log says why) and said nothing, as a
        real device does. Their work is given up and they get new downloads; after
        :data:`MAX_STALLS` such times in a row with no report accepted, the run cannot go on
        and fails with the reason (instead of waiting forever). False then."""
        silent = sorted(self.tickets)
        for device in silent:
            self._end_ticket(device)
        self.window.silent.extend(silent)
        self.on_event("silent", {"devices": silent, "version": self.version})
        self.stalls += 1
        if self.stalls < MAX_STALLS:
            return True
        shown = ", ".join(silent[:5]) + (f" and {len(silent) - 5} more" if len(silent) > 5 else "")
        self.failure = (f"no report can arrive: every device given work refused its download or said nothing, {MAX_STALLS} "
                        f"times in a row ({shown}); the devices' logs say why (a model that turned non-finite in training "
                        f"refuses the download)")
        return False

    def _maybe_checkpoint(self) -> None:
        if self._checkpoint_due and self.checkpoint is not None and self.quiescent():
            self._checkpoint_due = False
            self.checkpoint()

    # --- the whole run --------------------------------------------------------------------------
    def play(self, first_round: int, after_record: AfterRecord | None, should_stop: Callable[[], bool]) -> bool:
        """Play until ``rounds`` updates or the time budget; True when it ran to its end (False:
        stopped by ``should_stop``). A restored run (:meth:`restore`) goes on from the top of the
        loop where its checkpoint was taken; ``first_round`` is not used."""
        cfg, settings, ep = self.cfg, self.settings, self.endpoint
        budget = settings.time_budget_s
        every_s = settings.eval_every_s
        finished = True

        def emit() -> None:
            record = self.record()
            self.recorded = record["round"]
            self.history.append(record)
            self.on_event("closed", record)
            if after_record is not None:
                after_record(record)
            if self.checkpoint_every and len(self.history) % self.checkpoint_every == 0:
                self._checkpoint_due = True

        if not self._resumed:
            self.started = self.clock.now()
            self.fill()
        while self.version < cfg.rounds:
            self._maybe_checkpoint()
            elapsed = self.elapsed()
            if budget is not None and elapsed >= budget:
                break
            if should_stop():
                self.on_event("stopped", {"after_round": self.version})
                if self.checkpoint is not None and self.quiescent():
                    self.checkpoint()  # resumable from here; else from the last checkpoint
                finished = False
                break
            if self.clock.virtual and not self.tickets and not any(ep.is_online(d) for d in ep.device_ids):
                self.on_event("all_offline", {"round": self.version})
                break
            if self.clock.virtual and self.tickets and self.clock.idle():
                if not self.give_up_silent():
                    break
                self.fill()
                continue
            wait = 1.0 if budget is None else min(1.0, budget - elapsed)
            if every_s is not None:
                wait = min(wait, max(self.next_time - elapsed, 0.0))
            ep.pump(max(wait, 0.0))
            if every_s is None and self.version >= self.next_version:
                while self.next_version <= self.version:
                    self.next_version += cfg.eval.every
                emit()
            elif every_s is not None and self.elapsed() >= self.next_time:
                while self.next_time <= self.elapsed():
                    self.next_time += every_s
                emit()
            self.fill()  # after a record: its evaluation asks idle devices before they get new work
        self.stopping = True
        self.last_round = self.version
        if finished and (self.recorded != self.version or self.failure is not None):
            emit()  # the end is always judged (and a failure recorded)
        return finished
