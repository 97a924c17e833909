"""A device written in another language from docs/PROTOCOL.md alone takes part in a real fleet.

tests/foreign_device/device.js is a Node.js device written only from the document (and
docs/config.md), never from the Python sources: it speaks MQTT through the npm `mqtt` package,
builds envelopes and safetensors bodies by hand and fabricates FedHe's per-class logits. Here two
of them play a two-round FedHe run against the real `edgefl server` over a real mosquitto; the
server must accept every upload (a refusal would mean the document, or the device, is wrong) and
the devices must stop by themselves on the final announcement. A second test rebuilds the
document's worked examples with the JavaScript encoder, byte for byte.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.mosquitto import mosquitto

HERE = Path(__file__).resolve().parent
DEVICE_DIR = HERE / "foreign_device"
ROOT = HERE.parent

DEVICES = {"client-0": 300, "client-1": 200}  # device id -> the num_samples it reports


@pytest.fixture(scope="module")
def node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (the foreign device is JavaScript)")
    if not (DEVICE_DIR / "node_modules" / "mqtt").is_dir():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: cannot install the foreign device's mqtt package")
        try:
            done = subprocess.run([npm, "ci", "--prefix", str(DEVICE_DIR), "--no-audit", "--no-fund"],
                                  capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            pytest.skip("npm ci did not finish in 180 s")
        if done.returncode != 0:
            pytest.skip(f"npm ci failed (no registry?): {done.stderr[-500:]}")
    return node


def run_config(federation: str, rounds: int = 2, protocol: str = "5", offline_grace_s: float = 10) -> str:
    return f"""\
name = "foreign-device"
seed = 0
rounds = {rounds}
threads = 1

[method]
name = "fedhe"

[data]
dataset = "digits"
partition = "dirichlet"
alpha = 0.5
min_samples = 20

[train]
epochs = 1
batch_size = 32
lr = 0.003

[eval]
every = 1

[[fleet.groups]]
model = "mlp"
count = {len(DEVICES)}
options = {{ hidden = [32, 16] }}

[network]
federation = "{federation}"
protocol = "{protocol}"
round_deadline_s = 30
offline_grace_s = {offline_grace_s}
"""


def play(node: str, tmp_path: Path, config: str, federation: str, extra_args: dict[str, list[str]] | None = None):
    """Start mosquitto, the JS devices, then `edgefl server`; return the server's result, the
    devices' exit codes and logs, and the run's per-round metrics."""
    path = tmp_path / "run.toml"
    path.write_text(config)
    out = tmp_path / "run"
    logs = {dev: tmp_path / f"{dev}.log" for dev in DEVICES}
    protocol = "3.1.1" if 'protocol = "3.1.1"' in config else "5"
    with mosquitto(tmp_path) as broker:
        devices = {}
        for dev, samples in DEVICES.items():
            args = [node, str(DEVICE_DIR / "device.js"), "--broker", broker, "--federation", federation,
                    "--device-id", dev, "--num-samples", str(samples), "--protocol", protocol, "--timeout", "90"]
            devices[dev] = subprocess.Popen(args + (extra_args or {}).get(dev, []), stdout=logs[dev].open("w"),
                                            stderr=subprocess.STDOUT)
        server = subprocess.run([sys.executable, "-m", "edgefl", "server", "--broker", broker, "--config", str(path),
                                 "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
        codes = {}
        for dev, proc in devices.items():
            try:
                codes[dev] = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes[dev] = "still running 30 s after the server ended"
    texts = {dev: p.read_text() for dev, p in logs.items()}
    shown = "\n".join(f"--- {dev}\n{text}" for dev, text in texts.items())
    assert server.returncode == 0, server.stdout[-3000:] + server.stderr[-3000:] + shown
    metrics = out / "metrics.jsonl"
    rounds = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return codes, texts, shown, [r for r in rounds if "outcome" in r]


def test_the_documented_examples_are_rebuilt_byte_for_byte_in_javascript(node):
    done = subprocess.run([node, str(DEVICE_DIR / "selftest.js")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every example matches" in done.stdout


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_javascript_devices_play_a_fedhe_run_against_the_real_server(node, tmp_path, protocol):
    federation = f"js-{uuid.uuid4().hex[:8]}"
    codes, texts, shown, rounds = play(node, tmp_path, run_config(federation, protocol=protocol), federation)
    assert codes == {dev: 0 for dev in DEVICES}, shown  # each stopped by itself on the final announcement
    assert [r["round"] for r in rounds] == [1, 2], rounds
    for r in rounds:
        assert r["outcome"] == "complete", r
        assert sorted(r["reported"]) == sorted(DEVICES), r
        assert r["receipts"] == {dev: "accepted" for dev in DEVICES}, r
        assert r["rejected"]["count"] == 0, r
        # FedHe is judged by the devices' own reports (info.evaluate): the fabricated 0.5
        assert r["accuracy"]["per_client"] == {dev: 0.5 for dev in DEVICES}, r
        assert r["bytes_up_per_client"].keys() == DEVICES.keys(), r
    for text in texts.values():
        assert text.count("ack accepted") == 2, text
        assert "(no tensors, evaluate)" in text and "(with tensors, evaluate)" in text, text  # both FedHe downloads
        assert "refused" not in text and "fatal" not in text, text


def test_a_refused_upload_stops_the_device_with_the_servers_reason(node, tmp_path):
    """client-1 counts every sample twice (--epochs 2 while the config trains 1 epoch): its
    `counts` exceed num_samples x train.epochs (PROTOCOL.md 4.3), the server nacks it with a reason,
    and the device exits non-zero; client-0 is accepted and the round still closes."""
    federation = f"js-{uuid.uuid4().hex[:8]}"
    config = run_config(federation, rounds=1, offline_grace_s=1)
    codes, texts, shown, rounds = play(node, tmp_path, config, federation, {"client-1": ["--epochs", "2"]})
    assert codes == {"client-0": 0, "client-1": 3}, shown
    assert "refused: class counts sum to 400, more than" in texts["client-1"], shown
    (r,) = rounds
    assert r["receipts"]["client-0"] == "accepted" and r["reported"] == ["client-0"], r
    assert r["rejected"]["by_sender"] == {"client-1": 1}, r
