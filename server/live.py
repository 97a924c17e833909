"""The run's live state, kept in ``RUN_DIR/live.json`` for the dashboard (``edgefl dashboard``).

The round loop's events (presence, round started, uploads, refusals, round closed) update one
small document: every device (online, class, model, last round reported, receipts counted by
status, the last refusal's reason, the stages it dropped out of), the current round (selected,
trained, reported, quorum, deadline; in a round with stages also the stage under way, what each
stage asked and got, who did not answer it, why a stage failed the round, and whether secure
aggregation secured the round) and the last refusals. It is written atomically, at most twice a
second and at every round's start, stage, evaluation and close, so a dashboard in another
process (or a finished run's directory) reads a consistent picture; a change that falls inside
the half second is written when it ends, so the page never stays behind the console. Bounded by
the fleet: one entry per configured device, 50 recent refusals.

"trained" (a simulation's device finished its training: what its console counts as "devices
done") is separate from "reported" (the server accepted the upload): the in-memory network hands
the server the round's uploads only once every device of the pass has trained. When the run ends
every device is shown offline: nobody watches their presence any more.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgefl.report import was_secured

LIVE_FILE = "live.json"
MIN_INTERVAL_S = 0.5
RECENT = 50


class LiveState:
    def __init__(self, path: Path, devices: dict[str, dict[str, Any]], rounds: int, quorum_count: Callable[[int], int],
                 runner: str) -> None:
        self.path = path / LIVE_FILE
        # a run directory that has one is being resumed: the stopped run's picture stays until this
        # run's first event (a resume refused before then leaves it as it was)
        earlier = self.path.is_file()
        self.doc: dict[str, Any] = {
            "runner": runner, "rounds": rounds, "status": "starting", "updated_unix": time.time(),
            "round": None, "devices": {d: {**facts, "online": None, "last_round": None,
                                           "receipts": {"accepted": 0, "duplicate": 0, "late": 0, "rejected": 0},
                                           "last_reason": None} for d, facts in devices.items()},
            "rejections": [], "rejections_total": 0,
        }
        self._quorum_count = quorum_count  # the round loop's own rule (NetworkSettings.quorum_count)
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self._written = 0.0
        self._reported: set[str] = set()  # this round's reporters, beside the document's list (no scans per upload)
        self._trained: set[str] = set()
        self._lock = threading.Lock()  # the round loop's thread and the timer that writes a held-back change
        self._timer: threading.Timer | None = None
        self._ended = False
        if not earlier:
            self.write(force=True)

    def on_event(self, kind: str, info: dict[str, Any]) -> None:
        with self._lock:
            if self._ended:  # what arrives after the end (a device leaving) must not reopen the picture
                return
            force = self._apply(kind, info)
            self._write(force)

    def _apply(self, kind: str, info: dict[str, Any]) -> bool:
        """Fold one event into the document; True when it must be written at once."""
        devices = self.doc["devices"]
        force = False
        if kind == "presence" and info.get("device") in devices:
            devices[info["device"]]["online"] = bool(info["online"])
        elif kind == "round":
            selected = info["selected"]
            self._reported, self._trained = set(), set()
            before = self.doc["round"] if self.doc["round"] is not None and self.doc["round"]["round"] == info["round"] else None
            self.doc["round"] = {"round": info["round"], "selected": selected, "trained": [], "reported": [],
                                 "quorum": self._quorum_count(len(selected)), "deadline_unix": info.get("deadline_unix"),
                                 "started_unix": before["started_unix"] if before else time.time(), "outcome": None,
                                 "stage": None, "stages": before["stages"] if before else {}}
            self.doc["status"] = "running"
            force = True
        elif kind == "stage":  # an exchange besides training; those before it come before the "round" event
            current = self.doc["round"]
            if current is None or current["round"] != info.get("round"):
                self._reported, self._trained = set(), set()
                current = self.doc["round"] = {"round": info.get("round"), "selected": [], "trained": [], "reported": [],
                                               "quorum": None, "deadline_unix": None, "started_unix": time.time(),
                                               "outcome": None, "stages": {}}
            current["stage"] = info.get("stage")
            current.setdefault("stages", {})[info.get("stage")] = {"asked": info.get("asked")}
            self.doc["status"] = "running"
            force = True
        elif kind == "stage_failed":
            current = self.doc["round"]
            if current is not None and current["round"] == info.get("round"):
                current["failure"] = info.get("reason")
                current.setdefault("stages", {}).setdefault(info.get("stage"), {})["failed"] = True
            force = True
        elif kind == "trained" and info.get("device") in devices:
            current = self.doc["round"]
            if current is not None and current["round"] == info.get("round") and info["device"] not in self._trained:
                self._trained.add(info["device"])
                current["trained"].append(info["device"])
                force = len(self._trained) == len(current["selected"])
        elif kind == "upload" and info.get("device") in devices:
            entry = devices[info["device"]]
            status = info.get("status", "accepted")
            entry["receipts"][status] = entry["receipts"].get(status, 0) + 1
            entry["last_round"] = info.get("round")
            current = self.doc["round"]
            if current is not None and info["device"] not in self._reported:
                self._reported.add(info["device"])
                current["reported"].append(info["device"])
                force = len(self._reported) == len(current["selected"])  # the count the console ends the round on
        elif kind == "late" and info.get("device") in devices:
            devices[info["device"]]["receipts"]["late"] += 1
        elif kind == "rejected":
            self.doc["rejections_total"] += 1
            self._recent.append({"device": info.get("device"), "reason": info.get("reason"), "unix": time.time()})
            if info.get("device") in devices:
                devices[info["device"]]["receipts"]["rejected"] += 1
                devices[info["device"]]["last_reason"] = info.get("reason")
        elif kind == "enrolled" and info.get("device") in devices:  # a device with its own data is ready
            devices[info["device"]].update(stage="ready", samples=info.get("samples"), held_out=info.get("validation"))
        elif kind == "warning" and info.get("device") in devices:  # accepted, but worth an operator's look
            devices[info["device"]]["last_reason"] = info.get("reason")
        elif kind == "declined" and info.get("device") in devices:
            devices[info["device"]].update(stage="declined", online=False, last_reason=info.get("reason"))
            force = True
        elif kind == "closed":
            accuracy = info.get("accuracy") or {}
            if accuracy.get("judged_on"):  # what the accuracy was measured on (server test set, devices' own data)
                self.doc["accuracy_judged_on"] = accuracy["judged_on"]
            current = self.doc["round"]
            if info.get("stages") and (current is None or current["round"] != info.get("round")):
                # a round with stages whose "round" event never came and whose stages were not watched either
                current = self.doc["round"] = {"round": info["round"], "selected": info["selected"], "trained": [],
                                               "reported": list(info.get("reported", [])), "quorum": None,
                                               "deadline_unix": None, "started_unix": None, "outcome": None}
            if current is not None:
                current["outcome"] = info.get("outcome")
                current["stragglers"] = info.get("stragglers", [])
                current["stage"] = None
                if info.get("stages"):  # what each stage asked, got and who did not answer (the record's numbers)
                    current["stages"] = {name: {**current.get("stages", {}).get(name, {}), **facts}
                                         for name, facts in info["stages"].items()}
                    for name, facts in info["stages"].items():
                        for device in facts.get("dropped") or []:
                            if device in devices:
                                entry = devices[device]
                                entry["receipts"]["dropped"] = entry["receipts"].get("dropped", 0) + 1
                                entry["last_dropped"] = {"round": info["round"], "stage": name}
                if info.get("failure"):
                    current["failure"] = info["failure"]
                if was_secured(info):  # a failed round released no sum
                    current["secured"] = True
            force = True
        elif kind in ("joined", "evaluating"):
            force = True
        elif kind == "stopped":
            self.doc["status"] = "interrupted"
            force = True
        return force

    def finish(self, interrupted: bool) -> None:
        with self._lock:
            self._ended = True
            self.doc["status"] = "interrupted" if interrupted else "finished"
            for entry in self.doc["devices"].values():  # the run no longer hears their presence: none is "online"
                if entry["online"]:
                    entry["online"] = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._write(force=True)

    def write(self, force: bool = False) -> None:
        with self._lock:
            self._write(force)

    def _flush(self) -> None:
        with self._lock:
            self._timer = None
            self._write(force=True)

    def _write(self, force: bool = False) -> None:
        now = time.time()
        # the document grows with the fleet (about 200 bytes a device): write a large one less often
        interval = MIN_INTERVAL_S * max(1.0, len(self.doc["devices"]) / 1000)
        if not force and now - self._written < interval:
            if self._timer is None:  # held back, not dropped: written when the interval ends
                self._timer = threading.Timer(interval - (now - self._written), self._flush)
                self._timer.daemon = True
                self._timer.start()
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._written = now
        self.doc["updated_unix"] = now
        self.doc["rejections"] = list(self._recent)
        tmp = self.path.with_name(f"{LIVE_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.doc))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a dashboard's view: never worth stopping a run for
