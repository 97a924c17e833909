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


def secured_run_with_dropouts(path: Path, console=None) -> tuple[RunDir, list[tuple[str, dict, dict]]]:
    """A real 4-round simulation under secure aggregation (ten MLPs in two groups, 4 neighbours,
    threshold 2). Round 1 is plain; in round 2 client-1 dies after sharing its keys (no masked
    upload) and client-7 after its masked upload (no answer to the unmasking); in round 3 only
    client-0 answers the unmasking (fewer than t shares: the stage fails the round); in round 4
    only client-0 and client-5 send keys (one device with keys per group: the keys stage fails the
    round before any training). Returns the run and, per stage/round/closed event, the event and
    live.json's current round just after it."""
    from edgefl.filters.secagg import SecAgg
    from edgefl.sim import Simulation
    from tests.conftest import method_config

    raw = method_config("fedavg", rounds=4)
    raw.update(threads=1, network={"federation": "secagg-dashboard", "round_deadline_s": 60},
               fleet={"groups": [{"model": "mlp", "count": 5, "options": {"hidden": [32, 16]}},
                                 {"model": "mlp", "count": 5, "options": {"hidden": [24]}}]},
               filters=[{"name": "secagg", "neighbours": 4, "threshold": 2}])
    cfg = validate_config(raw)
    real_out, real_answer = SecAgg.upload_out, SecAgg.answer_stage

    def upload_out(self, message):
        if message.round == 2 and self.device == "client-1":
            raise RuntimeError("killed after sharing its keys")
        return real_out(self, message)

    def answer_stage(self, stage, request):
        if stage == "secagg-unmask" and (request.round == 2 and self.device == "client-7"
                                         or request.round == 3 and self.device != "client-0"):
            return None
        if stage == "secagg-keys" and request.round == 4 and self.device not in ("client-0", "client-5"):
            return None
        return real_answer(self, stage, request)

    run = RunDir.create(path, cfg.name, cfg.seed)
    seen: list[tuple[str, dict, dict]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SecAgg, "upload_out", upload_out)
        mp.setattr(SecAgg, "answer_stage", answer_stage)
        sim = Simulation(cfg, run, console=console, show_progress=console is not None)
        live = sim.session.live
        real_on_event = live.on_event

        def on_event(kind: str, info: dict) -> None:
            real_on_event(kind, info)
            if kind in ("stage", "stage_failed", "round", "closed"):
                seen.append((kind, info, json.loads(json.dumps(live.doc["round"]))))

        live.on_event = on_event
        sim.run()
    return run, seen


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
    # devices as threads (memory://): what is tested is the command's page; the browser test above runs device processes
    res = edgefl("fleet", str(ROOT / "examples" / "fedhe_digits_quick.toml"), "--set", "rounds=1", "--set", "threads=1",
                 "--out", str(out), "--dashboard", "127.0.0.1:0", "--broker", "memory://dashboard-cli")
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


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> tuple[RunDir, list[tuple[str, dict, dict]]]:
    return secured_run_with_dropouts(tmp_path_factory.mktemp("secured") / "run")


def test_live_state_follows_stages_drop_outs_and_failed_rounds_of_a_secured_run(secured):
    run, seen = secured
    # a stage before training comes before the "round" event: the round is shown from its first stage on
    first = seen[0]
    assert first[0] == "stage" and first[1]["stage"] == "secagg-keys"
    assert first[2]["round"] == 1 and first[2]["stage"] == "secagg-keys" and first[2]["stages"] == {"secagg-keys": {"asked": 10}}
    started = next(doc for kind, info, doc in seen if kind == "round" and info["round"] == 1)
    assert started["stage"] is None and set(started["stages"]) == {"secagg-keys", "secagg-shares"}  # kept through "round"
    assert len(started["selected"]) == 10
    unmask = next(doc for kind, info, doc in seen if kind == "stage" and info == {"round": 2, "stage": "secagg-unmask", "asked": 9})
    assert unmask["stage"] == "secagg-unmask" and unmask["outcome"] is None

    closed = {info["round"]: doc for kind, info, doc in seen if kind == "closed"}
    assert all(closed[r]["secured"] is True for r in (1, 2)) and not any(closed[r].get("secured") for r in (3, 4))  # failed: no sum
    assert closed[1]["outcome"] == "complete" and all(s["dropped"] == [] for s in closed[1]["stages"].values())
    assert closed[2]["outcome"] == "deadline" and closed[2]["stages"]["secagg-unmask"] == {"asked": 9, "answered": 8, "dropped": ["client-7"]}
    assert "failure" not in closed[2]
    # a stage after training failed the round: why, and which stage
    assert closed[3]["outcome"] == "failed" and "needs 2 shares" in closed[3]["failure"]
    assert closed[3]["stages"]["secagg-unmask"]["failed"] is True and len(closed[3]["stages"]["secagg-unmask"]["dropped"]) == 9
    failed_event = next(doc for kind, info, doc in seen if kind == "stage_failed" and info["round"] == 3)
    assert failed_event["failure"] == closed[3]["failure"]
    # the keys stage failed round 4 before training: no "round" event, yet the page has the round
    assert not [1 for kind, info, _ in seen if kind == "round" and info["round"] == 4]
    assert closed[4]["round"] == 4 and closed[4]["selected"] == [] and closed[4]["outcome"] == "failed"
    assert "one device with keys" in closed[4]["failure"] and closed[4]["stages"]["secagg-keys"]["failed"] is True
    assert closed[4]["stages"]["secagg-keys"]["dropped"] == [f"client-{i}" for i in (1, 2, 3, 4, 6, 7, 8, 9)]

    doc = json.loads((run.path / "live.json").read_text())
    assert doc["status"] == "finished" and doc["round"] == closed[4]
    seven = doc["devices"]["client-7"]
    assert seven["receipts"]["dropped"] == 3 and seven["last_dropped"] == {"round": 4, "stage": "secagg-keys"}
    assert "dropped" not in doc["devices"]["client-0"]["receipts"]  # never dropped out


def test_the_snapshot_carries_each_round_s_stages_secured_and_failure(secured):
    pytest.importorskip("starlette")
    from edgefl.dashboard.app import IDS_SHOWN, snapshot

    run, _ = secured
    state = snapshot(run.path)
    rounds = {r["round"]: r for r in state["rounds"]}
    assert [rounds[r]["secured"] for r in (1, 2, 3, 4)] == [True, True, False, False]  # 3 and 4 failed: no sum released
    assert rounds[2]["stages"]["secagg-unmask"] == {"asked": 9, "answered": 8, "dropped": {"count": 1, "ids": ["client-7"]}}
    groups = rounds[2]["secagg"]["groups"]
    assert sorted(g["dropped_after_sharing"]["ids"] for g in groups.values()) == [[], ["client-1"]]
    assert "failure" not in rounds[2] and "needs 2 shares" in rounds[3]["failure"] and "one device with keys" in rounds[4]["failure"]
    assert state["round"]["stages"]["secagg-keys"]["dropped"]["count"] == 8  # the live round's ids, cut the same way
    assert "secured" not in snapshot(finished_run(run.path.parent / "plain").path)["rounds"][0]  # a plain run: no such fields

    # thousands of devices dropped: the count is whole, the ids are the first IDS_SHOWN
    record = json.loads((run.path / "metrics.jsonl").read_text().splitlines()[0])
    record["stages"]["secagg-keys"]["dropped"] = [f"d{i}" for i in range(3000)]
    big = run.path.parent / "big"
    big.mkdir()
    (big / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    dropped = snapshot(big)["rounds"][0]["stages"]["secagg-keys"]["dropped"]
    assert dropped["count"] == 3000 and dropped["ids"] == [f"d{i}" for i in range(IDS_SHOWN)]


#: what a device can name itself or put in a reason: shown as text, never run as HTML
HOSTILE_ID = '<img src=x onerror="window.__pwned=1">'
HOSTILE_REASON = "<script>window.__pwned=2</script> [/] \x1b[2J"


def _hostile_copy(run: RunDir, to: Path) -> Path:
    """The secured run's directory with hostile device ids and reasons where devices put them."""
    shutil.copytree(run.path, to)
    records = [json.loads(line) for line in (to / "metrics.jsonl").read_text().splitlines()]
    records[1]["stages"]["secagg-unmask"]["dropped"].append(HOSTILE_ID)
    next(g for g in records[1]["filters"]["secagg"]["groups"].values() if g["dropped_after_sharing"])["dropped_after_sharing"].append(HOSTILE_ID)
    records[2]["failure"] += " " + HOSTILE_REASON
    (to / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    live = json.loads((to / "live.json").read_text())
    live["round"]["stages"]["secagg-keys"]["dropped"].append(HOSTILE_ID)
    live["round"]["failure"] += " " + HOSTILE_REASON
    live["rejections"] = [{"device": HOSTILE_ID, "reason": HOSTILE_REASON, "unix": 0}]
    live["rejections_total"] = 1
    (to / "live.json").write_text(json.dumps(live))
    return to


def test_a_secured_run_s_rounds_drop_outs_and_failures_in_a_real_browser(secured, tmp_path):
    pytest.importorskip("starlette")
    sync_api = pytest.importorskip("playwright.sync_api")
    from edgefl.dashboard import start_dashboard

    run, _ = secured
    folder = _hostile_copy(run, tmp_path / "run")
    errors: list[str] = []
    board = start_dashboard(folder, "127.0.0.1", 0)
    try:
        with sync_api.sync_playwright() as p:
            browser = _browser(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(board.url)
            page.wait_for_function("document.querySelectorAll('#rounds-body tr').length === 4", timeout=30_000)
            assert page.inner_text("#secured") == "secure aggregation: 2 of 4 rounds secured"  # 3 and 4 failed: no sum released
            heads = page.locator("#rounds-head th").all_inner_texts()
            assert heads == ["round", "outcome", "reported", "accuracy", "secured", "dropped in stages", "why it failed"]
            row = {r: page.locator(f'#rounds-body tr[data-round="{r}"]') for r in (1, 2, 3, 4)}
            assert all("secured" in row[r].inner_text() for r in (1, 2))
            assert all("secured" not in row[r].inner_text() for r in (3, 4))
            assert "secagg-unmask: 2" in row[2].inner_text() and "dropped after sharing: 2" in row[2].inner_text()
            unmask = row[2].locator("details", has_text="secagg-unmask")
            assert "client-7" not in unmask.inner_text()
            unmask.locator("summary").click()  # the ids under the count
            assert "client-7" in unmask.inner_text() and HOSTILE_ID in unmask.inner_text()
            assert unmask.get_attribute("title") == f"client-7, {HOSTILE_ID}"  # on hover too
            assert "needs 2 shares" in row[3].inner_text() and HOSTILE_REASON.split(" \x1b")[0] in row[3].inner_text()
            assert "one device with keys" in row[4].inner_text() and "failed" in row[4].inner_text()
            # the current round: the keys stage failed it before training, with the reason
            assert "closed: failed" in page.inner_text("#round-line") and "secured" not in page.inner_text("#round-line")
            assert "one device with keys" in page.inner_text("#round-failure")
            assert "secagg-keys 2 of 10" in page.inner_text("#round-stages")
            # the drop-outs by stage, the ids and a failed round's reason in the tooltip
            assert page.is_visible("#dropouts")
            chart = page.evaluate("""(() => { const c = Chart.getChart('dropouts'); const d = c.data.datasets;
              const cb = c.options.plugins.tooltip.callbacks; const unmask = d.find((x) => x.label === 'secagg-unmask');
              return { labels: c.data.labels, sets: d.map((x) => [x.label, x.data]),
                       ids: cb.afterLabel({ dataset: unmask, dataIndex: 1 }),
                       why: cb.footer([{ chart: c, dataIndex: 2 }]) }; })()""")
            assert chart["labels"] == [1, 2, "3 (failed)", "4 (failed)"]
            assert dict(chart["sets"]) == {"secagg-keys": [0, 0, 0, 8], "secagg-shares": [0, 0, 0, 0], "secagg-unmask": [0, 2, 9, 0],
                                           "shared keys, no masked upload": [0, 2, 0, 0]}
            assert chart["ids"] == f"client-7, {HOSTILE_ID}" and chart["why"].startswith("round failed: secagg: the self mask")
            # devices: how often each dropped out of a stage
            seven = page.locator('#devices tbody tr[data-device="client-7"] td').all_inner_texts()
            assert seven[9] == "3"
            # refusals are still listed with their reasons, as text
            assert HOSTILE_ID in page.inner_text("#rejections") and "<script>" in page.inner_text("#rejections")
            page.check("#only-dropped")
            page.wait_for_function("document.querySelectorAll('#rounds-body tr').length === 3")
            assert "(4; 3 with drop-outs or failed)" in page.inner_text("#rounds-count")
            page.screenshot(path=str(tmp_path / "secured.png"), full_page=True)
            # nothing a device wrote became markup
            assert page.evaluate("window.__pwned") is None
            assert page.locator("img, script:not([src])").count() == 0
            browser.close()
    finally:
        board.stop()
    assert errors == [], errors


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
  datasets: __charts.accuracy.data.datasets.map((d) => d.label), rounds: els["rounds-body"].innerHTML,
  head: els["rounds-head"].innerHTML, devices: els["devices tbody"].innerHTML, secured: els["secured"].textContent,
  dropouts: __charts.dropouts.data.datasets.map((d) => [d.label, d.data]), dropoutsHidden: els["dropouts-panel"].hidden }));
"""


def _page_under_node(tmp_path: Path, state: dict) -> dict:
    """What app.js's draw() writes for ``state``, run under node against a stand-in DOM."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed")
    import subprocess

    from edgefl.dashboard import app

    (tmp_path / "state.json").write_text(json.dumps(state))
    (tmp_path / "page.js").write_text(PAGE_UNDER_NODE)
    res = subprocess.run([node, str(tmp_path / "page.js"), str(app.STATIC / "app.js"), str(tmp_path / "state.json")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("runner", ["simulation", "fleet"])
def test_the_page_counts_what_the_console_counts(tmp_path, runner):
    ids = [f"client-{i}" for i in range(10)]
    state = {"run": {"name": "x", "runner": runner, "rounds": 12}, "status": "running", "rounds": [], "rejections": [],
             "rejections_total": 0, "baseline_rounds": [{"round": 3, "accuracy": {"overall": 0.5, "per_arch": {}}}],
             # a simulation: devices 0-2 trained, their uploads not yet read; a fleet: 0-2 uploaded (it never counts "trained")
             "round": {"round": 4, "selected": ids, "trained": ids[:3] if runner == "simulation" else [],
                       "reported": [] if runner == "simulation" else ids[:3], "quorum": 10, "outcome": None},
             "devices": {d: {"arch": "mlp", "online": True, "receipts": {}} for d in ids}}

    def page(state: dict) -> dict:
        return _page_under_node(tmp_path, state)

    shown = page(state)
    if runner == "simulation":  # the console's "training, 3/10 devices done"
        assert '<b id="trained">3</b> of 10 selected trained, <b id="reported">0</b> reported' in shown["round"]
    else:  # a fleet's console counts uploads: "3/10 devices reported"
        assert '<b id="reported">3</b> of 10 selected reported (' in shown["round"]
    assert shown["count"] == "(10; 10 online)" and "Local-only baseline, overall" in shown["datasets"]
    state["status"] = "finished"
    state["devices"] = {d: {**v, "online": False} for d, v in state["devices"].items()}
    assert page(state)["count"] == "(10; 0 online, the run has ended)"
    assert shown["head"].count("<th>") == 4 and shown["dropouts"] == [] and shown["dropoutsHidden"] is True  # no stages: no such columns


def test_the_page_writes_device_ids_and_reasons_as_text(tmp_path):
    """Ids and reasons a device chose, wherever the page shows them (the current round's stages,
    stragglers and failure, the rounds table, the device table's last drop-out, refusals), are
    escaped; a stage under way before training is shown without counts."""
    pytest.importorskip("starlette")
    bad = HOSTILE_ID
    state = {"run": {"name": "x", "runner": "fleet", "rounds": 3}, "status": "running", "baseline_rounds": [],
             "rejections": [{"device": bad, "reason": HOSTILE_REASON}], "rejections_total": 1,
             "round": {"round": 3, "selected": [], "trained": [], "reported": [], "quorum": None, "outcome": None,
                       "stage": "secagg-keys", "stages": {"secagg-keys": {"asked": 10, "dropped": {"count": 0, "ids": []}}}},
             "rounds": [{"round": 1, "outcome": "complete", "reported": 9, "selected": 10, "accuracy": None, "secured": True,
                         "stages": {"secagg-unmask": {"asked": 10, "answered": 9, "dropped": {"count": 1, "ids": [bad]}}},
                         "secagg": {"groups": {bad: {"summed": 9, "shared": 10, "threshold": 2, "neighbours": 4,
                                                      "dropped_after_sharing": {"count": 1, "ids": [bad]}}}}},
                        {"round": 2, "outcome": "failed", "reported": 0, "selected": 10, "accuracy": None, "secured": True,
                         "failure": HOSTILE_REASON, "stages": {}}],
             "devices": {bad: {"arch": bad, "profile": bad, "online": True, "receipts": {"dropped": 1}, "last_reason": HOSTILE_REASON,
                               "last_dropped": {"round": 1, "stage": bad}}}}
    shown = _page_under_node(tmp_path, state)
    for html in (shown["round"], shown["rounds"], shown["devices"]):
        assert "<img" not in html and "<script" not in html
    assert "&lt;img" in shown["rounds"] and "&lt;script&gt;" in shown["rounds"] and "&lt;img" in shown["devices"]
    assert 'title="&lt;img src=x onerror=&quot;window.__pwned=1&quot;&gt;"' in shown["rounds"]  # attributes stay closed
    assert "in stage secagg-keys" in shown["round"] and "selected" not in shown["round"]  # no selection yet: no counts
    assert "secagg-keys 10 asked, under way" in shown["round"]
    assert shown["secured"] == "secure aggregation: 2 of 2 rounds secured"
    assert dict(shown["dropouts"]) == {"secagg-unmask": [1, 0], "shared keys, no masked upload": [1, 0]}
    # a live round closed with stragglers whose ids are markup
    state["round"] = {"round": 3, "selected": [bad], "trained": [], "reported": [], "quorum": 1, "outcome": "deadline",
                      "stragglers": [bad], "failure": HOSTILE_REASON}
    html = _page_under_node(tmp_path, state)["round"]
    assert "<img" not in html and "<script" not in html and "stragglers: &lt;img" in html and "failed: &lt;script&gt;" in html
