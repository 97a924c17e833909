"""How a run is judged, the same in a simulation and a fleet.

* A method whose server holds global models (FedAvg, FedIN, Felo's groups, FedMHO) is judged by
  them: on the server's shared test set, once per architecture, for every device that sees the
  data as the server does; a device with its own test split or feature space is sent the global
  model (an ``evaluate`` request) and answers with its accuracy. A global model no device runs
  (FedCVAE-Ens) is judged on the server's copy.
* A method without global models (FedHe, CHFL, local-only) is judged by each device's own model:
  devices measure it after training in an evaluation round and report it with their upload
  (``meta.eval_accuracy``); a device's latest report stands for it, and a record names the devices
  whose latest report is from an earlier round than the one judged, or (asynchronous runs, where
  every device reports at its own update) from before the record's window of updates
  (``reported_earlier``: offline, busy or not asked then), so a dead device's old accuracy is
  not read as current.
* Devices that hold no classifier (FedMHO's generator clients) are not judged.

``overall`` is the mean over the judged devices (over the global models when no device is).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from edgefl.algorithms.training import evaluate_accuracy


class Evaluator:
    def __init__(self, x_test: torch.Tensor | None, y_test: torch.Tensor | None, batch_size: int,
                 archs: dict[str, str], judged: set[str], personal: set[str], held_by_devices: bool = False) -> None:
        """``archs``: device -> architecture, in device order; ``judged``: devices holding a
        classifier; ``personal``: devices that judge on their own split or feature space;
        ``held_by_devices``: devices bring their own data (each judges on the share it holds out),
        and the server's test set, when it has one, judges the global models beside them."""
        self.held_by_devices = held_by_devices
        self.x_test, self.y_test = x_test, y_test
        self.batch_size = batch_size
        self.archs = archs
        self.judged = judged
        self.personal = personal
        self.device_accuracy: dict[str, float] = {}  # the latest accuracy each device reported
        self.reported_at: dict[str, int] = {}  # the round (or server update) of each device's latest report

    @property
    def has_test_set(self) -> bool:
        return self.y_test is not None and len(self.y_test) > 0

    def devices_report(self, server) -> bool:
        """Whether devices judge their own trained models (no global model will judge them)."""
        return not server.global_models()

    def personal_targets(self, server) -> list[str]:
        """Devices to send the global model for judging on their own data."""
        globals_ = server.global_models()
        if not globals_:
            return []
        return [d for d, arch in self.archs.items() if d in self.judged and d in self.personal and arch in globals_]

    def device_reported(self, device: str, accuracy: float, at: int) -> None:
        """``device``'s accuracy, measured in round (or after server update) ``at``."""
        self.device_accuracy[device] = float(accuracy)
        self.reported_at[device] = int(at)

    def _judge(self, server, arch: str, state: dict[str, torch.Tensor]) -> float | None:
        if not self.has_test_set:
            return None
        model = server.build_global(arch)
        model.load_state_dict(state)
        return evaluate_accuracy(model, self.x_test, self.y_test, self.batch_size)

    def evaluate(self, server, answers: dict[str, float], at: int | None = None,
                 current_from: int | None = None) -> dict[str, Any] | None:
        """The accuracy record of round (or server update) ``at`` (``answers``: what devices said to
        evaluate requests). A device report from before ``current_from`` (default ``at``) is listed
        in ``reported_earlier``."""
        globals_ = server.global_models()
        if self.held_by_devices and globals_ and self.has_test_set:
            # the server's own test set judges the global models; devices' answers on their own data beside it
            record = self._judged(server, globals_, {}, set())
            if record is not None:
                record["judged_on"] = "server test set"
                if answers:
                    record["device_validation"] = {"overall": statistics.fmean(answers.values()), "per_client": dict(answers),
                                                   "judged_on": "devices' own validation data"}
            return record
        record = self._judged(server, globals_, answers, self.personal)
        if record is not None:
            record["judged_on"] = self._source(bool(globals_), answers)
            if not globals_ and at is not None:
                since = at if current_from is None else min(current_from, at)
                earlier = {d: self.reported_at[d] for d in record["per_client"] if self.reported_at.get(d, at) < since}
                if earlier:
                    record["reported_earlier"] = earlier
                    if since != at:  # an asynchronous record's window: reports before this update are listed
                        record["reported_earlier_than"] = since
            references = {name: score for name, (arch, state) in server.reference_models().items()
                          if (score := self._judge(server, arch, state)) is not None}
            if references:
                record["references"] = references
        return record

    def _source(self, has_globals: bool, answers: dict[str, float]) -> str:
        """What the record's accuracies were measured on (records, summary and plots say it)."""
        own = "devices' own validation data" if self.held_by_devices else "devices' own test split"
        if has_globals:
            if answers and self.has_test_set:
                return f"server test set and {own}"
            return own if answers else "server test set"
        return own if (self.held_by_devices or self.personal) else "shared test set (each device's own model, judged on the device)"

    def _judged(self, server, globals_: dict[str, Any], answers: dict[str, float], personal: set[str]) -> dict[str, Any] | None:
        per_client: dict[str, float] = {}
        if globals_:
            cache: dict[str, float | None] = {}
            for device, arch in self.archs.items():
                if device not in self.judged or arch not in globals_:
                    continue
                if device in personal:
                    if device in answers:
                        per_client[device] = answers[device]
                    continue
                if arch not in cache:
                    cache[arch] = self._judge(server, arch, globals_[arch])
                if cache[arch] is not None:
                    per_client[device] = cache[arch]
        else:
            per_client = {d: self.device_accuracy[d] for d in self.archs if d in self.device_accuracy and d in self.judged}
        groups: dict[str, list[float]] = {}
        for device, acc in per_client.items():
            groups.setdefault(self.archs[device], []).append(acc)
        per_arch = {a: statistics.fmean(v) for a, v in groups.items()}
        for arch, state in globals_.items():
            if arch not in per_arch:
                score = self._judge(server, arch, state)
                if score is not None:
                    per_arch[arch] = score
        scores = list(per_client.values()) or list(per_arch.values())
        if not scores:
            return None
        return {"overall": statistics.fmean(scores), "per_arch": per_arch, "per_client": per_client}
