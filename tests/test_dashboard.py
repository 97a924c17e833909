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
