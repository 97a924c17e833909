"""The dashboard: a read-only web page over one run directory (Starlette, served by uvicorn).

Everything it shows comes from the run directory, so it works the same for a simulation, a
fleet, a run still going (``live.json`` and ``metrics.jsonl`` grow) and a finished one:

* ``GET /``: the page (HTML, our JS, Chart.js vendored from npm: no network at run time);
* ``GET /api/state``: one JSON snapshot (run facts, devices, the current round, refusals,
  every round's metrics with its stages, failure and secure aggregation, the summary when there
  is one);
* ``GET /api/events``: server-sent events, a ``state`` event with the snapshot whenever a file of
  the run changed (checked every ``poll_s``).

Bound to 127.0.0.1 unless told otherwise; bound anywhere else it asks for an access token (a
``token`` query parameter or an ``Authorization: Bearer`` header) and compares it in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STATIC = Path(__file__).parent / "static"
WATCHED = ("live.json", "metrics.jsonl", "summary.json", "run.json", "partition.json", "baseline/metrics.jsonl")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a line being written
    return out


#: device ids the page gets per stage and round (the count is always whole): hundreds of rounds of
#: thousands of devices would make every snapshot megabytes
IDS_SHOWN = 50


def _ids(ids: Any) -> dict[str, Any]:
    ids = ids if isinstance(ids, list) else []
    return {"count": len(ids), "ids": ids[:IDS_SHOWN]}


def _stage_facts(m: dict[str, Any]) -> dict[str, Any]:
    """A round's stages (asked, answered, who did not answer), why one failed the round, and its
    secure aggregation (secured or not, devices summed, who dropped after sharing) from its record."""
    out: dict[str, Any] = {}
    if isinstance(m.get("stages"), dict):
        out["stages"] = {str(name): {"asked": s.get("asked"), "answered": s.get("answered"), "dropped": _ids(s.get("dropped"))}
                         for name, s in m["stages"].items() if isinstance(s, dict)}
    if m.get("failure"):
        out["failure"] = str(m["failure"])
    from edgefl.report import privacy_spent, was_secured

    spent = privacy_spent(m)
    if spent:
        out["privacy"] = {name: {"epsilon": eps, "delta": delta} for name, (eps, delta) in spent.items()}
    secagg = (m.get("filters") or {}).get("secagg") if isinstance(m.get("filters"), dict) else None
    if isinstance(secagg, dict):
        groups = {str(name): g for name, g in (secagg.get("groups") or {}).items() if isinstance(g, dict)}
        out["secured"] = was_secured(m)  # a failed round released no sum: not secured
        out["secagg"] = {"groups": {name: {"keys": g.get("keys"), "shared": g.get("shared"), "summed": g.get("summed"),
                                           "threshold": g.get("threshold"), "neighbours": g.get("neighbours"),
                                           "dropped_after_sharing": _ids(g.get("dropped_after_sharing"))}
                                    for name, g in groups.items()}}
    return out


def _live_round(current: Any) -> Any:
    """live.json's current round, its stages' dropped ids cut like the records' (:data:`IDS_SHOWN`)."""
    if not isinstance(current, dict) or not isinstance(current.get("stages"), dict):
        return current
    stages = {str(name): {**s, "dropped": _ids(s.get("dropped"))} for name, s in current["stages"].items() if isinstance(s, dict)}
    return {**current, "stages": stages}


def snapshot(run_dir: Path) -> dict[str, Any]:
    """What the page shows, from the run directory alone."""
    run = _read_json(run_dir / "run.json") or {}
    live = _read_json(run_dir / "live.json")
    partition = _read_json(run_dir / "partition.json") or {}
    metrics = _read_metrics(run_dir / "metrics.jsonl")
    summary = _read_json(run_dir / "summary.json")
    baseline = _read_metrics(run_dir / "baseline" / "metrics.jsonl")  # the Local-only run beside it (simulation.baseline)
    devices = (live or {}).get("devices") or {c["client_id"]: {"arch": c["arch"], "profile": c.get("profile"), "online": None,
                                                                "receipts": {}, "last_round": None, "last_reason": None,
                                                                "samples": c.get("num_samples")}
                                              for c in partition.get("clients", [])}
    rounds = [{
        "round": m["round"], "outcome": m.get("outcome"), "accuracy": m.get("accuracy"), "bytes_up": m.get("bytes_up"),
        "bytes_down": m.get("bytes_down"), "reported": len(m.get("reported", [])), "selected": len(m.get("selected", [])),
        "missing": m.get("missing", []), "rejected": m.get("rejected"), "round_virtual_s": m.get("round_virtual_s"),
        "virtual_time_by_profile": m.get("virtual_time_by_profile"), "stragglers": m.get("stragglers", []),
        "round_time_s": m.get("round_time_s"), **_stage_facts(m),
    } for m in metrics]
    status = (live or {}).get("status") or ("finished" if summary else "unknown")
    if summary is not None and status == "running":
        status = "finished"
    rounds_planned = (live or {}).get("rounds") or (summary or {}).get("rounds")
    if rounds_planned is None:
        try:
            rounds_planned = tomllib.loads((run_dir / "config.toml").read_text()).get("rounds")
        except (OSError, ValueError):
            rounds_planned = None
    return {
        "run": {"name": run.get("name") or run_dir.name, "directory": run_dir.name,
                "method": run.get("method"), "dataset": (run.get("dataset") or {}).get("name"),
                "runner": run.get("runner"), "rounds": rounds_planned, "seed": run.get("seed"),
                "deadline_s": run.get("deadline_s"), "virtual_clock": bool(run.get("device_profiles"))},
        "status": status,
        "round": _live_round((live or {}).get("round")),
        "devices": devices,
        "rejections": (live or {}).get("rejections", []),
        "rejections_total": (live or {}).get("rejections_total", 0),
        "rounds": rounds,
        "baseline_rounds": [{"round": m["round"], "accuracy": m.get("accuracy")} for m in baseline],
        "summary": summary,
        "updated_unix": (live or {}).get("updated_unix"),
    }


def _stamp(run_dir: Path) -> tuple:
    out = []
    for name in WATCHED:
        try:
            st = (run_dir / name).stat()
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


def create_app(run_dir: str | Path, token: str | None = None, poll_s: float = 0.5) -> Starlette:
    """The dashboard of ``run_dir``; ``token``: required on every request when given."""
    run_dir = Path(run_dir)

    def allowed(request: Request) -> bool:
        if token is None:
            return True
        given = request.query_params.get("token") or request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), token.encode())

    async def index(request: Request) -> Response:
        if not allowed(request):
            return Response("an access token is needed: open the address the command printed", status_code=401)
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def state(request: Request) -> Response:
        if not allowed(request):
            return JSONResponse({"error": "access token needed"}, status_code=401)
        return JSONResponse(snapshot(run_dir), headers={"Cache-Control": "no-store"})

    async def events(request: Request) -> Response:
        if not allowed(request):
            return JSONResponse({"error": "access token needed"}, status_code=401)

        async def stream():
            last = None
            idle = 0.0
            while True:
                if await request.is_disconnected():
                    return
                now = _stamp(run_dir)
                if now != last:
                    last = now
                    idle = 0.0
                    yield f"event: state\ndata: {json.dumps(snapshot(run_dir))}\n\n"
                elif idle >= 15:  # a comment keeps proxies and the browser from timing out
                    idle = 0.0
                    yield ": keep-alive\n\n"
                await asyncio.sleep(poll_s)
                idle += poll_s

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    routes = [Route("/", index), Route("/api/state", state), Route("/api/events", events),
              Mount("/static", app=StaticFiles(directory=STATIC), name="static")]
    return Starlette(routes=routes)
