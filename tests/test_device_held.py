"""Real devices that train on data only they hold: `edgefl client --data` with no run config joins
an `edgefl server` over mosquitto, gets its task from the server, reads its own folder of images
(or its own CSV table) and trains; a device holding a class the federation does not know declines
with the reason while the run goes on (issue: devices own their data)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgefl.config import RunConfig
from tests.mosquitto import mosquitto

pytest.importorskip("PIL")


def _fashion():
    from edgefl.data import load_dataset

    try:
        return load_dataset("fashion-mnist", download=False)
    except Exception as exc:  # the Debian package is not installed here
        pytest.skip(f"Fashion-MNIST files not available: {exc}")


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-").lower()


def write_image_folder(root: Path, ds, classes: list[int], per_class: int, offset: int, extra: str | None = None) -> dict[str, int]:
    """Real Fashion-MNIST images as PNG files, one sub-folder per class (named as people would:
    a slug of the class name, since "T-shirt/top" cannot be a folder name)."""
    from PIL import Image

    labels = ds.y_train.numpy()
    counts = {}
    for c in classes:
        folder = root / _slug(ds.class_names[c])
        folder.mkdir(parents=True)
        idx = np.flatnonzero(labels == c)[offset: offset + per_class]
        for i in idx:
            pixels = (ds.x_train[i, 0].numpy() * 255).round().astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(folder / f"{i}.png")
        counts[ds.class_names[c]] = len(idx)
    if extra is not None:  # a class the federation does not know
        folder = root / extra
        folder.mkdir()
        Image.fromarray(np.zeros((28, 28), np.uint8), mode="L").save(folder / "0.png")
    return counts


def _config(tmp_path: Path, method: str, groups: list[dict], federation: str, **data) -> Path:
    raw = {
        "name": f"held-{method}", "seed": 0, "rounds": 2,
        "method": {"name": method},
        "data": {"partition": "devices", **data},
        "train": {"epochs": 1, "batch_size": 32, "max_steps": 4},
        "fleet": {"groups": groups},
        "network": {"federation": federation, "round_deadline_s": 60, "quorum": 0.5},
        "eval": {"every": 1},
    }
    cfg = RunConfig.model_validate(raw)
    path = tmp_path / "server.toml"
    path.write_text(cfg.to_toml())
    return path


def _edgefl(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgefl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_fleet(tmp_path: Path, config: Path, federation: str, data: dict[str, Path]) -> tuple[subprocess.Popen, dict, Path]:
    run = tmp_path / "run"
    with mosquitto(tmp_path) as broker:
        server = _edgefl("server", "--broker", broker, "--config", str(config), "--out", str(run))
        devices = {d: _edgefl("client", "--broker", broker, "--device-id", d, "--data", str(path), "--federation", federation,
                              "--timeout", "150") for d, path in data.items()}
        try:
            outcome = {d: (p.wait(timeout=180), p.stderr.read()) for d, p in devices.items()}
            server.wait(timeout=60)
        finally:
            for p in [server, *devices.values()]:
                if p.poll() is None:
                    p.kill()
    return server, outcome, run


@pytest.mark.parametrize("method,groups", [
    ("fedhe", [{"model": "lenet5", "count": 2}, {"model": "cnn-small", "count": 2}]),
    ("fedavg", [{"model": "lenet5", "count": 4}]),
])
def test_devices_with_their_own_image_folders_finish_a_run_and_a_stranger_class_is_refused(tmp_path, method, groups):
    ds = _fashion()
    held = {  # label skew: each device holds a few classes of its own
        "client-0": ([0, 1, 2, 3], 30, 0, None),
        "client-1": ([3, 4, 5, 6], 30, 100, None),
        "client-2": ([6, 7, 8, 9], 30, 200, None),
        "client-3": ([0, 9], 10, 300, "unicorn"),
    }
    data, written = {}, {}
    for device, (classes, n, offset, extra) in held.items():
        data[device] = tmp_path / "devices" / device
        written[device] = write_image_folder(data[device], ds, classes, n, offset, extra)
    federation = f"held-{method}"
    config = _config(tmp_path, method, groups, federation, dataset="fashion-mnist", test_samples=500)
    server, outcome, run = _run_fleet(tmp_path, config, federation, data)

    assert server.returncode == 0, server.stderr.read()[-3000:]
    for device in ("client-0", "client-1", "client-2"):
        code, stderr = outcome[device]
        assert code == 0, f"{device}: {stderr[-2000:]}"
        assert "training" in stderr and "held out to validate" in stderr
        # a line a round (what a device's journal shows), once: not again for the answer to the round's evaluate request
        assert stderr.count(f"{device}: round 2: upload accepted, trained on") == 1, stderr[-2000:]
    code, stderr = outcome["client-3"]
    assert code == 2, stderr[-2000:]
    assert "unicorn" in stderr and "cannot take part" in stderr

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    assert all(sorted(r["reported"]) == ["client-0", "client-1", "client-2"] for r in records)
    assert all(r["outcome"] in ("complete", "deadline") for r in records)
    partition = json.loads((run / "partition.json").read_text())
    assert partition["held_by_devices"] is True
    by_id = {c["client_id"]: c for c in partition["clients"]}
    assert by_id["client-3"]["stage"] == "declined" and "unicorn" in by_id["client-3"]["reason"]
    for device in ("client-0", "client-1", "client-2"):
        got = by_id[device]
        assert got["stage"] == "ready"
        expected = [written[device].get(name, 0) for name in ds.class_names]
        assert got["class_counts"] == expected
        assert got["num_samples"] == sum(expected) and 1 <= got["num_test"] < got["num_samples"]
    accuracy = records[-1]["accuracy"]
    assert accuracy["overall"] is not None
    if method == "fedavg":  # a global model: judged on the server's test set, devices' own validation beside it
        assert accuracy["judged_on"] == "server test set"
        assert set(accuracy["device_validation"]["per_client"]) == {"client-0", "client-1", "client-2"}
    else:  # FedHe keeps a model per device: each judges its own on the data it held out
        assert accuracy["judged_on"] == "devices' own validation data"
        assert set(accuracy["per_client"]) == {"client-0", "client-1", "client-2"}
        plan = json.loads((run / "ship.json").read_text())  # a best device names the count it was judged on
        for entry in plan["models"].values():
            assert entry["judged_on"] == f"its {by_id[entry['device']]['num_test']} validation samples"
        # client-3 declined: no candidate for cnn-small's pick, and not counted as one
        assert "the best of the 1 of 2 device(s) training cnn-small that reported" in plan["models"]["cnn-small"]["why"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed_rounds"] == []
    assert any("declined" in reason for reason in json.dumps(summary["rejections"]).split('"'))
    _check_device_models(tmp_path, federation, ["client-0", "client-1", "client-2"], outcome, run, ds if method == "fedhe" else None)


def _check_device_models(tmp_path: Path, federation: str, devices: list[str], outcome: dict, run: Path, export_on=None) -> None:
    """Each device wrote its model into its state folder when the run ended and said where; the
    file rebuilds as the model it trained (the task's architecture, classes and shape), and a
    method without global models names that file in ship.json."""
    from edgefl.exporters import load_weights_file

    plan = json.loads((run / "ship.json").read_text())
    for device in devices:
        path = tmp_path / "xdg-state" / "edgefl" / federation / device / "model.safetensors"
        said = " ".join(outcome[device][1].split())  # the console wraps long lines
        assert f"its own model is in {path}" in said and f"edgefl export {path} --dataset NAME" in said
        src = load_weights_file(path)
        assert src.client_id == device and src.class_names and src.dataset is None
        if export_on is not None:  # what the device said to run: the export checks it against PyTorch on real samples
            from edgefl.exporters import export_model

            pytest.importorskip("onnxruntime")
            files = export_model(src, tmp_path / "export" / device, formats=("onnx",), dynamic_batch=False, dataset=export_on)
            assert files and all(f.parity is not None and f.parity.samples == 128 and f.accuracy is not None for f in files)
            source = json.loads(files[0].sidecar.read_text())["source"]  # where the file came from: device, run, data set
            assert source["device"] == device and source["run_id"] and source["method"] == "fedhe" and source["dataset"] == "fashion-mnist"
            export_on = None  # one device is enough
    if plan["kind"] != "global":
        assert all("model.safetensors" in entry["where"] for entry in plan["models"].values())


def test_a_csv_holding_chfl_device_trains_on_its_own_table(tmp_path):
    sklearn = pytest.importorskip("sklearn.datasets")
    raw = sklearn.load_breast_cancer()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(raw.target))
    data = {}
    for k, device in enumerate(["client-0", "client-1"]):
        rows = order[k * 150:(k + 1) * 150]
        path = tmp_path / f"{device}.csv"
        # client-1's table has its columns in another order and one more: the task names the data
        # set's columns, so the device reads them by name (by position it would train on the wrong features)
        cols = list(range(30)) if k == 0 else list(range(29, -1, -1))
        with open(path, "w", newline="") as fh:
            out = csv.writer(fh)
            out.writerow([*(raw.feature_names[c] for c in cols), "label", *(["patient"] if k else [])])
            for i in rows:
                out.writerow([*(f"{raw.data[i][c]:.6g}" for c in cols), raw.target_names[raw.target[i]], *([f"p{i}"] if k else [])])
        data[device] = path
    federation = "held-chfl"
    groups = [{"model": "mlp", "count": 2, "options": {"hidden": [32], "feature_dim": 64}}]
    config = _config(tmp_path, "chfl", groups, federation, dataset="breast-cancer")
    server, outcome, run = _run_fleet(tmp_path, config, federation, data)
    assert server.returncode == 0, server.stderr.read()[-3000:]
    for device, (code, stderr) in outcome.items():
        assert code == 0, f"{device}: {stderr[-2000:]}"
    said = " ".join(outcome["client-1"][1].split())  # the console wraps long lines
    assert "took the feature columns in the task's order" in said and "ignored 1 column(s)" in said, said[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(r["reported"]) for r in records] == [["client-0", "client-1"]] * 2
    assert min(records[-1]["accuracy"]["per_client"].values()) > 0.6  # standardised with the task's statistics, the table is learnable
    _check_device_models(tmp_path, federation, ["client-0", "client-1"], outcome, run)


def test_a_device_started_before_its_broker_keeps_trying_and_joins(tmp_path):
    """What a device started at boot does (the systemd unit of docs/deploy.md: --broker-wait inf)."""
    import time

    from edgefl.fleet.broker import free_port, mosquitto_binary, start_mosquitto

    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed")
    ds = _fashion()
    data = {"client-0": tmp_path / "c0", "client-1": tmp_path / "c1"}
    write_image_folder(data["client-0"], ds, [0, 1, 2], 20, 0)
    write_image_folder(data["client-1"], ds, [2, 3, 4], 20, 50)
    config = _config(tmp_path, "fedavg", [{"model": "cnn-small", "count": 2}], "held-boot", dataset="fashion-mnist", test_samples=200)
    port = free_port()
    broker = f"mqtt://127.0.0.1:{port}"
    early = _edgefl("client", "--broker", broker, "--device-id", "client-0", "--data", str(data["client-0"]),
                    "--federation", "held-boot", "--broker-wait", "inf", "--timeout", "150")
    gave_up = _edgefl("client", "--broker", broker, "--device-id", "client-1", "--data", str(data["client-1"]),
                      "--federation", "held-boot", "--broker-wait", "2")
    assert gave_up.wait(timeout=60) == 2
    said = gave_up.stderr.read()
    assert "cannot reach the broker" in said and "--broker-wait inf" in said and "edgefl fleet" not in said  # a device's hint
    time.sleep(3)  # the early device is retrying by now
    local = start_mosquitto(tmp_path / "mosquitto", port=port)
    try:
        late = _edgefl("client", "--broker", broker, "--device-id", "client-1", "--data", str(data["client-1"]),
                       "--federation", "held-boot", "--timeout", "150")
        server = _edgefl("server", "--broker", broker, "--config", str(config), "--out", str(tmp_path / "run"))
        try:
            assert server.wait(timeout=180) == 0, server.stderr.read()[-2000:]
            code, stderr = early.wait(timeout=60), early.stderr.read()
            assert code == 0 and "trying again in" in stderr, stderr[-2000:]
            assert late.wait(timeout=60) == 0
        finally:
            for p in (early, late, server):
                if p.poll() is None:
                    p.kill()
    finally:
        local.stop()


def _held_parts(groups: list[dict], **train):
    from edgefl.build import build_run

    _fashion()
    cfg = RunConfig.model_validate({"method": {"name": "fedavg"}, "data": {"dataset": "fashion-mnist", "partition": "devices"},
                                    "fleet": {"groups": groups}, "train": train})
    return build_run(cfg)


def test_the_server_refuses_a_device_whose_profile_cannot_train_its_model_saying_what_would_fit():
    from edgefl.profile import load_profile
    from edgefl.server.enrolment import Enrolment
    from edgefl.task import parse_task

    enrolment = Enrolment(_held_parts([{"model": "resnet18", "count": 3}]), "fed")
    task, why = enrolment.hello("client-0", {"profile": load_profile("esp32-s3").to_dict()}, "run-1")
    assert task is None and "cannot train resnet18" in why and "too small for any zoo model" in why
    task, why = enrolment.hello("client-1", {"profile": load_profile("wristband-mcu").to_dict()}, "run-1")
    assert task is None and "the largest model it could train is" in why
    assert enrolment.declined() == ["client-0", "client-1"]
    task, why = enrolment.hello("client-2", {"profile": load_profile("pi4-4gb").to_dict()}, "run-1")
    assert why == "" and task.model.name == "resnet18" and task.device == "client-2" and task.run == "run-1"
    assert parse_task(task.to_info()) == task  # what travels is what was meant
    assert task.data.class_names[0] == "T-shirt/top" and task.data.input_shape == [1, 28, 28] and task.data.pixel_divisor == 255.0
    _, why = enrolment.hello("client-2", {"profile": {"id": "x"}}, "run-1")
    assert "not a valid device profile" in why


def test_ready_reports_are_checked_like_uploads():
    from edgefl.server.enrolment import Enrolment

    enrolment = Enrolment(_held_parts([{"model": "lenet5", "count": 2}]), "fed")
    enrolment.hello("client-0", {}, "run-1")
    good = {"samples": 30, "validation": 3, "class_counts": [10, 20] + [0] * 8}
    for bad, why in [({**good, "samples": 0}, "positive"), ({**good, "samples": True}, "positive"), ({**good, "validation": 31}, "between"),
                     ({**good, "class_counts": [30]}, "10 non-negative"), ({**good, "class_counts": [10, 19] + [0] * 8}, "sum to 29"),
                     ({**good, "class_counts": [-1, 31] + [0] * 8}, "non-negative")]:
        assert why in enrolment.ready_report("client-0", bad)[0]
    assert enrolment.ready() == []
    assert enrolment.ready_report("client-0", good) == ("", "") and enrolment.ready() == ["client-0"]
    assert enrolment.ready_report("client-0", good) == ("", "")  # a restart with the same data: nothing to say
    snapshot = enrolment.snapshot()
    again = Enrolment(enrolment.parts, "fed")
    again.restore(snapshot)  # what a resumed server knows of the devices that had joined
    assert again.ready() == ["client-0"] and again.devices["client-0"].class_counts == good["class_counts"]


def test_a_ready_device_is_not_evicted_by_a_decline_and_other_data_is_named():
    """Two processes started with one device id: the second's decline must not drop the one that
    trains from the run, and a second ready with other data says what changed."""
    from edgefl.server.enrolment import Enrolment

    enrolment = Enrolment(_held_parts([{"model": "lenet5", "count": 2}]), "fed")
    enrolment.hello("client-0", {}, "run-1")
    good = {"samples": 30, "validation": 3, "class_counts": [10, 20] + [0] * 8}
    assert enrolment.ready_report("client-0", good) == ("", "")
    enrolment.hello("client-0", {}, "run-1")  # the second process asks for its task: the registration stays ready
    assert enrolment.decline("client-0", {"reason": "/tmp/nope.npz does not exist"}) == ("/tmp/nope.npz does not exist", True)
    assert enrolment.ready() == ["client-0"] and enrolment.declined() == []
    assert enrolment.decline("client-1", {"reason": "no data"}) == ("no data", False)  # not ready: declined
    assert enrolment.declined() == ["client-1"]
    other = {"samples": 20, "validation": 2, "class_counts": [20] + [0] * 9}
    assert enrolment.ready_report("client-0", other) == ("", "30 samples before, 20 now")


def test_a_device_that_cannot_build_its_task_declines_telling_the_server_why(tmp_path, monkeypatch):
    """The server builds every task's client half before it starts, but a device's own build can
    still refuse (another edgefl version, its own data): the device declines with the reason, and
    the server hears it, instead of the device exiting alone."""
    from edgefl import enrol
    from edgefl.data import load_dataset
    from edgefl.errors import ConfigError
    from edgefl.server.enrolment import Enrolment

    task = Enrolment(_held_parts([{"model": "lenet5", "count": 2}]), "fed").task("client-0", "run-1")
    write_image_folder(tmp_path / "data", load_dataset("fashion-mnist"), [0, 1], 5, 0)
    told: list[tuple[str, dict]] = []

    class Joiner:
        def __init__(self, *args, **kwargs):
            pass

        def ask_task(self, timeout_s):
            return task

        def confirm(self, stage, task, timeout_s, **facts):
            told.append((stage, facts))

    def refuse(*args, **kwargs):
        raise ConfigError("CHFL aggregates heads after every local epoch", hint="set train.epochs = 1")

    monkeypatch.setattr(enrol, "Joiner", Joiner)
    monkeypatch.setattr(enrol, "build_client_from_task", refuse)
    with pytest.raises(enrol.Declined, match="client-0 cannot take part: the task it was given: CHFL aggregates") as caught:
        enrol.join_run(None, "client-0", "fed", tmp_path / "data")
    assert caught.value.hint == "set train.epochs = 1"
    assert told == [("decline", {"reason": "the task it was given: CHFL aggregates heads after every local epoch"})]


@pytest.mark.parametrize("change,expected", [
    ({"rounds": 10**9}, "rounds"), ({"seed": -1}, "seed"), ({"method": {"name": "nope", "options": {}}}, "unknown method"),
    ({"model": {"name": "resnet999", "options": {}, "arch": "x"}}, "not a model"), ({"extra": 1}, "extra"),
    ({"data": {"kind": "image", "class_names": ["a"], "input_shape": [1, 28, 28]}}, "class_names"),
    ({"train": {"epochs": 1.0}}, "epochs"),
])
def test_a_hostile_task_is_refused_with_the_field_named(change, expected):
    from edgefl.errors import PayloadError
    from edgefl.server.enrolment import Enrolment
    from edgefl.task import parse_task

    task = Enrolment(_held_parts([{"model": "lenet5", "count": 2}]), "fed").task("client-0", "run-1").to_info()
    with pytest.raises(PayloadError, match=expected):
        parse_task({**task, **change})
    with pytest.raises(PayloadError):
        parse_task(["not", "a", "task"])


def test_asking_for_a_task_gives_up_at_its_timeout_not_after_the_next_wait():
    """The hellos wait 2, 4, 8 ... s for an answer; the last wait is cut to what is left of --timeout."""
    import time

    from edgefl.enrol import Joiner
    from edgefl.errors import EdgeflError
    from edgefl.transport.memory import MemoryDeviceTransport, hub
    from edgefl.transport.topics import Topics

    transport = MemoryDeviceTransport(hub("no-server"), Topics("no-server"), "client-0")
    t0 = time.monotonic()
    with pytest.raises(EdgeflError, match="no task from the server of federation 'no-server' within 3 s"):
        Joiner(transport, "client-0", "no-server", say=lambda text: None).ask_task(timeout_s=3)
    assert time.monotonic() - t0 < 5  # uncut, the second wait (4 s) would end after 6 s
    transport.close()


def test_a_resumed_server_waits_for_its_ready_devices_to_be_back_online():
    """A resumed run restores who was ready; before round 1 it counted them as joined at once and
    said "2 devices ready" with none connected. They count once they are online again."""
    import time

    from edgefl.config import NetworkSettings
    from edgefl.methods import METHODS
    from edgefl.server.endpoint import ServerEndpoint
    from edgefl.server.enrolment import Enrolment
    from edgefl.transport.memory import MemoryDeviceTransport, MemoryServerTransport, hub
    from edgefl.transport.topics import Topics

    parts = _held_parts([{"model": "lenet5", "count": 2}])
    before = Enrolment(parts, "fed")
    good = {"samples": 30, "validation": 3, "class_counts": [10, 20] + [0] * 8}
    for device in ("client-0", "client-1"):
        before.hello(device, {}, "run-1")
        assert before.ready_report(device, good) == ("", "")
    resumed = Enrolment(parts, "fed")
    resumed.restore(before.snapshot())
    name = "resumed-ready"
    topics = Topics(name)
    endpoint = ServerEndpoint(NetworkSettings(), METHODS["fedavg"], MemoryServerTransport(hub(name), topics), ["client-0", "client-1"],
                              name, num_classes=10, max_epochs=1, partial_max_age_s=60, enrolment=resumed)
    assert endpoint.joined() == 0 and endpoint.ready_online() == []  # ready before the restart, not connected yet
    device = MemoryDeviceTransport(hub(name), topics, "client-1")
    end = time.monotonic() + 5
    while endpoint.joined() < 1 and time.monotonic() < end:
        endpoint.pump(0.1)
    assert endpoint.joined() == 1 and endpoint.ready_online() == ["client-1"]
    device.close()


def test_a_run_every_device_declines_ends_at_once_with_their_reasons(tmp_path):
    """An outside trial saw a server play all its rounds with no device ('no quorum' 150 times) after
    every device had declined: it now ends before round 1, naming why each declined."""
    from edgefl.data import load_dataset

    ds = load_dataset("fashion-mnist")
    data = {}
    for device, offset in (("client-0", 0), ("client-1", 50)):
        data[device] = tmp_path / "devices" / device
        write_image_folder(data[device], ds, [0, 1], 5, offset, "unicorn")
    config = _config(tmp_path, "fedavg", [{"model": "lenet5", "count": 2}], "all-declined", dataset="fashion-mnist", test_samples=100)
    server, outcome, run = _run_fleet(tmp_path, config, "all-declined", data)
    said = " ".join(server.stderr.read().split())
    assert server.returncode != 0 and "every device declined the run" in said and "unicorn" in said, said[-2000:]
    assert "client-0:" in said and "client-1:" in said  # each with its reason
    assert not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip()  # no round was played
    assert all(code == 2 for code, _ in outcome.values())


def test_a_task_every_device_would_refuse_is_refused_when_the_server_starts(tmp_path):
    """CHFL with two local epochs a round: `edgefl simulate` refuses it, and so does the server of a
    fleet whose devices hold their data, at once, not each device after the run began waiting."""
    groups = [{"model": "mlp", "count": 2, "options": {"hidden": [16], "feature_dim": 64}}]
    path = _config(tmp_path, "chfl", groups, "two-epochs", dataset="breast-cancer")
    text = path.read_text().replace("epochs = 1", "epochs = 2")
    assert "epochs = 2" in text
    path.write_text(text)
    res = subprocess.run([sys.executable, "-m", "edgefl", "server", "--broker", "mqtt://127.0.0.1:9", "--config", str(path),
                          "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "CHFL aggregates heads after every local epoch" in res.stderr and "train.epochs = 1" in res.stderr
    assert not (tmp_path / "run").exists()
