"""What every round policy shares: the run's history, judging the run, waiting for devices,
and the run's end. A policy plays over a :class:`~edgefl.server.endpoint.ServerEndpoint`'s
public API only and is the endpoint's :class:`~edgefl.server.endpoint.Listener`.

Two policies exist: :class:`edgefl.server.rounds.SyncRounds` (rounds with a selection, stages,
a deadline and a quorum) and :class:`edgefl.server.asynchronous.AsyncUpdates` (no rounds: a
server update per report or buffer). :func:`edgefl.server.session.make_policy` picks one by
``mode``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from edgefl.config import RunConfig
from edgefl.messages import Message
from edgefl.methods import MethodSpec
from edgefl.server.clock import RunClock
from edgefl.server.endpoint import EventSink, Exchange, ServerEndpoint
from edgefl.server.evaluation import Evaluator
from edgefl.server.rejections import Rejections
from edgefl.transport.envelope import Envelope

AfterRecord = Callable[[dict[str, Any]], None]


def _evaluation_problem(device: str, message: Message) -> str | None:
    accuracy = message.meta.get("eval_accuracy")
    return None if accuracy is not None else "an evaluation carries meta.eval_accuracy"


class RoundPolicy(ABC):
    """Plays a run of ``server`` (the method's server half) through ``endpoint``.

    ``deadline_s`` is in ``clock``'s seconds (virtual in a simulation); ``profiles`` maps device
    ids to their device class, for the virtual clock's per-class summary."""

    #: fields the run's announcements carry for this policy (an asynchronous run says so)
    mode_info: dict[str, Any] = {}

    def __init__(self, cfg: RunConfig, spec: MethodSpec, server, endpoint: ServerEndpoint, evaluator: Evaluator,
                 clock: RunClock, *, deadline_s: float, profiles: dict[str, str] | None = None,
                 on_event: EventSink | None = None) -> None:
        self.cfg = cfg
        self.net = cfg.network
        self.spec = spec
        self.server = server
        self.endpoint = endpoint
        self.evaluator = evaluator
        self.clock = clock
        self.deadline_s = deadline_s
        self.profiles = profiles or {}
        self.on_event = on_event or (lambda kind, info: None)
        self.history: list[dict[str, Any]] = []
        self.last_round = 0  # the last round closed, or server update made (restored on resume)
        self.stopped_early = False  # should_stop ended the run before its end
        endpoint.listener = self

    # --- the endpoint's listener ------------------------------------------------------------------
    @abstractmethod
    def on_upload(self, device: str, env: Envelope, message: Message, size: int, facts: dict[str, Any]) -> None: ...

    @abstractmethod
    def on_presence(self, device: str, online: bool, was: bool) -> None: ...

    @abstractmethod
    def rejections_now(self) -> Rejections | None: ...

    # --- before the run ----------------------------------------------------------------------------
    def needed_to_start(self) -> int:
        """Devices to wait for before the run starts (every device, unless a policy starts sooner)."""
        return len(self.endpoint.device_ids)

    def wait_for_devices(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> list[str]:
        """Before the first round: announce this run (replacing the retained end of an earlier
        run of the same federation, which devices would otherwise read as "done"), then wait until
        the devices are online (their subscriptions exist, so their downloads are queued for them
        from now on) or the timeout passes; returns who is missing."""
        ep = self.endpoint
        ep.announce(self.last_round, {"selected": [], "selected_count": 0, "target": 0, "deadline_unix": time.time(),
                                      "rounds": self.cfg.rounds, "done": False, **self.mode_info})  # section 6.1, 6.8
        end = self.clock.now() + timeout_s
        waited_from = ep.transport.now()
        enough = self.needed_to_start()
        while self.clock.now() < end and ep.joined() < enough and not should_stop():
            ep.pump(min(end - self.clock.now(), 0.5))
        # a device never heard from in the wait is offline since it began (it had no presence to say so)
        ep.mark_absent(ep.device_ids, waited_from)
        if ep.enrolment is not None:
            ready = set(ep.ready_online())  # a resumed run's enrolment says who was ready: they count once back online
            missing = [d for d in ep.device_ids if d not in ready]
            declined = ep.enrolment.declined()
            self.on_event("joined", {"online": len(ready), "missing": [d for d in missing if d not in declined], "declined": declined})
            return missing
        missing = [d for d in ep.device_ids if not ep.is_online(d)]
        self.on_event("joined", {"online": len(ep.device_ids) - len(missing), "missing": missing})
        return missing

    # --- judging the run ---------------------------------------------------------------------------
    def evaluate(self, r: int, current_from: int | None = None) -> dict[str, Any] | None:
        """Accuracy after round (or update) ``r``: global models judged here where the server
        can; devices asked to judge the global model on their own data where it cannot (their own
        test split or feature space); otherwise the accuracies devices reported with their uploads."""
        targets = self.evaluator.personal_targets(self.server)
        if self.endpoint.enrolment is not None:  # only devices that are ready can answer
            ready = set(self.endpoint.enrolment.ready())
            targets = [t for t in targets if t in ready]
        answers = self.ask_devices(r, targets) if targets else {}
        return self.evaluator.evaluate(self.server, answers, r, current_from)

    def judge_idle(self, r: int, busy: set[str] | dict[str, Any]) -> None:
        """Ask every online judged device not in ``busy`` for the accuracy of the model it holds
        (an ``evaluate`` with no body: nothing is loaded); answers count as its latest reported
        accuracy. A busy device keeps its last value: a real one would answer only after its work."""
        ep = self.endpoint
        idle = [d for d in ep.device_ids if d not in busy and d in self.evaluator.judged and ep.can_take_part(d)]
        if idle:
            for device, accuracy in self.ask_devices(r, idle, with_model=False).items():
                self.evaluator.device_reported(device, accuracy, r)

    def ask_devices(self, r: int, targets: list[str], with_model: bool = True) -> dict[str, float]:
        """Send ``targets`` an evaluate request (carrying what a download of round r + 1 would,
        or nothing: judge the model you hold) and collect their accuracies until the deadline."""
        messages = {d: self.server.downlink(r + 1, d) for d in targets} if with_model else {}
        replies = self.endpoint.request(Exchange("evaluate", r, frozenset(targets), _evaluation_problem), "evaluate", messages, {},
                                        self.deadline_s)
        return {device: float(m.meta["eval_accuracy"]) for device, m in replies.items()}

    # --- the whole run -----------------------------------------------------------------------------
    @abstractmethod
    def play(self, first_round: int, after_record: AfterRecord | None, should_stop: Callable[[], bool]) -> bool:
        """Play the run from ``first_round``; True when it ran to its end (False: ``should_stop``)."""

    def run(self, first_round: int = 1, after_record: AfterRecord | None = None,
            should_stop: Callable[[], bool] = lambda: False) -> list[dict[str, Any]]:
        """Play the run (``after_record``: called with each record, to write it and save the
        state), then announce that it is done. ``should_stop`` is asked between rounds: a stopped
        run is not announced as done (it can be resumed)."""
        if not self.play(first_round, after_record, should_stop):
            self.stopped_early = True
            return self.history
        if not self.clock.virtual:
            # answer what is still arriving (late) before announcing the end: over-selected devices
            # of the last round report after it closed (a simulation has nothing in flight that is not queued)
            self.endpoint.drain()
        self.endpoint.announce(self.last_round, {"done": True, "rounds": self.cfg.rounds, **self.mode_info})
        return self.history
