"""One server, thousands of devices (issue: protocol-level load and over-selection).

For each (connected devices, target per round) pair: a mosquitto (or the broker given), the real
``edgefl server`` process, and ``edgefl loadgen`` processes playing the devices (each device its
own MQTT connection, session and device loop; uploads made by one real client half per
architecture). Rounds select ``per_round x (1 + over_select)`` devices from those online and
close at ``per_round`` accepted updates; the rest are answered ``late``. Reported per pair:

* close latency: from the publish of the last upload a round counted (the load generator's clock)
  to the round's close (the server's ``closed_unix``), per round and the worst;
* server CPU seconds and peak RSS, broker peak RSS, load-generator peak RSS;
* updates lost (acked ``accepted`` by the server but not counted, counted but never acked, or
  published before the close and never answered) and counted twice: both must be 0.

    python bench/scale.py --devices 1000 5000 10000 --per-round 100 1000
    python bench/scale.py --devices 1000 --per-round 100 --method fedavg   # 1 MB weight uploads
    python bench/scale.py --devices 2000 --per-round 200 --bridge          # devices on a second, bridged mosquitto
    python bench/scale.py --devices 2000 --per-round 200 --broker mqtt://127.0.0.1:1884 --tag rabbitmq
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import tomli_w
from common import save, users_path

from edgefl.fleet.broker import start_mosquitto
from edgefl.fleet.swarm import raise_open_files

ROOT = Path(__file__).resolve().parent.parent
EDGEFL = [sys.executable, "-m", "edgefl"]


def scale_config(devices: int, per_round: int, over_select: float, rounds: int, method: str, federation: str,
                 protocol: str = "5") -> dict[str, Any]:
    """FedHe's ten CNNs (or FedAvg on one CNN whose weights are 1.02 MiB) over ``devices``
    devices with an IID share each; short local training: the load is the protocol's."""
    if method == "fedhe":
        groups = [{"model": f"fedhe-cnn-{i}", "count": devices // 10 + (i < devices % 10), "options": {"width": 0.25}} for i in range(10)]
        method_table: dict[str, Any] = {"name": "fedhe", "alpha": 1.0, "logit_loss": "mse"}
    else:
        groups = [{"model": "fedhe-cnn-2", "count": devices, "options": {"width": 0.25}}]  # 1.02 MiB of weights
        method_table = {"name": "fedavg"}
    return {
        "name": f"scale-{method}-{devices}", "seed": 0, "rounds": rounds, "method": method_table,
        "data": {"dataset": "fashion-mnist", "partition": "iid", "test_samples": 500},
        "train": {"epochs": 1, "batch_size": 8, "max_steps": 2},
        # the load is the training protocol's: idle devices are not asked to judge their models
        "eval": {"every": rounds, "unselected": "last_reported"},
        "fleet": {"groups": groups, "per_round": per_round, "over_select": over_select},
        # joining ten thousand devices takes a while: the server's join wait is the round deadline
        "network": {"federation": federation, "round_deadline_s": 300.0, "keepalive_s": 120, "ack_timeout_s": 30.0, "protocol": protocol},
    }


class PeakMemory:
    """Samples processes' RSS every ``every_s`` and keeps each one's peak (and the server's CPU)."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self.procs: dict[str, list[psutil.Process]] = {}
        self.peak: dict[str, int] = {}
        self.cpu: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, name: str, pid: int) -> None:
        self.procs.setdefault(name, []).append(psutil.Process(pid))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for name, procs in list(self.procs.items()):
                total, cpu = 0, 0.0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                        t = p.cpu_times()
                        cpu += t.user + t.system
                    except psutil.Error:
                        continue
                self.peak[name] = max(self.peak.get(name, 0), total)
                self.cpu[name] = max(self.cpu.get(name, 0.0), cpu)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def start_bridge(work: Path, upstream_port: int, packet: int) -> Any:
    """A second mosquitto the devices connect to, bridged to the server's broker for the
    federation's topics in both directions (retained announcements and presence included)."""
    extra = (f"connection edge-to-core\naddress 127.0.0.1:{upstream_port}\ntopic edgefl/v1/# both 1\n"
             "cleansession false\nbridge_protocol_version mqttv50\ntry_private true\n")
    return start_mosquitto(work / "edge", extra_config=extra, max_packet_bytes=packet)


def start_server(args: argparse.Namespace, broker: str, cfg_path: Path, run_dir: Path, log_path: Path, env: dict[str, str],
                 mem: PeakMemory) -> subprocess.Popen:
    """The real ``edgefl server`` process; with ``--server-first`` this returns once it waits for
    devices (a broker that replays no retained presence to wildcard subscriptions, as RabbitMQ,
    needs devices to come online after the server subscribed)."""
    profile = ["-m", "cProfile", "-o", str(args.profile_server)] if args.profile_server else []
    with open(log_path, "wb") as log:
        server = subprocess.Popen([sys.executable, *profile, "-m", "edgefl", "server", "--broker", broker, "--config", str(cfg_path),
                                   "--out", str(run_dir)], stdout=log, stderr=subprocess.STDOUT, env=env)
    mem.watch("server", server.pid)
    if args.server_first:
        end = time.time() + 120
        while b"waiting for" not in log_path.read_bytes():
            if server.poll() is not None or time.time() > end:
                raise SystemExit(f"the server did not start; its log: {log_path}")
            time.sleep(0.2)
        time.sleep(1.0)  # it prints before it subscribes
    return server


def one_case(devices: int, per_round: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    federation = f"scale-{uuid.uuid4().hex[:8]}"
    raw = scale_config(devices, per_round, args.over_select, args.rounds, args.method, federation, args.protocol)
    cfg_path = work / f"config-{devices}-{per_round}.toml"
    cfg_path.write_text(tomli_w.dumps(raw))
    packet = (1 << 20) + (1 << 16)
    core = edge = None
    if args.broker:
        server_broker = device_broker = args.broker
    else:
        core = start_mosquitto(work / f"core-{devices}-{per_round}", max_packet_bytes=packet)
        server_broker = device_broker = core.url
        if args.bridge:
            edge = start_bridge(work / f"bridge-{devices}-{per_round}", core.port, packet)
            device_broker = edge.url
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run_dir = work / f"run-{devices}-{per_round}"
    per_proc = -(-devices // args.processes)
    gens, stats_files, logs = [], [], []
    with PeakMemory() as mem:
        for name, b in (("broker", core), ("edge broker", edge)):
            if b is not None:
                mem.watch(name, b.process.pid)
        if args.broker_pid:
            mem.watch("broker", args.broker_pid)
        t0 = time.time()
        server_log_path = work / f"server-{devices}-{per_round}.log"
        server = None
        if args.server_first:
            server = start_server(args, server_broker, cfg_path, run_dir, server_log_path, env, mem)
        for i in range(args.processes):
            a, b = i * per_proc, min(devices, (i + 1) * per_proc)
            stats = work / f"loadgen-{devices}-{per_round}-{i}.json"
            log = open(work / f"loadgen-{devices}-{per_round}-{i}.log", "wb")
            command = [*EDGEFL, "loadgen", "--broker", device_broker, "--config", str(cfg_path), "--devices", f"{a}:{b}",
                       "--compute-s", str(args.compute_s), "--dropout", str(args.dropout), "--seed", str(i),
                       "--connect-per-s", str(args.connect_per_s), "--stats", str(stats), "--timeout", str(args.timeout)]
            gens.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
            stats_files.append(stats)
            logs.append(log)
            mem.watch("loadgen", gens[-1].pid)
        if server is None:
            server = start_server(args, server_broker, cfg_path, run_dir, server_log_path, env, mem)
        try:
            server_rc = server.wait(timeout=args.timeout)
            gen_rcs = [g.wait(timeout=120) for g in gens]
        finally:
            for p in [server, *gens]:
                if p.poll() is None:
                    p.kill()
            for log in logs:
                log.close()
        wall = time.time() - t0
    for b in (edge, core):
        if b is not None:
            b.stop()
    if server_rc != 0:
        raise SystemExit(f"the server failed ({server_rc}); its log: {work / f'server-{devices}-{per_round}.log'}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gen_stats = [json.loads(s.read_text()) for s in stats_files if s.exists()]
    return judge(devices, per_round, metrics, gen_stats, mem, wall, gen_rcs)


def judge(devices: int, per_round: int, metrics: list[dict[str, Any]], gen_stats: list[dict[str, Any]], mem: PeakMemory,
          wall: float, gen_rcs: list[int]) -> dict[str, Any]:
    rounds = []
    lost = twice = 0
    for m in metrics:
        r = m["round"]
        acked: list[str] = []
        last_publish, unanswered, late, published = None, 0, 0, 0
        for g in gen_stats:
            row = g["rounds"].get(str(r)) or {}
            acked += row.get("accepted_devices", [])
            # published before the round closed and never answered: lost (after the close of the
            # last round nobody answers, and that is no loss)
            unanswered += sum(t < (m["closed_unix"] or 0) for t in row.get("unanswered_published_unix", []))
            late += row.get("late", 0)
            published += row.get("published", 0)
            t = row.get("last_accepted_publish_unix")
            if t is not None:
                last_publish = t if last_publish is None else max(last_publish, t)
        counted = [d for d, receipt in m["receipts"].items() if receipt == "accepted"]
        twice += len(counted) - len(set(counted)) + max(0, m["accepted"] - len(set(counted)))
        lost += len(set(acked) ^ set(counted)) + unanswered
        latency = None if last_publish is None or m["closed_unix"] is None else m["closed_unix"] - last_publish
        rounds.append({"round": r, "outcome": m["outcome"], "selected": len(m["selected"]), "target": m["target"],
                       "accepted": m["accepted"], "late": late, "published": published, "unanswered": unanswered,
                       "close_after_last_needed_s": None if latency is None else round(latency, 3),
                       "round_time_s": m["round_time_s"]})
    latencies = [r["close_after_last_needed_s"] for r in rounds if r["close_after_last_needed_s"] is not None]
    return {
        "devices": devices, "per_round": per_round, "rounds": rounds,
        "worst_close_after_last_needed_s": max(latencies) if latencies else None,
        "lost": lost, "counted_twice": twice,
        "server_cpu_s": round(mem.cpu.get("server", 0.0), 2), "server_peak_rss_mib": round(mem.peak.get("server", 0) / 2**20, 1),
        "broker_peak_rss_mib": round(mem.peak.get("broker", 0) / 2**20, 1),
        "edge_broker_peak_rss_mib": round(mem.peak.get("edge broker", 0) / 2**20, 1) if "edge broker" in mem.peak else None,
        "loadgen_peak_rss_mib": round(mem.peak.get("loadgen", 0) / 2**20, 1),
        "connect_s": max((g.get("connect_s", 0) for g in gen_stats), default=None),
        "loadgen_exit_codes": gen_rcs, "wall_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[1000, 5000, 10000])
    p.add_argument("--per-round", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--over-select", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--method", choices=["fedhe", "fedavg"], default="fedhe")
    p.add_argument("--compute-s", type=float, default=2.0, help="median seconds from download to upload")
    p.add_argument("--dropout", type=float, default=0.08, help="share of selected devices that drop out mid-round")
    p.add_argument("--connect-per-s", type=float, default=2000.0, help="connections each load generator opens per second")
    p.add_argument("--processes", type=int, default=2, help="load-generator processes (devices split between them)")
    p.add_argument("--broker", help="use this broker for server and devices (e.g. RabbitMQ's MQTT plugin)")
    p.add_argument("--broker-pid", type=int, help="the given broker's process, to measure its memory (RabbitMQ: beam.smp)")
    p.add_argument("--protocol", choices=["5", "3.1.1"], default="5", help="MQTT version (RabbitMQ 3.10's plugin speaks 3.1.1)")
    p.add_argument("--server-first", action="store_true", help="start the server before the devices (needed where retained "
                                                                "presence is not replayed to wildcard subscriptions: RabbitMQ)")
    p.add_argument("--bridge", action="store_true", help="devices on a second mosquitto bridged to the server's")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--profile-server", type=users_path, help="run the server under cProfile, writing its statistics here")
    p.add_argument("--keep", type=users_path, help="keep logs, configs, run directories and load-generator stats in this folder")
    p.add_argument("--tag", default="", help="names the results file (scale-TAG.json)")
    args = p.parse_args()
    raise_open_files(max(args.devices) * 2 + 1024)  # mosquitto and the load generators inherit it
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgefl-scale-") as tmp:
        if args.keep:
            tmp = str(args.keep)
            args.keep.mkdir(parents=True, exist_ok=True)
        for devices in args.devices:
            for per_round in args.per_round:
                if per_round * (1 + args.over_select) > devices:
                    continue
                row = one_case(devices, per_round, args, Path(tmp))
                rows.append(row)
                print(f"{devices:>6} devices, {per_round:>5}/round: close {row['worst_close_after_last_needed_s']} s after the last "
                      f"needed upload (worst round); server {row['server_cpu_s']} CPU s, {row['server_peak_rss_mib']} MiB; broker "
                      f"{row['broker_peak_rss_mib']} MiB; lost {row['lost']}, twice {row['counted_twice']}; connect {row['connect_s']} s; "
                      f"wall {row['wall_s']} s", flush=True)
    name = "scale" + (f"-{args.tag}" if args.tag else "") + ("-bridge" if args.bridge else "") + (f"-{args.method}" if args.method != "fedhe" else "")
    path = save(name, {"rows": rows, "args": vars(args)})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
