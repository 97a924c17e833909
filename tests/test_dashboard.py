"""The dashboard in a real browser (Debian's chromium driven by Playwright) during a real fleet run
on mosquitto, and over a finished run's directory alone."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from edgefl.config import RunConfig, validate_config
from edgefl.rundir import RunDir
from edgefl.transport.link import BrokerAddress, Link
from edgefl.transport.topics import Topics
from tests.conftest import digits_config
from tests.mosquitto import mosquitto
from tests.test_fleet import _device, fleet_config, wait_online

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def finished_run(tmp_path: Path) -> RunDir:
    from edgefl.sim import Simulation

    cfg = validate_config(digits_config("fedavg", rounds=2))
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    Simulation(cfg, run, show_progress=False).run()
    return run


def test_the_snapshot_of_a_finished_run_comes_from_its_directory_alone(tmp_path):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from edgefl.dashboard.app import create_app

    run = finished_run(tmp_path)
    state = TestClient(create_app(run.path)).get("/api/state").json()
    assert state["status"] == "finished" and state["run"]["method"] == "fedavg" and state["run"]["rounds"] == 2
    assert [r["round"] for r in state["rounds"]] == [1, 2] and len(state["devices"]) == 4
    guarded = TestClient(create_app(run.path, token="s3cret"))
    assert guarded.get("/api/state").status_code == 401 and guarded.get("/").status_code == 401
    assert guarded.get("/api/state?token=s3cret").status_code == 200
    assert guarded.get("/api/state", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def _browser(playwright):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; ./dev.sh test does it as root)")
    return playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])


def test_the_page_follows_a_live_fleet_and_shows_a_refusal_in_a_real_browser(tmp_path):
    pytest.importorskip("starlette")
    sync_api = pytest.importorskip("playwright.sync_api")
    from edgefl.dashboard import start_dashboard
    from edgefl.fleet.launcher import serve

    base = fleet_config("fedavg", rounds=4, round_deadline_s=60, federation="dash")
    raw = base.to_dict()
    raw["train"]["epochs"] = 40  # rounds of a few seconds: time to watch them close
    cfg = RunConfig.model_validate(raw)
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    ids = [f"client-{i}" for i in range(4)]
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    errors: list[str] = []
    with mosquitto(tmp_path) as broker:
        procs = [_device(path, broker, d, timeout=150) for d in ids]
        wait_online(broker, "dash", ids)
        board = start_dashboard(run.path, "127.0.0.1", 0)
        results: dict = {}

        def server():
            try:
                results["summary"] = serve(cfg, broker, run, join_timeout_s=10)
            except BaseException as exc:
                results["error"] = exc

        thread = threading.Thread(target=server, daemon=True)
        thread.start()
        try:
            with sync_api.sync_playwright() as p:
                browser = _browser(p)
                page = browser.new_page(viewport={"width": 1400, "height": 1100})
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.goto(board.url)
                page.wait_for_function("document.querySelectorAll('#devices tbody .on').length === 4", timeout=60_000)
                page.wait_for_function("Chart.getChart('accuracy').data.labels.length >= 1", timeout=60_000)
                first = page.evaluate("Chart.getChart('accuracy').data.labels.length")
                page.screenshot(path=str(shots / "live.png"), full_page=True)
                rogue = Link(BrokerAddress.parse(broker), "rogue", []).start()
                rogue.publish(Topics("dash").up("client-2"), b"JUNK this is not an envelope")
                rogue.stop(offline=False)
                page.wait_for_function("document.querySelector('#rejections').textContent.includes('bad magic')", timeout=30_000)
                assert "client-2" in page.inner_text("#rejections")
                page.wait_for_function(f"Chart.getChart('accuracy').data.labels.length > {first}", timeout=90_000)
                page.wait_for_function("document.querySelector('#status').textContent === 'finished'", timeout=120_000)
                page.screenshot(path=str(shots / "finished-live.png"), full_page=True)
                browser.close()
        finally:
            thread.join(timeout=120)
            board.stop()
            for proc in procs:
                proc.wait(timeout=60)
    assert "error" not in results, results.get("error")
    assert errors == [], errors

    # the finished run, from its directory alone (as `edgefl dashboard RUN_DIR` serves it)
    board = start_dashboard(run.path, "127.0.0.1", 0)
    try:
        with sync_api.sync_playwright() as p:
            browser = _browser(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(board.url)
            page.wait_for_function("Chart.getChart('accuracy') && Chart.getChart('accuracy').data.labels.length === 4", timeout=30_000)
            assert page.inner_text("#status") == "finished"
            assert page.locator("#devices tbody tr").count() == 4
            assert "client-2" in page.inner_text("#devices")
            page.screenshot(path=str(shots / "finished.png"), full_page=True)
            browser.close()
    finally:
        board.stop()
    assert errors == [], errors
    live = json.loads((run.path / "live.json").read_text())
    assert live["status"] == "finished" and live["devices"]["client-2"]["receipts"]["rejected"] >= 1


def test_hundreds_of_devices_are_paged(tmp_path):
    pytest.importorskip("starlette")
    sync_api = pytest.importorskip("playwright.sync_api")
    from edgefl.dashboard import start_dashboard

    run_dir = tmp_path / "big"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"name": "big", "method": "fedhe", "runner": "fleet", "seed": 0}))
    devices = {f"client-{i:03d}": {"arch": "mlp" if i % 2 else "cnn", "profile": "pi4-4gb" if i % 3 else "pi-zero-2w",
                                   "online": i % 7 != 0, "receipts": {"accepted": 1}, "last_round": 1, "last_reason": None}
               for i in range(500)}
    (run_dir / "live.json").write_text(json.dumps({"status": "running", "rounds": 3, "devices": devices, "round": None,
                                                   "rejections": [], "rejections_total": 0}))
    board = start_dashboard(run_dir, "127.0.0.1", 0)
    try:
        with sync_api.sync_playwright() as p:
            browser = _browser(p)
            page = browser.new_page()
            page.goto(board.url)
            page.wait_for_function("document.querySelectorAll('#devices tbody tr').length === 50", timeout=30_000)
            assert "page 1 of 10" in page.inner_text("#page")
            assert "(500; 428 online)" in page.inner_text("#device-count")
            page.select_option("#group", "pi-zero-2w / cnn")
            page.wait_for_function("document.querySelector('#page').textContent.includes('of 2')")
            page.check("#only-problems")
            page.wait_for_function("[...document.querySelectorAll('#devices tbody tr')].every(r => r.textContent.includes('offline'))")
            browser.close()
    finally:
        board.stop()


def test_the_command_line_serves_beside_a_fleet_and_refuses_what_is_not_a_run(tmp_path):
    pytest.importorskip("starlette")
    from tests.test_cli import ROOT, edgefl

    out = tmp_path / "run"
    res = edgefl("fleet", str(ROOT / "examples" / "fedhe_digits_quick.toml"), "--set", "rounds=1", "--set", "threads=1",
                 "--out", str(out), "--dashboard", "127.0.0.1:0")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "dashboard: http://127.0.0.1:" in res.stderr
    assert json.loads((out / "live.json").read_text())["status"] == "finished"
    res = edgefl("dashboard", str(tmp_path))
    assert res.returncode == 2 and "is not a run directory" in res.stderr


def test_the_live_counts_follow_the_consoles_and_devices_end_offline(tmp_path):
    """A simulation's console counts devices as they finish training while the in-memory server
    reads the round's uploads only after the whole pass: live.json counts both ("trained" is the
    console's "devices done"), writes a change held back by its half-second limit once the limit
    passes (the page never stays behind), and shows every device offline once the run has ended."""
    from edgefl.sim import Simulation

    cfg = validate_config(digits_config("fedhe", rounds=1))
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    sim = Simulation(cfg, run, show_progress=False)
    live = sim.session.live
    seen: list[tuple[int, int]] = []

    def advance() -> None:  # what the console's bar and heartbeat count
        seen.append((len(live.doc["round"]["trained"]), len(live.doc["round"]["reported"])))

    sim.session.write_start()
    record = sim.run_round(1, advance)
    sim.close()
    assert [t for t, _ in seen] == [1, 2, 3, 4]  # trained moves with the console: device k done -> k trained
    assert [r for _, r in seen] == [0, 0, 0, 0]  # ... while no upload has reached the server yet
    assert len(live.doc["round"]["reported"]) == len(record["reported"]) == 4
    on_disk = json.loads((run.path / "live.json").read_text())["round"]
    assert len(on_disk["trained"]) == len(on_disk["reported"]) == 4  # the last count is written at once, not held back
    live.finish(interrupted=False)
    doc = json.loads((run.path / "live.json").read_text())
    assert doc["status"] == "finished" and all(d["online"] is False for d in doc["devices"].values())


def test_a_change_held_back_by_the_write_limit_is_written_when_it_ends(tmp_path):
    import time

    from edgefl.server.live import LiveState

    live = LiveState(tmp_path, {f"d{i}": {"arch": "mlp"} for i in range(3)}, 2, lambda n: n, "fleet")
    live.on_event("presence", {"device": "d0", "online": True})
    live.on_event("round", {"round": 1, "selected": ["d0", "d1", "d2"]})  # forced write
    live.on_event("upload", {"device": "d0", "round": 1, "status": "accepted"})  # within 0.5 s: held back
    assert json.loads((tmp_path / "live.json").read_text())["round"]["reported"] == []
    deadline = time.time() + 3
    while time.time() < deadline and json.loads((tmp_path / "live.json").read_text())["round"]["reported"] != ["d0"]:
        time.sleep(0.05)
    assert json.loads((tmp_path / "live.json").read_text())["round"]["reported"] == ["d0"]
    live.finish(interrupted=True)
    live.on_event("presence", {"device": "d1", "online": True})  # after the end: ignored
    doc = json.loads((tmp_path / "live.json").read_text())
    assert doc["status"] == "interrupted" and not any(d["online"] for d in doc["devices"].values())


def test_the_snapshot_carries_the_baseline_beside_the_run(tmp_path):
    pytest.importorskip("starlette")
    from edgefl.dashboard.app import snapshot

    run = finished_run(tmp_path)
    assert snapshot(run.path)["baseline_rounds"] == []
    (run.path / "baseline").mkdir()
    record = {"round": 2, "accuracy": {"overall": 0.5, "per_arch": {}}}
    (run.path / "baseline" / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    assert snapshot(run.path)["baseline_rounds"] == [record]


#: app.js's drawing run under node against a stand-in DOM (no browser needed): what the page writes
PAGE_UNDER_NODE = r"""
const fs = require("fs");
const els = {};
const mk = (id) => (els[id] ||= { id, textContent: "", innerHTML: "", hidden: false, value: "", checked: false, options: [],
  className: "", querySelector: () => mk(id + " tbody"), addEventListener: () => {} });
global.document = { getElementById: mk, title: "" };
global.location = { search: "" };
global.Chart = function (canvas, config) { this.data = config.data; this.options = config.options; this.update = () => {}; };
global.fetch = () => ({ then: () => ({ then: () => {} }) });
global.EventSource = function () { this.addEventListener = () => {}; };
global.setInterval = () => 0; global.clearInterval = () => {};
eval(fs.readFileSync(process.argv[2], "utf8") + "\nglobal.__draw = draw; global.__charts = charts;");
__draw(JSON.parse(fs.readFileSync(process.argv[3], "utf8")));
console.log(JSON.stringify({ round: els["round"].innerHTML, count: els["device-count"].textContent,
  datasets: __charts.accuracy.data.datasets.map((d) => d.label) }));
"""


@pytest.mark.parametrize("runner", ["simulation", "fleet"])
def test_the_page_counts_what_the_console_counts(tmp_path, runner):
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed")
    import subprocess

    from edgefl.dashboard import app

    ids = [f"client-{i}" for i in range(10)]
    state = {"run": {"name": "x", "runner": runner, "rounds": 12}, "status": "running", "rounds": [], "rejections": [],
             "rejections_total": 0, "baseline_rounds": [{"round": 3, "accuracy": {"overall": 0.5, "per_arch": {}}}],
             # a simulation: devices 0-2 trained, their uploads not yet read; a fleet: 0-2 uploaded (it never counts "trained")
             "round": {"round": 4, "selected": ids, "trained": ids[:3] if runner == "simulation" else [],
                       "reported": [] if runner == "simulation" else ids[:3], "quorum": 10, "outcome": None},
             "devices": {d: {"arch": "mlp", "online": True, "receipts": {}} for d in ids}}

    def page(state: dict) -> dict:
        (tmp_path / "state.json").write_text(json.dumps(state))
        (tmp_path / "page.js").write_text(PAGE_UNDER_NODE)
        res = subprocess.run([node, str(tmp_path / "page.js"), str(app.STATIC / "app.js"), str(tmp_path / "state.json")],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    shown = page(state)
    if runner == "simulation":  # the console's "training, 3/10 devices done"
        assert '<b id="trained">3</b> of 10 selected trained, <b id="reported">0</b> reported' in shown["round"]
    else:  # a fleet's console counts uploads: "3/10 devices reported"
        assert '<b id="reported">3</b> of 10 selected reported (' in shown["round"]
    assert shown["count"] == "(10; 10 online)" and "Local-only baseline, overall" in shown["datasets"]
    state["status"] = "finished"
    state["devices"] = {d: {**v, "online": False} for d, v in state["devices"].items()}
    assert page(state)["count"] == "(10; 0 online, the run has ended)"
