"""Synchronous rounds: the round policy of ``mode = "sync"``.

A round: select devices, announce the round, run the stages that come before training (each
with its deadline and quorum; devices that do not answer drop out), send every remaining device
its download, then take uploads until every one has reported, or until the deadline when a
quorum has reported (a round that misses its quorum is extended once by ``grace_s`` when
configured, else closed as failed and its uploads discarded), run the stages that come after
training, close the round in the server half, judge it and write its record.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from edgefl.config import RunConfig
from edgefl.messages import Message
from edgefl.seeding import derive_seed
from edgefl.server.policy import AfterRecord, RoundPolicy
from edgefl.server.endpoint import Exchange, all_offline_past
from edgefl.filters import Filter
from edgefl.server.records import Tally, timing_fields
from edgefl.server.rejections import Rejections
from edgefl.stages import Stage, StageFailed
from edgefl.transport.envelope import Envelope

log = logging.getLogger("edgefl.server")
ANNOUNCE_SELECTED_MAX = 100  # larger selections are announced as a count: every device receives the announcement


def select_devices(cfg: RunConfig, device_ids: list[str], round_no: int) -> list[str]:
    """This round's participants from ``device_ids`` (the pool): ceil(ratio x pool), or
    per_round x (1 + over_select), drawn from (seed, round)."""
    if not device_ids:
        return []
    k = cfg.fleet.selection_size(len(device_ids))
    if k >= len(device_ids):
        return list(device_ids)
    rng = np.random.default_rng(derive_seed(cfg.seed, "sample", round_no))
    return sorted(rng.choice(device_ids, k, replace=False).tolist())


@dataclass
class RoundState:
    round: int
    selected: list[str]
    started: float  # run clock
    deadline: float  # run clock
    reported: dict[str, str] = field(default_factory=dict)  # device -> receipt status
    receipts: dict[str, str] = field(default_factory=dict)  # device -> "status[: reason]"
    offline_since: dict[str, float] = field(default_factory=dict)  # selected, unreported devices gone offline
    dropped: dict[str, str] = field(default_factory=dict)  # device -> the stage it did not answer
    extended: bool = False  # the deadline was moved by grace_s
    all_offline: bool = False  # closed early: every device it waited for was offline past offline_grace_s
    downloads: dict[str, Envelope] = field(default_factory=dict)
    accepted_ids: dict[str, str] = field(default_factory=dict)
    work_s: dict[str, float | None] = field(default_factory=dict)  # virtual seconds of work (simulation)
    target: int = 0  # accepted updates that close the round (0: every selected device)
    accepted: int = 0
    tally: Tally = field(default_factory=Tally)
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)  # what each stage saw (recorded when there are stages)
    failure: str | None = None  # why the round failed
    closed_unix: float | None = None  # wall clock when the round stopped taking uploads

    def __post_init__(self) -> None:
        self.chosen = frozenset(self.selected)  # membership tests stay O(1) with thousands selected
        self.target = self.target or len(self.selected)

    @property
    def full(self) -> bool:
        """The round has its target of accepted updates: later uploads are late."""
        return self.accepted >= self.target

    @property
    def rejected(self) -> Rejections:
        return self.tally.rejected

    def taking_part(self) -> list[str]:
        """Selected devices that have not dropped out in a stage."""
        return [d for d in self.selected if d not in self.dropped]


def _stage_check(stage: Stage, round_no: int, device: str, message: Message) -> str | None:
    return stage.check(round_no, device, message)


class SyncRounds(RoundPolicy):
    """Plays a config's rounds (see the module docstring). ``stages``: the exchanges every round
    runs besides training, in order (from the filters and the method)."""

    def __init__(self, *args: Any, stages: list[Stage] | None = None, collectors: list[Filter] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stages = list(stages or [])
        #: server-side filters that may take uploads in place of the server half (secure
        #: aggregation), then hand it what they release after the round's stages
        self.collectors = list(collectors or [])
        self.state: RoundState | None = None
        #: the round just closed, while it is judged: uploads for it that arrive then are listed late in its record
        self.closing: RoundState | None = None
        self.last_accepted: tuple[int, dict[str, str]] = (0, {})  # the last closed round's accepted upload ids
        #: device -> the round of a download it has not answered yet (busy: not asked to judge its model)
        self.working: dict[str, int] = {}
        self.early: dict[str, tuple[Envelope, Message, int]] = {}  # device -> an upload for the next round
        # uploads for the next round are held only just after a restart (the broker delivers what
        # devices queued while the server was down); otherwise an upload for a round that has not
        # started is refused, so nobody can fill a device's slot in advance
        self.accept_early = False

    def rejections_now(self) -> Rejections | None:
        return self.state.rejected if self.state is not None else None

    def is_eval_round(self, r: int) -> bool:
        return r % self.cfg.eval.every == 0 or r == self.cfg.rounds

    # --- a round ----------------------------------------------------------------------------------
    def run_round(self, r: int) -> dict[str, Any]:
        wall0 = time.perf_counter()
        ep = self.endpoint
        selected = select_devices(self.cfg, self._pool(), r)
        self.server.begin_round(r)
        now = self.clock.now()
        evaluate = self.is_eval_round(r)
        st = self.state = RoundState(r, selected, now, now + self.deadline_s, target=self.cfg.fleet.target(len(selected)))
        ep.model_version = r
        # every device receives the announcement: thousands of ids would multiply into megabytes
        # per round, so a large selection is announced as a count (each device learns from its download)
        listed = {"selected": selected} if len(selected) <= ANNOUNCE_SELECTED_MAX else {}
        ep.announce(r, {**listed, "selected_count": len(selected), "target": st.target,
                        "deadline_unix": time.time() + self.deadline_s, "rounds": self.cfg.rounds, "done": False})
        outcome = "failed" if not self._run_stages(st, "before") else self._train(st, evaluate)
        if outcome != "failed" and not (self._run_stages(st, "after") and self._release(st)):
            outcome = "failed"
        st.closed_unix = time.time()
        if outcome == "failed":
            self.server.discard_round(r)
            server_record: dict[str, Any] = {"failed": True}
        else:
            server_record = self.server.close_round(r)
            if isinstance(server_record.get("failure"), str):  # the server half could not do the round's work
                outcome, st.failure = "failed", server_record["failure"]
        closed = self.clock.now()
        train_time = time.perf_counter() - wall0
        self._note_stragglers(st)
        self.state, self.closing = None, st
        self.last_round = r
        accuracy, eval_time = None, 0.0
        if outcome != "failed" and evaluate:
            self.on_event("evaluating", {"round": r})
            t1 = time.perf_counter()
            if self.cfg.eval.unselected == "ask" and self.evaluator.devices_report(self.server):
                self._ask_unselected(r, set(st.selected))
            accuracy = self.evaluate(r)
            eval_time = time.perf_counter() - t1
        self.closing = None
        self.last_accepted = (r, dict(st.accepted_ids))  # a copy of one of them arriving later is a duplicate
        record = self._record(st, outcome, server_record, accuracy, closed - st.started, train_time, eval_time,
                              time.perf_counter() - wall0)
        self.history.append(record)
        self.on_event("closed", record)
        return record

    def _ask_unselected(self, r: int, selected: set[str]) -> None:
        """Judge the devices not selected for round ``r`` and not still working on an earlier
        download: without this the record would average only the devices that happened to train
        in an evaluation round, each as it was then (with one device a round, a few of ten, some
        from long ago)."""
        self.judge_idle(r, selected | set(self.working))

    def _train(self, st: RoundState, evaluate: bool) -> str:
        """The training exchange: downloads to the devices taking part, uploads until the round closes."""
        # devices judge their own models only when no global model will judge them
        info = {"info": {"run": self.endpoint.run_id, **({"evaluate": True} if evaluate and self.evaluator.devices_report(self.server) else {})}}
        for device in st.taking_part():
            st.downloads[device], body_bytes, sent = self.endpoint.send_download(device, st.round, self.server.downlink(st.round, device), info)
            self.working[device] = st.round
            st.tally.download(device, body_bytes, sent)
        self.on_event("round", {"round": st.round, "selected": st.selected, "deadline_unix": time.time() + self.deadline_s})
        for device, (early, message, size) in sorted(self.early.items()):
            if early.round == st.round:
                self.on_upload(device, early, message, size, {})
        self.early = {}
        self.accept_early = False
        return self._collect(st)

    def _run_stages(self, st: RoundState, when: str) -> bool:
        """The round's stages that come ``when`` ("before" or "after") training, in order; False
        when one failed the round (``st.failure`` says why)."""
        for stage in (s for s in self.stages if s.when == when):
            asked = st.taking_part() if when == "before" else [d for d in st.taking_part() if st.reported.get(d) == "accepted"]
            requests = {d: stage.request(st.round, d, asked) for d in asked}
            deadline = stage.deadline_s if stage.deadline_s is not None else self.deadline_s
            check = partial(_stage_check, stage, st.round)
            self.on_event("stage", {"round": st.round, "stage": stage.name, "asked": len(asked)})
            replies = self.endpoint.request(Exchange(stage.name, st.round, frozenset(asked), check), "stage", requests,
                                            {"stage": stage.name}, deadline)
            dropped = [d for d in asked if d not in replies]
            for device in dropped:
                st.dropped[device] = stage.name
                st.receipts[device] = f"dropped: no answer in stage {stage.name}"
            st.stages[stage.name] = {"asked": len(asked), "answered": len(replies), "dropped": dropped}
            try:
                if len(replies) < stage.needed(len(asked)):
                    raise StageFailed(f"stage {stage.name}: {len(replies)} of {len(asked)} devices answered, "
                                      f"{stage.needed(len(asked))} needed")
                stage.close(st.round, replies, dropped)
            except StageFailed as exc:
                st.failure = str(exc)
                self.on_event("stage_failed", {"round": st.round, "stage": stage.name, "reason": st.failure})
                return False
        return True

    def _release(self, st: RoundState) -> bool:
        """What the collectors release after the stages (the unmasked sums) goes to the server
        half; False (the round fails, with the reason) when the server half refuses it."""
        released: list[Message] = []
        for collector in self.collectors:
            for message in collector.release(st.round):
                released.append(message)
                status, reason = self._half_receipt(message.sender, message)
                if status == "rejected":
                    st.failure = f"the server half refused what {type(collector).__name__} released: {reason}"
                    return False
        for collector in self.collectors:
            collector.released(st.round, released)
        return True

    def _pool(self) -> list[str]:
        """Who a round selects from: every device, or with ``fleet.per_round`` those online (all
        of them when none is: downloads wait in the broker for devices with a session)."""
        pool = self.endpoint.pool()
        if self.cfg.fleet.per_round is None:
            return pool
        online = [d for d in pool if self.endpoint.is_online(d)]
        return online or pool

    def _collect(self, st: RoundState) -> str:
        taking_part = len(st.selected) - len(st.dropped)
        if not taking_part:  # no device can take part (with device-held data: none is ready)
            st.failure = st.failure or "no selected device could take part"
            return "failed"
        quorum = self.net.quorum_count(st.target)
        for device in st.taking_part():  # offline when the round starts: the grace counts from when it went
            # offline, so a device dead for many rounds (every device is selected without fleet.per_round)
            # does not hold each of them up by offline_grace_s; one that left just before gets what is left
            if self.endpoint.online.get(device) is False:
                st.offline_since[device] = min(self.endpoint.offline_since.get(device, math.inf), self.clock.now())
        while True:
            if st.full or len(st.reported) >= taking_part:
                return "complete"
            remaining = st.deadline - self.clock.now()
            if self._all_gone(st):
                self.on_event("all_offline", {"round": st.round, "offline": sorted(st.offline_since)})
                st.all_offline = True  # no grace either: nobody is left to report
                if len(st.reported) >= quorum:
                    return "offline"
                st.failure = f"no quorum ({len(st.reported)} of {quorum} needed reported): every device still out went offline"
                return "failed"
            if remaining <= 0:
                if len(st.reported) >= quorum:
                    return "deadline"
                if self.net.grace_s > 0 and not st.extended:
                    st.extended = True
                    st.deadline += self.net.grace_s
                    self.on_event("extended", {"round": st.round, "reported": len(st.reported), "quorum": quorum})
                    continue
                refused = len(st.rejected)  # a round whose every upload was refused should say so, not only "no quorum"
                st.failure = (f"no quorum by the deadline ({len(st.reported)} of {quorum} needed reported, {len(st.selected)} selected"
                              + (f"; {refused} upload(s) refused, the last: {st.rejected[-1][1][:200]}" if refused else "") + ")")
                return "failed"
            self.endpoint.pump(min(remaining, 1.0))

    def _all_gone(self, st: RoundState) -> bool:
        """Every device taking part that has not reported has been offline for
        ``offline_grace_s``: nobody is left to wait for. (A refused upload does not count: the
        device may send a good one, and a forged refusal must not end a device's round.)"""
        if len(st.offline_since) < len(st.selected) - len(st.dropped) - len(st.reported):
            return False  # someone who has not reported is online: no need to look (O(1) per message)
        waiting = [d for d in st.taking_part() if d not in st.reported]
        return all_offline_past(waiting, st.offline_since, self.clock.now(), self.net.offline_grace_s)

    def _note_stragglers(self, st: RoundState) -> None:
        """Selected devices whose work is known to be still under way when the round closed (only
        a simulated clock knows): stragglers, with their virtual time."""
        for device, (round_no, work_s) in self.clock.in_flight().items():
            if round_no == st.round and device in st.chosen and device not in st.reported:
                st.work_s[device] = work_s
                over = f"{work_s:.1f} s > {self.deadline_s:g} s deadline" if work_s is not None else "after the deadline"
                st.receipts[device] = f"dropped: straggler ({over})"

    # --- what the endpoint hands up ---------------------------------------------------------------
    def on_presence(self, device: str, online: bool, was: bool) -> None:
        st = self.state
        if st is None or device not in st.chosen or device in st.reported or device in st.dropped:
            return
        if online:
            st.offline_since.pop(device, None)
        else:
            st.offline_since.setdefault(device, self.clock.now())
        if online and not was and not st.full and device in st.downloads:
            # a device that (re)joined mid-round may have missed its download: send it again
            # (the device ignores a second copy of a round it has served)
            self.endpoint.send(device, st.downloads[device])

    def on_upload(self, device: str, env: Envelope, message: Message, size: int, facts: dict[str, Any]) -> None:
        ep = self.endpoint
        st = self.state
        current = st.round if st else self.last_round
        if message.round > current:
            if self.accept_early and message.round <= self.cfg.rounds and message.round == current + 1:
                # early: after a server restart, uploads queued in the broker can arrive before the
                # round reopens; hold one per device and use it when the round starts
                self.early[device] = (env, message, size)
                return
            ep.refuse(device, env, f"round {message.round} has not started (current {current})")
            return
        if message.round < 1:
            ep.refuse(device, env, "rounds start at 1")
            return
        if self.working.get(device, message.round + 1) <= message.round:  # its work is done (whatever the server makes of it)
            del self.working[device]
        # between rounds, an upload for the round being judged is listed late in its record
        closing = self.closing if st is None and self.closing is not None and message.round == self.closing.round else None
        closed = st is None or st.full
        if not self.spec.asynchronous and (st is None or (st.full and message.round == current)):
            # between rounds (or once the round has its target) a synchronous server must not hold
            # anything: it would count in the next round
            counted = st.accepted_ids if st is not None else closing.accepted_ids if closing is not None else \
                self.last_accepted[1] if message.round == self.last_accepted[0] else {}
            if counted.get(device) == message.message_id:
                # a second copy of the upload the round accepted (a device's resend after a server
                # restart, the broker's queued copy): that one counts, this one is no late upload
                ep.reply(device, env, "ack", status="duplicate", reason=f"round {message.round} already has this upload")
                return
            why = "is closed" if st is None else f"closed with its target of {st.target} updates"
            ep.reply(device, env, "ack", status="late", reason=f"round {message.round} {why}; not used")
            if st is not None:
                st.tally.late.append(device)
                st.receipts.setdefault(device, "late: after the round reached its target")
            elif closing is not None:
                closing.tally.late.append(device)
                closing.receipts.setdefault(device, "late: after the round closed")
            self.on_event("late", {"device": device, "round": message.round, "status": "late"})
            return
        if st is not None and message.round == current and device not in st.chosen:
            ep.refuse(device, env, f"{device} is not selected in round {current}")
            return
        if st is not None and message.round == current and device in st.dropped:
            ep.refuse(device, env, f"{device} dropped out of round {current} in stage {st.dropped[device]}; not used")
            return
        if st is not None and message.round == current and st.reported.get(device) == "accepted" \
                and message.message_id != st.accepted_ids.get(device):
            ep.refuse(device, env, f"one accepted update per device per round: {device} already has one in round {current}")
            return
        receipt_status, reason = self._server_receipt(device, message)
        if receipt_status == "rejected":
            ep.refuse(device, env, reason)
            if st is not None and message.round == current and device not in st.reported:  # its receipt says why, not "missing"
                st.receipts[device] = f"refused: {reason[:300]}"
            return
        if receipt_status == "accepted" and closed and message.round == current:
            # an asynchronous method keeps knowledge that comes after its round closed, but the
            # round's count does not change: the device hears "late"
            receipt_status, reason = "late", f"round {message.round} closed; kept for the next rounds"
        ep.reply(device, env, "ack", status=receipt_status, **({"reason": reason} if reason else {}))
        if message.meta.get("eval_accuracy") is not None and receipt_status != "duplicate":
            self.evaluator.device_reported(device, message.meta["eval_accuracy"], message.round)
        if st is None:
            if closing is not None and receipt_status != "duplicate":
                closing.tally.late.append(device)
                closing.receipts.setdefault(device, f"late: {reason}" if reason else "late")
                self.on_event("late", {"device": device, "round": message.round, "status": receipt_status})
            return
        if receipt_status == "duplicate" and message.round < current:
            return  # a replay of an upload already counted in its own round
        if message.round < current or receipt_status == "late" or closed:
            st.tally.late.append(device)
            if message.round == current:
                st.receipts.setdefault(device, f"late: {reason}" if reason else "late")
            self.on_event("late", {"device": device, "round": message.round, "status": receipt_status})
            return
        if receipt_status == "accepted" or device not in st.reported:
            st.reported[device] = receipt_status
            st.receipts[device] = receipt_status if not reason else f"{receipt_status}: {reason}"
            accepted = receipt_status == "accepted"
            if accepted:
                st.accepted_ids[device] = message.message_id
                st.accepted += 1
            st.tally.upload(device, env, message, size, accepted)
            if "work_s" in facts:
                st.work_s[device] = facts["work_s"]
            self.on_event("upload", {"device": device, "round": current, "status": receipt_status})

    def _server_receipt(self, device: str, message: Message) -> tuple[str, str]:
        for collector in self.collectors:
            try:
                taken = collector.collect(message)
            except Exception as exc:  # a filter's check that raised instead of answering: still a nack
                log.exception("filter %s raised on %s's upload", type(collector).__name__, device)
                return "rejected", f"server could not use the upload: {type(exc).__name__}: {exc}"
            if taken is not None:
                return taken.status, taken.reason
        return self._half_receipt(device, message)

    def _half_receipt(self, device: str, message: Message) -> tuple[str, str]:
        try:
            receipt = self.server.receive(message)
        except Exception as exc:  # a method's check that raised instead of answering: still a nack
            log.exception("server half raised on %s's upload", device)
            return "rejected", f"server could not use the upload: {type(exc).__name__}: {exc}"
        return receipt.status, receipt.reason

    # --- records ----------------------------------------------------------------------------------
    def _record(self, st: RoundState, outcome: str, server_record: dict[str, Any], accuracy: dict[str, Any] | None,
                clock_s: float, train_s: float, eval_s: float, wall_s: float) -> dict[str, Any]:
        missing = sorted(set(st.selected) - set(st.reported))
        unheard = "missing: the round reached its target first" if st.full else "missing: no upload by the deadline"
        receipts = {d: st.receipts.get(d, "missing: offline past network.offline_grace_s" if st.all_offline and d in st.offline_since
                                      else unheard) for d in st.selected}
        record: dict[str, Any] = {
            "round": st.round,
            "outcome": outcome,
            "selected": st.selected,
            "target": st.target,
            "accepted": st.accepted,
            "closed_unix": st.closed_unix,
            "last_accepted_unix": st.tally.last_accepted_unix,
            "reported": sorted(st.reported),
            "missing": missing,
            "extended": st.extended,
            "receipts": receipts,
            **st.tally.fields(),
            "accuracy": accuracy,
            "server": server_record,
            **timing_fields(train_s, eval_s, wall_s),
        }
        if st.stages:
            record["stages"] = st.stages
        if st.failure:
            record["failure"] = st.failure
        facts = {type(c).name: f for c in self.collectors if (f := c.round_facts(st.round))}
        if facts:
            record["filters"] = facts
        if self.clock.virtual and any(d in self.profiles for d in st.selected):
            self._clock_record(record, st, clock_s)
        return record

    def _clock_record(self, record: dict[str, Any], st: RoundState, clock_s: float) -> None:
        times = {d: (None if st.work_s.get(d) is None else round(st.work_s[d], 4)) for d in st.selected if d in self.profiles}
        stragglers = sorted(d for d in st.selected if d not in st.reported and d in st.work_s)
        by_profile: dict[str, list[float]] = {}
        for device, t in times.items():
            if t is not None:
                by_profile.setdefault(self.profiles[device], []).append(t)
        finished = [t for d, t in times.items() if t is not None and d not in stragglers]
        record.update({
            "virtual_time_s": times,
            "virtual_time_by_profile": {k: round(statistics.fmean(v), 4) for k, v in sorted(by_profile.items())},
            "stragglers": stragglers,
            "round_virtual_s": round(clock_s, 4) if stragglers else (max(finished) if finished else None),
        })

    # --- the whole run ------------------------------------------------------------------------------
    def play(self, first_round: int, after_record: AfterRecord | None, should_stop: Callable[[], bool]) -> bool:
        for r in range(first_round, self.cfg.rounds + 1):
            if should_stop():
                self.on_event("stopped", {"after_round": r - 1})
                return False
            record = self.run_round(r)
            if after_record is not None:
                after_record(record)
        return True
