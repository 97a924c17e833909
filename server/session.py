"""One run of a config over one transport: the server half, the round loop, and everything the
run leaves in its directory (config, run.json, partition, metrics, state, summary, models).

The simulation and ``edgefl server`` both run a :class:`RunSession`; they differ only in the
transport they hand it and the name they give the runner.
"""

from __future__ import annotations

import hashlib
import json
import math
import logging
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import tomli_w

from edgefl.build import DeviceSlot, RunParts, held_out_indices, model_meta, partition_record
from edgefl.compute import resolve_device
from edgefl.config import RunConfig
from edgefl.data import Dataset, class_counts
from edgefl.environment import machine, package_versions, source_commit
from edgefl.errors import ConfigError, EdgeflError
from edgefl.methods import get_method
from edgefl.plugins import loaded_plugins
from edgefl.models import get_spec
from edgefl.report import draw_plots, privacy_sources
from edgefl.rundir import RunDir
from edgefl.server.enrolment import Enrolment
from edgefl.server.evaluation import Evaluator
from edgefl.server.live import LiveState
from edgefl.server.methods import ClientInfo
from edgefl.filters import Filter, build_chain
from edgefl.server.asynchronous import AsyncUpdates
from edgefl.server.clock import RunClock, TransportClock
from edgefl.server.endpoint import EventSink, ServerEndpoint
from edgefl.server.policy import RoundPolicy
from edgefl.server.records import DPSGDLedger
from edgefl.server.rejections import Rejections
from edgefl.server.rounds import SyncRounds
from edgefl.server.shipping import safe_name, write_ship_plan
from edgefl.server.state import load_state, save_state
from edgefl.tracking import Trackers
from edgefl.transport.base import ServerTransport

log = logging.getLogger("edgefl.server")

#: a simulation's devices' states at its last checkpoint (edgefl.sim.engine.Simulation)
DEVICES_FILE = "devices-state.safetensors"
STATE_FILE = "server-state.safetensors"
#: record fields that depend on the machine and the moment, not on the run's numbers
TIMING_FIELDS = ("round_time_s", "train_time_s", "eval_time_s", "elapsed_s", "closed_unix", "last_accepted_unix")  # wall clock: differs run to run


def _group_index(cfg: RunConfig, group: Any) -> int:
    """``group``'s place in ``fleet.groups`` (0 for a run's single default group)."""
    groups = cfg.fleet.groups
    return next((i for i, g in enumerate(groups) if g is group), groups.index(group) if group in groups else 0)


def _schedule(train: Any) -> tuple:
    """What decides a group's learning rate in every round."""
    return (train.lr, tuple(train.lr_milestones), train.lr_gamma)


def _digest(raw: dict[str, Any]) -> str:
    return hashlib.sha256(tomli_w.dumps(raw).encode()).hexdigest()


#: settings a resume may change: they change none of the run's numbers (how often it checkpoints)
RESUME_MAY_CHANGE = (("simulation", "checkpoint_every"),)


def _without_resume_changes(raw: dict[str, Any]) -> dict[str, Any]:
    for table, key in RESUME_MAY_CHANGE:
        raw.get(table, {}).pop(key, None)
    return raw


def config_digest(cfg: RunConfig) -> str:
    """What a checkpoint must be resumed with: the config, less what a resume may change."""
    return _digest(_without_resume_changes(cfg.to_dict()))


#: settings added since checkpoints were first written, oldest first, each with the value that
#: gives an older run's numbers. A new setting with a default goes here (tests/test_resume_compat.py
#: says so): without it the digest of every older checkpoint changes and their resumes are refused.
ADDED_SINCE: dict[tuple[str, str], Any] = {("eval", "unselected"): "last_reported"}


def legacy_digests(cfg: RunConfig) -> dict[str, list[tuple[str, str]]]:
    """What a checkpoint written by an older edgefl carries for this config, each with the settings
    that checkpoint predates: the config without the settings added since each step of ADDED_SINCE,
    whole (older versions digested checkpoint_every too) and less what a resume may change."""
    added = list(ADDED_SINCE)
    digests: dict[str, list[tuple[str, str]]] = {}
    for since in range(len(added)):
        raw = cfg.to_dict()
        for table, key in added[since:]:
            raw.get(table, {}).pop(key, None)
        digests.setdefault(_digest(raw), added[since:])
        digests.setdefault(_digest(_without_resume_changes(raw)), added[since:])
    return digests


class RunSession:
    def __init__(self, parts: RunParts, transport: ServerTransport | None, federation: str, *, runner: str,
                 run_dir: RunDir | None = None, deadline_s: float, on_event: EventSink | None = None,
                 save_state_each_round: bool = False, start_facts: dict[str, Any] | None = None,
                 clock: RunClock | None = None) -> None:
        """``clock``: the run's clock (the simulation's virtual one); None: the transport's."""
        cfg = parts.cfg
        self.cfg, self.parts, self.run_dir = cfg, parts, run_dir
        self.spec = get_method(cfg.method.name)
        self.server = build_server(cfg, parts.ds, parts.slots)
        self.save_state_each_round = save_state_each_round
        #: a simulation's checkpoints: every N rounds and when stopped (0: none), with its devices' states saved by
        #: save_devices(path, round) before the server's (whose round marks the checkpoint complete)
        self.checkpoint_every = 0
        self.save_devices: Callable[[Path, int], None] | None = None
        self._saved_round = 0
        #: names one checkpoint in both its files (an asynchronous run may save two at one server version)
        self.checkpoint_tag = ""
        self.resumed_tag = ""  # the tag of the checkpoint resume() read
        self.resumed = False
        self._history_kept: list[dict[str, Any]] | None = None  # metrics.jsonl as resumed, written when the run goes on
        archs = {s.client_id: s.arch for s in parts.slots}
        judged = {s.client_id for s in parts.slots if get_spec(s.model).kind == "classifier"}
        held = cfg.data.device_held  # devices bring their own data: each judges on the share it holds out
        personal = {s.client_id for s in parts.slots if held or s.test_indices is not None or s.view is not None}
        self.evaluator = Evaluator(parts.x_test, parts.y_test, cfg.eval.batch_size, archs, judged, personal, held_by_devices=held)
        self.enrolment = Enrolment(parts, federation) if held else None
        profiles = {s.client_id: s.profile.id for s in parts.slots if s.profile is not None}
        self.live = None
        if run_dir is not None:  # what the dashboard shows while the run goes on
            facts = {s.client_id: {"arch": s.arch, "profile": s.profile.id if s.profile else None,
                                   "judged": s.client_id in judged, "samples": int(len(s.sample_indices))} for s in parts.slots}
            self.live = LiveState(run_dir.path, facts, cfg.rounds, lambda n: cfg.network.quorum_count(cfg.fleet.target(n)), runner)
        events = self._events(on_event)
        self.filters: list[Filter] = build_chain(cfg.filter_chain(), "server", cfg.seed)
        # a partial upload that is not complete by its round's deadline cannot count in that round: dropped then (without
        # rounds, an asynchronous run keeps it as long as the stale nacks would); network.partial_max_age_s overrides both
        net = cfg.network
        age = net.partial_max_age_s or (max(deadline_s, net.stale_upload_s) if cfg.mode == "sync" else net.partial_age_limit_s())
        self.endpoint = ServerEndpoint(net, self.spec, transport, parts.device_ids, federation,
                                       num_classes=getattr(self.server, "num_classes", None), max_epochs=cfg.max_epochs(),
                                       partial_max_age_s=age, filters=self.filters, on_event=events, enrolment=self.enrolment)
        groups = summing_groups(self.spec, parts.slots)
        n = len(parts.device_ids)
        selected = cfg.fleet.selection_size(n) if n else 0
        expected = {g: max(1, math.ceil(list(groups.values()).count(g) * selected / n)) for g in set(groups.values())} if n else {}
        for f in self.filters:
            f.prepare({"groups": groups, "seed": cfg.seed, "federation": federation, "num_classes": getattr(self.server, "num_classes", None),
                       "rounds": cfg.rounds, "sample_rate": selected / n if n else 1.0, "expected_per_group": expected})
        self.policy: RoundPolicy = make_policy(cfg, self.spec, self.server, self.endpoint, self.evaluator,
                                               clock or _LateTransportClock(self.endpoint), deadline_s=deadline_s, profiles=profiles,
                                               on_event=events, stages=[s for f in self.filters for s in f.server_stages()] + self.server.stages(),
                                               collectors=self.filters)
        self.start = self._start_record(runner, federation, start_facts or {})
        self.trackers = Trackers(cfg, None)  # opened when the rounds start (run)
        #: each device's weights, where this process holds them (a simulation sets it): what ship.json picks from
        self.device_models: Callable[[], dict[str, dict[str, Any]]] | None = None
        self._t0 = time.perf_counter()
        self._elapsed_before = 0.0  # a resumed run's earlier sittings (resume())
        deltas = [t.dp_sgd.delta for t in [cfg.train, *(g.train for g in cfg.fleet.groups)] if t is not None and t.dp_sgd is not None]
        #: devices' DP-SGD epsilons over the run (their uploads say it), at the weakest delta configured
        self.dp_sgd = DPSGDLedger(max(deltas)) if deltas else None
        #: each architecture's training settings, where a learning-rate schedule is set: its records say the rate
        trains = {(slot.arch, _group_index(cfg, slot.group)): cfg.train_for(slot.group) for slot in parts.slots}
        self._schedules = trains if any(t.lr_milestones for t in trains.values()) else {}
        #: groups train on schedules of their own: every record names each group's rate, also in rounds where they agree
        self._rate_per_group = len({_schedule(t) for t in self._schedules.values()}) > 1
        #: each (architecture, group)'s key in a record: the architecture, or, where groups of one architecture train on
        #: different schedules, the group too (decided once, so a key never changes between rounds)
        schedules_of: dict[str, set[tuple]] = {}
        for (arch, _), train in self._schedules.items():
            schedules_of.setdefault(arch, set()).add(_schedule(train))
        self._rate_keys = {(arch, group): arch if len(schedules_of[arch]) == 1 else f"{arch} (fleet.groups[{group}])"
                           for arch, group in self._schedules}

    def _events(self, sink: EventSink | None) -> EventSink:
        def on_event(kind: str, info: dict[str, Any]) -> None:
            if kind in ("enrolled", "declined"):
                self._write_enrolment()
            if kind == "closed" and self._schedules:  # every record is closed here first: the record, and the console's line, say the rate
                info["lr"] = self.learning_rates(info["round"])
            if self.live is not None:
                self.live.on_event(kind, info)
            if sink is not None:
                sink(kind, info)
        return on_event

    def _start_record(self, runner: str, federation: str, facts: dict[str, Any]) -> dict[str, Any]:
        ds, cfg = self.parts.ds, self.cfg
        return {
            "name": cfg.name, "method": cfg.method.name, "seed": cfg.seed, "runner": runner, "federation": federation,
            "dataset": {"name": ds.name, "source": ds.source, "files": list(ds.files), "train": len(ds.y_train),
                        "test_used": len(self.parts.y_test)},
            "versions": package_versions(), "edgefl_commit": source_commit(), "machine": machine(), "deadline_s": self.policy.deadline_s,
            "compute_device": str(resolve_device(cfg.device)),  # where this process's halves compute
            "device_profiles": {s.profile.id: s.profile.to_dict() for s in self.parts.slots if s.profile is not None},
            **({"filters": [f.describe() for f in self.filters]} if self.filters else {}),
            **({"plugins": plugins} if (plugins := loaded_plugins()) else {}),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **facts,
        }

    # --- start ----------------------------------------------------------------------------------
    def write_start(self) -> None:
        if self.run_dir is None:
            return
        (self.run_dir.path / "config.toml").write_text(self.cfg.to_toml())
        self.run_dir.write_json("run.json", self.start)
        if self.enrolment is not None:
            self._write_enrolment()
        else:
            self.run_dir.write_json("partition.json", partition_record(self.parts.ds, self.parts.slots))

    def _validation_counts(self) -> dict[str, int] | None:
        """Each ready device's validation count as it enrolled (devices that hold their data), for ship.json."""
        if self.enrolment is None:
            return None
        return {device: known.validation for device, known in self.enrolment.devices.items() if known.stage == "ready"}

    def _write_enrolment(self) -> None:
        """Devices that bring their own data: what each said it holds (partition.json) as it joins."""
        if self.run_dir is None or self.enrolment is None:
            return
        record = partition_record(self.parts.ds, self.parts.slots)
        record["held_by_devices"] = True
        for client in record["clients"]:
            known = self.enrolment.devices.get(client["client_id"])
            if known is not None:
                client.update(num_samples=known.samples, num_test=known.validation, stage=known.stage,
                              class_counts=known.class_counts or client["class_counts"], **({"reason": known.reason} if known.reason else {}))
            else:
                client["stage"] = "not joined"
        self.run_dir.write_json("partition.json", record)

    def _no_checkpoint(self) -> ConfigError:
        """Why there is nothing to resume: not a run, or a run that recorded rounds (or finished)
        before its first checkpoint."""
        recorded = self.run_dir.recorded_rounds() if self.run_dir is not None else 0
        if not recorded:
            return ConfigError("nothing to resume: the run directory holds no server state",
                               hint="pass the --out folder of the interrupted run, or drop --resume")
        every = _saved_checkpoint_every(self.run_dir.path, self.cfg.simulation.checkpoint_every)  # the run's, not the command's
        when = (f"it checkpointed every {every} {'records' if self.cfg.mode == 'async' else 'rounds'} "
                "(simulation.checkpoint_every)" if every else "its simulation.checkpoint_every was 0")
        if self.run_dir.finished():
            return ConfigError(f"nothing to resume: this run finished after {recorded} records without a checkpoint ({when}); "
                               "its results stay as they are", hint="to play it again, start it with another --out")
        return ConfigError(f"nothing to resume: this run stopped after {recorded} records, before its first checkpoint ({when})",
                           hint="start it again with another --out (this folder keeps what it recorded); "
                                "a lower simulation.checkpoint_every saves sooner")

    def resume(self) -> int:
        """Restore the server half and the metrics from the run directory (before any connection
        is made); returns the first round still to play."""
        asynchronous = self.cfg.mode == "async"
        if asynchronous and self.save_devices is None:
            raise ConfigError("an asynchronous fleet server cannot be resumed (its devices' work in flight is not saved; "
                              "an asynchronous simulation can: edgefl simulate --resume)",
                              hint="start it again; asynchronous.time_budget_s or a lower rounds keeps runs short")
        if self.run_dir is None or not (self.run_dir.path / STATE_FILE).is_file():
            raise self._no_checkpoint()
        extra = load_state(self.server, self.run_dir.path / STATE_FILE)
        saved_digest = extra.get("config_sha256")
        legacy = legacy_digests(self.cfg)
        if saved_digest != config_digest(self.cfg) and saved_digest in legacy:
            for table, key in legacy[saved_digest]:  # the older run's numbers go on as they were
                older = ADDED_SINCE[(table, key)]
                if getattr(getattr(self.cfg, table), key) != older:
                    log.warning("the checkpoint predates %s.%s: the run goes on with %r, as it began", table, key, older)
                    setattr(getattr(self.cfg, table), key, older)
        elif saved_digest != config_digest(self.cfg):
            raise ConfigError(f"the saved server state belongs to another config{config_changes(self.cfg, self.run_dir.path)}",
                              hint="resume with the interrupted run's config.toml and no --set that changes it")
        if asynchronous and not isinstance(extra.get("carried"), dict):
            raise ConfigError("the saved server state holds no asynchronous run's work out (saved by an older edgefl?)",
                              hint="start the run again")
        done = int(extra["round"])
        metrics = self.run_dir.path / "metrics.jsonl"
        lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
        # a record written after the state was saved is dropped (and played again); an
        # asynchronous checkpoint counts its records (it may be taken some updates after one)
        history = lines[:int(extra["records"])] if asynchronous else [h for h in lines if h["round"] <= done]
        # written when the run goes on (run()): a resume refused after this leaves the records as they were
        self._history_kept = history if len(lines) != len(history) else None
        self.resumed_tag = str(extra.get("tag", ""))
        self.resumed = True
        # the earlier sittings' time, up to the last round kept: wall_time_s and elapsed_s go on from it
        last = history[-1].get("elapsed_s") if history else None
        self._elapsed_before = float(last) if isinstance(last, (int, float)) and not isinstance(last, bool) \
            and 0 <= last < 1e9 else 0.0
        self.evaluator.device_accuracy = dict(extra.get("device_accuracy") or {})
        self.evaluator.reported_at = dict(extra.get("device_accuracy_at") or {})  # absent from older checkpoints
        self.endpoint.rejections = Rejections.from_saved(extra.get("rejections"))  # the run's count goes on from the checkpoint's
        policy = self.policy
        policy.history = history
        if self.dp_sgd is not None:
            self.dp_sgd.restore(history)
        if isinstance(policy, AsyncUpdates):
            try:
                policy.restore(extra["carried"])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ConfigError(f"the saved server state's asynchronous part cannot be read ({type(exc).__name__}: {exc}); "
                                  "it was written by another edgefl or damaged", hint="start the run again") from None
        else:
            assert isinstance(policy, SyncRounds)
            working = extra.get("working")  # devices whose download was not answered yet: not asked to judge their models
            known = set(self.endpoint.device_ids)
            policy.working = {d: r for d, r in working.items() if d in known and type(r) is int and 0 < r <= done} \
                if isinstance(working, dict) else {}
            policy.last_round = self.endpoint.model_version = done
            policy.accept_early = True  # uploads devices queued while the server was down
        if isinstance(extra.get("run_id"), str):
            self.endpoint.run_id = extra["run_id"]
        if self.enrolment is not None:
            self.enrolment.restore(extra.get("enrolled"))
        saved_filters = extra.get("filters") or {}
        for f in self.filters:  # a privacy filter's releases: without them its epsilon would restart at 0
            if f.name in saved_filters:
                f.load_server_state(saved_filters[f.name])
            elif f.server_state():
                raise ConfigError(f"the saved server state holds nothing of filter {f.name!r}, whose accounting must go on",
                                  hint="resume with the interrupted run's config.toml (its [[filters]] unchanged)")
        return done + 1

    # --- rounds ---------------------------------------------------------------------------------
    def after_round(self, record: dict[str, Any]) -> None:
        record["elapsed_s"] = round(self._elapsed_before + time.perf_counter() - self._t0, 3)
        if self.dp_sgd is not None:
            self.dp_sgd.note(record)
        if self.run_dir is None:
            return
        self.run_dir.append_metrics(record)
        self.trackers.log_round(record)
        every = self.checkpoint_every
        if self.cfg.mode == "sync" and (self.save_state_each_round or (every and record["round"] % every == 0)):
            # a restarted server (or simulation) resumes where this one stopped
            self.save_checkpoint(record["round"])

    def learning_rates(self, round_no: int) -> float | dict[str, float]:
        """The learning rate round ``round_no`` trained with (``train.lr_milestones``): one number
        when every group trains on one schedule, else each architecture's (each group's, where two
        groups of one architecture differ), in every round, so a curve per architecture is whole."""
        rates = {self._rate_keys[key]: train.lr_at(round_no, self.cfg.rounds) for key, train in sorted(self._schedules.items())}
        return dict(sorted(rates.items())) if self._rate_per_group else next(iter(rates.values()))

    def save_checkpoint(self, round_no: int) -> None:
        """The server's state after ``round_no`` (and, in a simulation, its devices' first). An
        asynchronous run's checkpoint (taken by its policy when nothing is half-done, see
        :meth:`AsyncUpdates.quiescent`) also holds the policy's work out and its records' count."""
        policy = self.policy
        asynchronous = isinstance(policy, AsyncUpdates)
        if self.run_dir is None or (round_no == self._saved_round and not asynchronous):
            return
        self.checkpoint_tag = f"{round_no}:{len(policy.history)}:{policy.counter}" if asynchronous else str(round_no)
        if self.save_devices is not None:
            self.save_devices(self.run_dir.path / DEVICES_FILE, round_no)
        save_state(self.server, self.run_dir.path / STATE_FILE,
                   {"round": round_no, "tag": self.checkpoint_tag, "config_sha256": config_digest(self.cfg), "run_id": self.endpoint.run_id,
                    "device_accuracy": self.evaluator.device_accuracy, "device_accuracy_at": self.evaluator.reported_at,
                    "rejections": self.endpoint.rejections.saved(),
                    **({"records": len(policy.history)} if asynchronous else {"working": dict(policy.working)}),
                    **({"filters": filters} if (filters := {f.name: st for f in self.filters if (st := f.server_state())}) else {}),
                    **({"enrolled": self.enrolment.snapshot()} if self.enrolment is not None else {})},
                   carried=policy.state() if isinstance(policy, AsyncUpdates) else None)
        self._saved_round = round_no

    def run(self, first_round: int = 1, on_record: Callable[[dict[str, Any]], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Play the rounds and finish; a KeyboardInterrupt (a second Ctrl-C), or any failure of the
        loop itself, still writes what was done (models, state, summary) before it goes on up."""
        def after(record: dict[str, Any]) -> None:
            self.after_round(record)
            if on_record is not None:
                on_record(record)

        if self._history_kept is not None and self.run_dir is not None:  # records after the resumed checkpoint: played again
            (self.run_dir.path / "metrics.jsonl").write_text("".join(json.dumps(h, sort_keys=True) + "\n" for h in self._history_kept))
            self._history_kept = None
        if self.resumed and self.run_dir is not None:  # a resume may change checkpoint_every: the next one reads it
            before = _saved_setting(self.run_dir.path, "simulation", "checkpoint_every")
            (self.run_dir.path / "config.toml").write_text(self.cfg.to_toml())
            if before is not None and before != self.cfg.simulation.checkpoint_every:
                log.warning("the resumed run takes simulation.checkpoint_every = %d (it was %s); config.toml says so now",
                            self.cfg.simulation.checkpoint_every, before)
        self.trackers = Trackers(self.cfg, self.run_dir.path if self.run_dir else None)
        if isinstance(self.policy, AsyncUpdates) and self.checkpoint_every and self.run_dir is not None:
            policy = self.policy
            policy.checkpoint_every = self.checkpoint_every  # records between checkpoints
            policy.checkpoint = lambda: self.save_checkpoint(policy.version)
        try:
            self.policy.run(first_round, after, should_stop)
            if self.checkpoint_every and self.policy.stopped_early and self.cfg.mode == "sync" and self.policy.history:
                self.save_checkpoint(self.policy.history[-1]["round"])  # stopped: resumable from the last round played
        except KeyboardInterrupt:
            self.finish(interrupted=True)
            raise
        except Exception as exc:  # a bug, a full disk: the rounds played are still worth their files
            if not isinstance(exc, EdgeflError):  # an EdgeflError explains itself and the caller prints it (once)
                log.exception("the run stopped: %s", type(exc).__name__)
            try:
                self.finish(interrupted=True)
            except Exception:
                log.exception("could not write the run's results either")
            raise
        return self.finish(interrupted=self.policy.stopped_early)

    # --- end ------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        history = self.policy.history
        evaluated = [h for h in history if h["accuracy"] is not None and h["accuracy"]["overall"] is not None]
        virtual = [h.get("round_virtual_s") for h in history if h.get("round_virtual_s") is not None]
        return {
            **self.start,
            "rounds": self.cfg.rounds,
            "final_accuracy": evaluated[-1]["accuracy"] if evaluated else None,
            "best_overall_accuracy": max((h["accuracy"]["overall"] for h in evaluated), default=None),
            "failed_rounds": [h["round"] for h in history if h["outcome"] == "failed"],
            "rejections": self.endpoint.rejections.summary(),
            "bytes_up_total": sum(h["bytes_up"] for h in history),
            "bytes_down_total": sum(h["bytes_down"] for h in history),
            "stragglers_total": sum(len(h.get("stragglers", [])) for h in history),
            "virtual_time_total_s": round(sum(virtual), 3) if virtual else None,
            **({"privacy": privacy} if (privacy := privacy_spent(history)) else {}),
            "wall_time_s": round(self._elapsed_before + time.perf_counter() - self._t0, 3),  # every sitting's
            "run_dir": str(self.run_dir.path) if self.run_dir else None,
        }

    def finish(self, interrupted: bool = False) -> dict[str, Any]:
        """The run's end, also after an interruption: models, summary, plots, trackers closed."""
        summary = self.summary()
        summary["rounds_played"] = len(self.policy.history)
        summary["interrupted"] = interrupted
        if self.run_dir is not None:
            save_global_models(self.run_dir, self.server, self.cfg, self.parts.ds, self.parts.slots)
            try:
                models = self.device_models() if self.device_models is not None else None
                summary["ship"] = write_ship_plan(self.run_dir, self.cfg, self.parts.ds, self.parts.slots, self.server,
                                                  self.evaluator.device_accuracy, models, run_id=self.endpoint.run_id,
                                                  arch_accuracy=(summary.get("final_accuracy") or {}).get("per_arch"),
                                                  shared_test_samples=len(self.parts.y_test) if self.parts.y_test is not None else None,
                                                  validation_samples=self._validation_counts())
            except Exception:  # the plan is advice: a failure must not lose the run's other results
                log.exception("could not write ship.json")
            self.run_dir.write_json("summary.json", summary)
            if (self.run_dir.path / "metrics.jsonl").is_file() and self.run_dir.metrics():  # none when stopped before round 1
                try:
                    draw_plots(self.run_dir)
                except EdgeflError as exc:  # matplotlib missing (a lean server install): the numbers are saved
                    log.warning("no plots: %s", exc.message)
        self.trackers.finish(summary, interrupted)
        if self.live is not None:
            self.live.finish(interrupted)
        return summary


def _saved_setting(run_dir: Path, table: str, key: str) -> Any:
    """One setting of the run directory's config.toml (None when it cannot be read or lacks it)."""
    from edgefl.configtools import tomllib

    try:
        node = tomllib.loads((run_dir / "config.toml").read_text()).get(table)
    except (OSError, ValueError):
        return None
    return node.get(key) if isinstance(node, dict) else None


def _saved_checkpoint_every(run_dir: Path, default: int) -> int:
    """The interval the run in ``run_dir`` checkpointed at (its config.toml), else ``default``."""
    from edgefl.configtools import tomllib

    try:
        every = tomllib.loads((run_dir / "config.toml").read_text()).get("simulation", {}).get("checkpoint_every", default)
    except (OSError, ValueError, AttributeError):
        return default
    return every if isinstance(every, int) and not isinstance(every, bool) else default


def config_changes(cfg: RunConfig, run_dir: Path) -> str:
    """``: rounds 3 -> 4, ...`` against the run directory's config.toml, when it can be read ("" when
    only what a resume may change differs)."""
    from edgefl.configtools import config_differences, tomllib

    try:
        saved = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, ValueError):
        return ""
    shown = lambda value: "(unset)" if value is None else value  # noqa: E731  (TOML has no null: None is a missing key)
    changed = [f"{k} {shown(a)!r} -> {shown(b)!r}" for k, a, b in config_differences(saved, tomllib.loads(cfg.to_toml()))
               if tuple(k.split(".", 1)) not in RESUME_MAY_CHANGE]
    return f": {', '.join(changed[:5])}" + (" ..." if len(changed) > 5 else "") if changed else ""


def privacy_spent(history: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run's differential-privacy filters report after its last round (the epsilon spent)."""
    for record in reversed(history):
        facts = {name: f for name, f in privacy_sources(record).items() if isinstance(f, dict) and ("epsilon" in f or "epsilon_max" in f)}
        if facts:
            return facts
    return {}


class _LateTransportClock(TransportClock):
    """The transport's clock for a server that connects after it is built (``edgefl server``
    restores its state first)."""

    def __init__(self, endpoint: ServerEndpoint) -> None:
        self.endpoint = endpoint

    def now(self) -> float:
        return self.endpoint.transport.now()


def make_policy(cfg: RunConfig, spec, server, endpoint: ServerEndpoint, evaluator: Evaluator, clock: RunClock, *,
                deadline_s: float, profiles: dict[str, str], on_event: EventSink, stages: list,
                collectors: list | None = None) -> RoundPolicy:
    """The round policy of ``cfg.mode``: synchronous rounds (with their stages), or asynchronous updates."""
    if cfg.mode == "async":
        if stages:
            names = ", ".join(sorted({s.name for s in stages}))
            raise ConfigError(f"stages ({names}) run within a round: an asynchronous run has none",
                              hint='use mode = "sync" with this filter or method')
        return AsyncUpdates(cfg, spec, server, endpoint, evaluator, clock, deadline_s=deadline_s, profiles=profiles, on_event=on_event,
                            collectors=collectors)
    return SyncRounds(cfg, spec, server, endpoint, evaluator, clock, deadline_s=deadline_s, profiles=profiles, on_event=on_event,
                      stages=stages, collectors=collectors)


def summing_groups(spec, slots: list[DeviceSlot]) -> dict[str, str]:
    """device -> the group whose uploads a server sums together: an architecture for methods that
    share weights (FedAvg, Felo: averaged within same-architecture groups), one group otherwise."""
    if "weights" in spec.uploads or "class_features" in spec.uploads:  # Felo averages its weights per architecture too
        return {s.client_id: s.arch for s in slots}
    return {s.client_id: "all" for s in slots}


def build_server(cfg: RunConfig, ds: Dataset, slots: list[DeviceSlot]):
    """The method's server half for these devices (what it knows of each: architecture, data sizes)."""
    method = get_method(cfg.method.name)
    counts = class_counts(ds.y_train.numpy(), [s.sample_indices for s in slots], ds.num_classes)
    infos = [
        ClientInfo(s.client_id, s.arch, s.model, dict(s.model_options), int(len(s.sample_indices)),
                   tuple(counts[k].tolist()), tuple(s.input_shape(ds)))
        for k, s in enumerate(slots)
    ]
    if method.one_shot and cfg.rounds != 1:
        raise ConfigError(f"{cfg.method.name} is one-shot: a run has exactly one round (rounds = {cfg.rounds})", hint="set rounds = 1")
    return method.server_class()(
        infos, method.parse_options(cfg.method.options()), seed=cfg.seed, num_classes=ds.num_classes, input_shape=ds.input_shape,
        dataset=ds.name, device=cfg.device,
    )


def save_global_models(run_dir: RunDir, server, cfg: RunConfig, ds: Dataset, slots: list | None = None) -> dict[str, Any]:
    """Write the server's global models and its artifacts (FedMHO's sample grid) into the run
    directory. Returns the global models written."""
    globals_ = server.global_models()
    held_out = held_out_indices(cfg, slots or [])
    for arch, state in globals_.items():
        model, options, shape = server.global_spec(arch)
        meta = {**model_meta(cfg, ds), "arch": arch, "model": model, "model_options": options, "scope": "global",
                "input_shape": list(shape), **({"held_out_indices": held_out} if held_out else {})}
        run_dir.save_model(f"global-{safe_name(arch)}", state, meta)
    server.write_artifacts(run_dir.path)
    return globals_
