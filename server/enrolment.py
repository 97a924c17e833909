"""Devices that bring their own data join a run: the server sends each its task and learns what
it holds (``data.partition = "devices"``; docs/your-data.md, docs/PROTOCOL.md section 6.9).

A ``join`` envelope from a device carries ``info.stage``:

* ``hello`` (optionally with the device's ``profile``, in the catalog schema): the server answers
  with a ``task`` envelope (:class:`edgefl.task.Task` in ``info.task``) or a nack with the reason
  (a device whose profile cannot hold the model it would train);
* ``ready``: the device read its data against the task; it reports its sample and class counts
  and how many samples it holds out for validation. Acknowledged; from now on it can be selected;
* ``decline``: the device cannot take part (a class the federation does not know, no samples...);
  the reason is recorded and shown like any refusal, and the run goes on without it.

Every field is bounded and checked; nothing a device says here can stop the server.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from edgefl.build import DeviceSlot, RunParts, group_budgets
from edgefl.config import RunConfig
from edgefl.task import Task, TaskData, TaskFilter, TaskMethod, TaskModel

#: what a device may report in ``ready`` (bounded: it comes over the network)
MAX_SAMPLES = 1 << 40
MAX_TEXT = 500


def data_spec_of(cfg: RunConfig, parts: RunParts, slot: DeviceSlot) -> TaskData:
    """What the device's samples must be, from the data set that names the run's task."""
    ds = parts.ds
    shape = list(slot.input_shape(ds))
    image = len(shape) == 3
    divisor = None
    if image:  # the zoo's image inputs are pixels scaled to [0, 1]: 8-bit sets by 255, scikit-learn's digits by 16
        divisor = 16.0 if ds.name == "digits" else 255.0
    mean, std = (list(ds.standardisation[0]), list(ds.standardisation[1])) if ds.standardisation else (None, None)
    # a table whose columns the data set names: a device reads its CSV by them, not by position (a
    # table with its columns in another order would otherwise train on the wrong features, silently)
    names = list(ds.feature_names) if not image and ds.feature_names and [len(ds.feature_names)] == shape else None
    return TaskData(kind="image" if image else "tabular", class_names=list(ds.class_names), input_shape=shape, pixel_divisor=divisor,
                    mean=mean, std=std, feature_names=names, label_column=cfg.data.label_column, resize=cfg.data.resize,
                    validation_fraction=cfg.data.validation_fraction)


def task_for(cfg: RunConfig, parts: RunParts, slot: DeviceSlot, run_id: str, federation: str) -> Task:
    """The task of one device: everything it needs to build its client half from its own data."""
    return Task(
        run=run_id, federation=federation, device=slot.client_id, seed=cfg.seed, rounds=cfg.rounds, mode=cfg.mode,
        method=TaskMethod(name=cfg.method.name, options=cfg.method.options()),
        model=TaskModel(name=slot.model, options=dict(slot.model_options), arch=slot.arch),
        data=data_spec_of(cfg, parts, slot), train=cfg.train_for(slot.group), network=cfg.network,
        eval_batch_size=cfg.eval.batch_size, threads=cfg.threads, compute=cfg.device,
        filters=[TaskFilter(name=name, options=options) for name, options in cfg.filter_chain()],
    )


@dataclass
class Enrolled:
    """What the server knows of one device that brings its own data."""

    stage: str  # "task sent" | "ready" | "declined"
    samples: int = 0
    validation: int = 0
    class_counts: list[int] = field(default_factory=list)
    source: str = ""
    reason: str = ""
    profile: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in ("", None)}


class Enrolment:
    """The server's side of joining: tasks out, ready and decline in (one per run)."""

    def __init__(self, parts: RunParts, federation: str) -> None:
        self.parts = parts
        self.cfg = parts.cfg
        self.federation = federation
        self.devices: dict[str, Enrolled] = {}
        self._tasks: dict[str, Task] = {}
        self.check_tasks()

    def check_tasks(self) -> None:
        """Build each distinct task's client half as a device would, on a few of the server's own
        samples: a task every device would refuse (a method option its training settings contradict)
        is refused here, at the server's start, as `edgefl simulate` refuses the same config, rather
        than by each device once the run waits for them."""
        from edgefl.enrol import build_client_from_task

        ds = self.parts.ds
        x, y = ds.model_input(ds.x_test[:8]), ds.y_test[:8]
        seen: set[str] = set()
        for slot in self.parts.slots:
            task = task_for(self.cfg, self.parts, slot, "start-check", self.federation)
            key = json.dumps({k: v for k, v in task.to_info().items() if k != "device"}, sort_keys=True, default=str)
            if key in seen or list(x.shape[1:]) != list(task.data.input_shape):  # (a view's shape: no sample of it here)
                continue
            seen.add(key)
            build_client_from_task(task, x[:4], y[:4], x[4:], y[4:])  # raises the method's ConfigError with its hint

    # --- state ------------------------------------------------------------------------------------
    def ready(self) -> list[str]:
        """Devices that can be selected, in the fleet's order."""
        return [d for d in self.parts.device_ids if self.devices.get(d) is not None and self.devices[d].stage == "ready"]

    def is_ready(self, device: str) -> bool:
        known = self.devices.get(device)
        return known is not None and known.stage == "ready"

    def declined(self) -> list[str]:
        return [d for d, e in self.devices.items() if e.stage == "declined"]

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {d: e.to_dict() for d, e in sorted(self.devices.items())}

    def restore(self, saved: Any) -> None:
        """The devices enrolled before a server restart (the server state's ``enrolled``)."""
        if not isinstance(saved, dict):
            return
        for device, facts in saved.items():
            if device in self.parts.device_ids and isinstance(facts, dict) and facts.get("stage") in ("ready", "declined"):
                self.devices[device] = Enrolled(**{k: v for k, v in facts.items() if k in Enrolled.__dataclass_fields__})

    def class_counts(self) -> dict[str, list[int]]:
        return {d: e.class_counts for d, e in self.devices.items() if e.stage == "ready"}

    # --- messages ---------------------------------------------------------------------------------
    def task(self, device: str, run_id: str) -> Task:
        known = self._tasks.get(device)
        if known is None or known.run != run_id:
            known = self._tasks[device] = task_for(self.cfg, self.parts, self.parts.slot(device), run_id, self.federation)
        return known

    def hello(self, device: str, info: dict[str, Any], run_id: str) -> tuple[Task | None, str]:
        """(the device's task, "") or (None, why it cannot take part)."""
        profile = info.get("profile")
        slot = self.parts.slot(device)
        profile_id = None
        if profile is not None:
            problem, profile_id = self._profile_problem(slot, profile)
            if problem:
                self.devices[device] = Enrolled("declined", reason=problem, profile=profile_id)
                return None, problem
        previous = self.devices.get(device)
        if previous is None or previous.stage != "ready":
            self.devices[device] = Enrolled("task sent", profile=profile_id)
        return self.task(device, run_id), ""

    def ready_report(self, device: str, info: dict[str, Any]) -> tuple[str, str]:
        """Record a device's ``ready``; returns why it is refused ("" when accepted) and, when the
        device was ready before with other data, what changed (a restart with new data, or two
        processes with one device id)."""
        num_classes = self.parts.ds.num_classes
        samples, validation, counts = info.get("samples"), info.get("validation", 0), info.get("class_counts")
        if not _count(samples) or samples < 1:
            return "ready.samples must be a positive integer", ""
        if not _count(validation) or validation > samples:
            return "ready.validation must be an integer between 0 and samples", ""
        if not (isinstance(counts, list) and len(counts) == num_classes and all(_count(c) for c in counts)):
            return f"ready.class_counts must list {num_classes} non-negative integers (one per class of the task)", ""
        if sum(counts) != samples:
            return f"ready.class_counts sum to {sum(counts)}, but samples is {samples}", ""
        source = info.get("source", "")
        before = self.devices.get(device)
        changed = ""
        if before is not None and before.stage == "ready" and (before.samples, before.class_counts) != (samples, list(counts)):
            changed = f"{before.samples} samples before, {samples} now" if before.samples != samples else "other class counts"
        self.devices[device] = Enrolled("ready", samples, validation, list(counts), str(source)[:200] if isinstance(source, str) else "",
                                        profile=before.profile if before is not None else None)
        return "", changed

    def decline(self, device: str, info: dict[str, Any]) -> tuple[str, bool]:
        """Record a device's ``decline``: (its reason, whether the device stays ready). A device
        already ready keeps its registration: the decline may come from a second process started
        with its id, and the one that trains must not be dropped from the run by it."""
        reason = info.get("reason")
        text = reason[:MAX_TEXT] if isinstance(reason, str) and reason else "no reason given"
        if self.is_ready(device):
            return text, True
        self.devices[device] = Enrolled("declined", reason=text)
        return text, False

    def _profile_problem(self, slot: DeviceSlot, raw: Any) -> tuple[str, str | None]:
        """Why a device with this profile cannot train its model ("" when it can)."""
        from pydantic import ValidationError

        from edgefl.profile.assign import assign, judge
        from edgefl.profile.cost import estimate
        from edgefl.profile.schema import DeviceProfile

        if not isinstance(raw, dict):
            return "hello.profile must be a device profile (the catalog schema, docs/profile-schema.md)", None
        try:
            profile = DeviceProfile.model_validate(raw)
        except ValidationError as exc:
            return f"hello.profile is not a valid device profile ({exc.error_count()} problems, first: {exc.errors()[0]['msg'][:120]})", None
        train = self.cfg.train_for(slot.group)
        budgets = group_budgets(self.cfg, self.parts.ds, slot.group)
        if not train.max_steps:
            # how long a round takes depends on how many samples the device holds, which it says only
            # once it has read them: judge memory and storage now, time when max_steps bounds a round
            budgets = replace(budgets, deadline_s=math.inf)
        shape = tuple(slot.input_shape(self.parts.ds))
        try:
            est = estimate(slot.model, dict(slot.model_options), profile=profile, batch=train.batch_size, samples=budgets.samples,
                           epochs=1, optimizer=budgets.optimizer, input_shape=shape, num_classes=self.parts.ds.num_classes)  # type: ignore[arg-type]
        except Exception as exc:  # an estimate that cannot be made must not stop the server
            return f"could not judge the profile against {slot.arch}: {type(exc).__name__}", profile.id
        verdict = judge(est, slot.arch, profile, budgets)
        if verdict.fits:
            return "", profile.id
        best = assign(profile, budgets, self.cfg.method.name, input_shape=shape, num_classes=self.parts.ds.num_classes)
        why = f"profile {profile.id} cannot train {slot.arch} ({verdict.bound})"
        if best.chosen is None:
            return f"{why}; it is too small for any zoo model: {best.reason}", profile.id
        return (f"{why}; the largest model it could train is {best.chosen.label}: give this device a group with that model "
                f"(or model = \"auto\" with profile = \"{profile.id}\")"), profile.id


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_SAMPLES
