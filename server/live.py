"""The run's live state, kept in ``RUN_DIR/live.json`` for the dashboard (``edgefl dashboard``).

The round loop's events (presence, round started, uploads, refusals, round closed) update one
small document: every device (online, class, model, last round reported, receipts counted by
status, the last refusal's reason), the current round (selected, reported, quorum, deadline) and
the last refusals. It is written atomically, at most twice a second and at every round's start and
close, so a dashboard in another process (or a finished run's directory) reads a consistent
picture. Bounded by the fleet: one entry per configured device, 50 recent refusals.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

LIVE_FILE = "live.json"
MIN_INTERVAL_S = 0.5
RECENT = 50


class LiveState:
    def __init__(self, path: Path, devices: dict[str, dict[str, Any]], rounds: int, quorum_count: Callable[[int], int],
                 runner: str) -> None:
        self.path = path / LIVE_FILE
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
        self.write(force=True)

    def on_event(self, kind: str, info: dict[str, Any]) -> None:
        devices = self.doc["devices"]
        force = False
        if kind == "presence" and info.get("device") in devices:
            devices[info["device"]]["online"] = bool(info["online"])
        elif kind == "round":
            selected = info["selected"]
            self._reported = set()
            self.doc["round"] = {"round": info["round"], "selected": selected, "reported": [], "quorum": self._quorum_count(len(selected)),
                                 "deadline_unix": info.get("deadline_unix"), "started_unix": time.time(), "outcome": None}
            self.doc["status"] = "running"
            force = True
        elif kind == "upload" and info.get("device") in devices:
            entry = devices[info["device"]]
            status = info.get("status", "accepted")
            entry["receipts"][status] = entry["receipts"].get(status, 0) + 1
            entry["last_round"] = info.get("round")
            current = self.doc["round"]
            if current is not None and info["device"] not in self._reported:
                self._reported.add(info["device"])
                current["reported"].append(info["device"])
        elif kind == "late" and info.get("device") in devices:
            devices[info["device"]]["receipts"]["late"] += 1
        elif kind == "rejected":
            self.doc["rejections_total"] += 1
            self._recent.append({"device": info.get("device"), "reason": info.get("reason"), "unix": time.time()})
            if info.get("device") in devices:
                devices[info["device"]]["receipts"]["rejected"] += 1
                devices[info["device"]]["last_reason"] = info.get("reason")
        elif kind == "closed":
            if self.doc["round"] is not None:
                self.doc["round"]["outcome"] = info.get("outcome")
                self.doc["round"]["stragglers"] = info.get("stragglers", [])
            force = True
        elif kind == "joined":
            force = True
        elif kind == "stopped":
            self.doc["status"] = "interrupted"
            force = True
        self.write(force)

    def finish(self, interrupted: bool) -> None:
        self.doc["status"] = "interrupted" if interrupted else "finished"
        self.write(force=True)

    def write(self, force: bool = False) -> None:
        now = time.time()
        # the document grows with the fleet (about 200 bytes a device): write a large one less often
        if not force and now - self._written < MIN_INTERVAL_S * max(1.0, len(self.doc["devices"]) / 1000):
            return
        self._written = now
        self.doc["updated_unix"] = now
        self.doc["rejections"] = list(self._recent)
        tmp = self.path.with_name(f"{LIVE_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.doc))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a dashboard's view: never worth stopping a run for
