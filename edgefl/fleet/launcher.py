"""Entry points of a fleet run: the server, one device, and a whole fleet on one machine.

* :func:`serve` -- ``edgefl server``: the method's server half over MQTT (the GPU machine);
* :func:`run_device` -- ``edgefl client``: one device's client half over MQTT (a Pi);
* :func:`run_fleet` -- ``edgefl fleet``: a broker, the server and one process per device.

A device builds its data, model and client half from the same config and device id the
simulation uses (``edgefl.sim.setup``), so a fleet and a simulation of one config hold identical
devices.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from edgefl.config import RunConfig
from edgefl.data import load_dataset
from edgefl.environment import machine, package_versions
from edgefl.errors import ConfigError
from edgefl.rundir import RunDir
from edgefl.sim.setup import build_client, build_server, check_models_fit, device_slots, pooled, test_subset
from edgefl.server.state import load_state, save_state
from edgefl.transport.link import BrokerAddress, Link
from edgefl.transport.topics import Topics, device_ids


def _dataset(cfg: RunConfig):
    ds = load_dataset(cfg.data.dataset, cfg.data.data_dir, cfg.data.download)
    return pooled(ds) if cfg.data.client_test_fraction else ds


def federation(cfg: RunConfig) -> str:
    return cfg.network.federation or cfg.name


def run_device(cfg: RunConfig, device_id: str, broker: str, timeout_s: float | None = None,
               username: str | None = None, password: str | None = None, ca_file: str | None = None) -> dict[int, dict[str, Any]]:
    """Serve one device until the server's run is done."""
    from edgefl.fleet.device import DeviceRunner

    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    ds = _dataset(cfg)
    slots = {s.client_id: s for s in device_slots(cfg, ds)}
    if device_id not in slots:
        raise ConfigError(f"device {device_id!r} is not in this config's fleet",
                          hint=f"device ids are {min(slots)} .. {max(slots)}")
    client = build_client(cfg, ds, slots[device_id])
    x_test, y_test = test_subset(cfg, ds)
    topics = Topics(federation(cfg))
    link = Link(BrokerAddress.parse(broker), f"edgefl-{topics.federation}-{device_id}",
                [topics.down(device_id), topics.rounds], topics.presence(device_id),
                username=username, password=password, ca_file=ca_file, protocol=cfg.network.protocol,
                max_packet_bytes=_packet_limit(cfg), keepalive_s=cfg.network.keepalive_s).start()
    try:
        return DeviceRunner(cfg, client, link, x_test, y_test).run(timeout_s)
    finally:
        link.stop()


def serve(cfg: RunConfig, broker: str, run_dir: RunDir | None, console: Console | None = None,
          on_event: Callable[[str, dict[str, Any]], None] | None = None,
          username: str | None = None, password: str | None = None, ca_file: str | None = None,
          join_timeout_s: float | None = None, resume: bool = False) -> dict[str, Any]:
    """Run the server side of ``cfg`` against the devices that join through ``broker``."""
    from edgefl.server.orchestrator import FleetServer

    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    ds = _dataset(cfg)
    slots = device_slots(cfg, ds)
    check_models_fit(cfg, ds, slots)
    server = build_server(cfg, ds, slots)
    x_test, y_test = test_subset(cfg, ds)
    restored = _restore(cfg, server, run_dir) if resume else None
    topics = Topics(federation(cfg))
    link = Link(BrokerAddress.parse(broker), f"edgefl-{topics.federation}-server", [topics.all_up, topics.all_presence],
                topics.presence("server"), username=username, password=password, ca_file=ca_file,
                protocol=cfg.network.protocol, max_packet_bytes=_packet_limit(cfg), keepalive_s=cfg.network.keepalive_s).start()
    start = {"name": cfg.name, "method": cfg.method.name, "seed": cfg.seed, "runner": "fleet", "broker": broker,
             "federation": topics.federation, "versions": package_versions(), "machine": machine(),
             "dataset": {"name": ds.name, "source": ds.source, "train": len(ds.y_train), "test_used": len(y_test)},
             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if run_dir and not resume:
        (run_dir.path / "config.toml").write_text(cfg.to_toml())
        run_dir.write_json("run.json", start)
    t0 = time.perf_counter()
    fleet = FleetServer(cfg, server, [s.client_id for s in slots], link, x_test, y_test, on_event)
    first = 1
    if restored is not None:
        extra, fleet.history = restored
        fleet.device_accuracy = dict(extra.get("device_accuracy") or {})
        fleet.last_round = int(extra["round"])
        first = fleet.last_round + 1
        if on_event:
            on_event("resumed", {"round": first})
    try:
        fleet.wait_for_devices(join_timeout_s if join_timeout_s is not None else cfg.network.round_deadline_s)
        for r in range(first, cfg.rounds + 1):
            record = fleet.run_round(r)
            if run_dir:
                run_dir.append_metrics({**record, "elapsed_s": round(time.perf_counter() - t0, 3)})
                # after every round, so a restarted server resumes where this one stopped
                save_state(server, run_dir.path / STATE_FILE, {"round": r, "config_sha256": _config_digest(cfg),
                                                                "device_accuracy": fleet.device_accuracy})
        fleet.announce(cfg.rounds, {"done": True, "rounds": cfg.rounds})
    finally:
        link.stop()
    evaluated = [h for h in fleet.history if h["accuracy"]]
    summary = {**start, "rounds": cfg.rounds, "final_accuracy": evaluated[-1]["accuracy"] if evaluated else None,
               "failed_rounds": [h["round"] for h in fleet.history if h["outcome"] == "failed"],
               "rejections": len(fleet.rejections), "bytes_up_total": sum(h["bytes_up"] for h in fleet.history),
               "bytes_down_total": sum(h["bytes_down"] for h in fleet.history), "wall_time_s": round(time.perf_counter() - t0, 3),
               "run_dir": str(run_dir.path) if run_dir else None}
    if run_dir:
        from edgefl.sim.engine import save_global_models

        save_global_models(run_dir, server, cfg, ds)
        run_dir.write_json("summary.json", summary)
    summary["history"] = fleet.history
    return summary


def run_fleet(cfg: RunConfig, config_path: Path | None, run_dir: RunDir | None, console: Console | None = None,
              broker: str | None = None, device_timeout_s: float = 600.0, broker_kind: str = "auto",
              on_event: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """A broker (mosquitto on a free loopback port unless ``broker`` is given), the server in this
    process and one ``edgefl client`` process per device."""
    from edgefl.fleet.broker import mosquitto_binary, start_embedded, start_mosquitto

    console = console or Console(stderr=True)
    work = Path(tempfile.mkdtemp(prefix="edgefl-fleet-"))
    local = None
    if broker is None:
        if broker_kind == "mosquitto" or (broker_kind == "auto" and mosquitto_binary() is not None):
            local = start_mosquitto(work / "broker", max_packet_bytes=_packet_limit(cfg))
            console.print(f"broker: mosquitto at {local.url} (log {work / 'broker' / 'mosquitto.log'})")
        else:
            local = start_embedded(work / "broker")
            console.print(f"[yellow]warning:[/] no mosquitto binary: using the embedded pure-Python broker at {local.url} "
                          "(MQTT 3.1.1, loopback only, slower; apt-get install mosquitto for real runs)")
            cfg = cfg.model_copy(update={"network": cfg.network.model_copy(update={"protocol": "3.1.1"})})
        broker = local.url
    if config_path is None or cfg.network.federation is None:
        cfg = cfg.model_copy(update={"network": cfg.network.model_copy(update={"federation": cfg.network.federation or _fed_name(cfg)})})
    config_path = work / "config.toml"
    config_path.write_text(cfg.to_toml())
    ids = device_ids(cfg.fleet.num_clients)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: dict[str, subprocess.Popen] = {}
    logs = work / "devices"
    logs.mkdir()
    try:
        for device in ids:
            with open(logs / f"{device}.log", "wb") as log:
                procs[device] = subprocess.Popen(
                    [sys.executable, "-m", "edgefl", "client", "--broker", broker, "--config", str(config_path),
                     "--device-id", device, "--timeout", str(device_timeout_s)],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        console.print(f"started {len(procs)} device processes (logs in {logs})")
        summary = serve(cfg, broker, run_dir, console, on_event)
        deadline = time.monotonic() + 60
        for device, proc in procs.items():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                console.print(f"[yellow]{device} did not exit after the run: stopping it[/]")
        summary["device_exit_codes"] = {d: p.poll() for d, p in procs.items()}
        summary["logs"] = str(logs)
        return summary
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        if local is not None:
            local.stop()


STATE_FILE = "server-state.safetensors"


def _config_digest(cfg: RunConfig) -> str:
    import hashlib

    return hashlib.sha256(cfg.to_toml().encode()).hexdigest()


def _restore(cfg: RunConfig, server, run_dir: RunDir | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Restore the server half from the run directory (before any connection is made); returns the
    saved extras and the metrics of the rounds that state covers."""
    import json

    if run_dir is None or not (run_dir.path / STATE_FILE).is_file():
        raise ConfigError("nothing to resume: the run directory holds no server state",
                          hint="pass the --out folder of the interrupted run, or drop --resume")
    extra = load_state(server, run_dir.path / STATE_FILE)
    if extra.get("config_sha256") != _config_digest(cfg):
        raise ConfigError("the saved server state belongs to another config", hint="resume with the interrupted run's config.toml")
    done = int(extra["round"])
    metrics = run_dir.path / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    history = [h for h in lines if h["round"] <= done]
    if len(lines) != len(history):  # a round recorded after the state was saved: rewrite without it
        metrics.write_text("".join(json.dumps(h) + "\n" for h in history))
    return extra, history


def _packet_limit(cfg: RunConfig) -> int:
    """The broker's packet limit: one chunk (or one unchunked message) plus headroom for the envelope."""
    from edgefl.fleet.broker import MQTT_MAX_PACKET

    return min(max(cfg.network.chunk_bytes, cfg.network.chunk_threshold) + (1 << 16), MQTT_MAX_PACKET)


def _fed_name(cfg: RunConfig) -> str:
    import re
    import uuid

    base = re.sub(r"[^A-Za-z0-9_.-]", "-", cfg.name)[:40]
    return f"{base}-{uuid.uuid4().hex[:8]}"

