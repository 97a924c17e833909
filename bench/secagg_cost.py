"""What secure aggregation costs per round: time and bytes per device, secured beside plain (issue 35).

For each device count, the same run twice on the same mosquitto, back to back (plain, then
secured, the order alternating from one count to the next): the real ``edgefl server`` process
and ``edgefl loadgen`` processes playing the devices (bench/scale.py's setup: each device its own
MQTT session and the real device loop, uploads made by one real client half per architecture;
the run's filter chain, secure aggregation's stages included, runs in every device). Every
device is selected every round and none drops out.

Bytes are counted on the wire, not taken from the records (whose ``bytes_up``/``bytes_down``
count method bodies only): a counting MQTT client subscribes to every topic of the federation
and reads each PUBLISH's envelope header (type, round). Per device and round:

* up: every envelope on the devices' ``up`` topics (uploads, chunks, stage replies), divided by
  the devices;
* down: every envelope on their ``down`` topics (downloads, stage requests, acks, nacks),
  divided by the devices, plus each round announcement once per device (each device receives
  the retained broadcast).

Bytes are MQTT payloads (the envelopes); ``wire`` adds each PUBLISH's MQTT header and topic
(PUBACKs, TCP and TLS not counted). Round time is the server's ``round_time_s`` (metrics.jsonl):
with secure aggregation it includes the stages.

    python bench/secagg_cost.py --devices 10 100 1000 --rounds 3
    python bench/secagg_cost.py --devices 10 100 --method fedavg --model lenet5 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import tomli_w
from common import save, users_path
from scale import EDGEFL, PeakMemory, scale_config, start_server

from edgefl.fleet.broker import start_mosquitto
from edgefl.fleet.swarm import raise_open_files
from edgefl.transport.envelope import PREFIX
from edgefl.transport.link import BrokerAddress

GOAL_BYTES, GOAL_TIME = 2.0, 2.0  # issue 35: at most 2x the plain round's bytes per device and time, at 1,000 devices


def _varint_len(n: int) -> int:
    return 1 if n < 128 else 2 if n < 16384 else 3 if n < 2097152 else 4


class ByteCounter:
    """An MQTT client subscribed to ``edgefl/v1/<federation>/#`` that adds up every live PUBLISH
    by (round, topic kind, envelope type): messages, payload bytes, MQTT PUBLISH bytes, when first
    and last seen."""

    def __init__(self, broker: str, federation: str) -> None:
        import paho.mqtt.client as mqtt

        self.base = f"edgefl/v1/{federation}"
        self.rows: dict[tuple[int, str, str], list[float]] = defaultdict(lambda: [0, 0, 0, 0.0, 0.0])
        self.unparsed = 0
        self._lock = threading.Lock()
        self._ready = threading.Event()
        address = BrokerAddress.parse(broker)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bytecount-{uuid.uuid4().hex[:8]}",
                                  protocol=mqtt.MQTTv5)
        self.client.on_connect = lambda c, u, f, rc, p=None: (c.subscribe(f"{self.base}/#", qos=1), self._ready.set())
        self.client.on_message = self._on_message
        self.client.connect(address.host, address.port, keepalive=120)
        self.client.loop_start()
        if not self._ready.wait(10):
            raise SystemExit("the byte counter could not connect to the broker")
        time.sleep(0.3)  # the SUBACK

    def _on_message(self, client, userdata, msg) -> None:
        if msg.retain:  # a replay of the retained store on subscribe, not traffic
            return
        rest = msg.topic[len(self.base) + 1:].split("/")
        kind = {"round": "announce", "presence": "presence"}.get(rest[0]) or (rest[2] if len(rest) == 3 else "other")
        payload = bytes(msg.payload)
        try:
            _, _, hlen = PREFIX.unpack_from(payload)
            header = json.loads(payload[PREFIX.size:PREFIX.size + hlen])
            key = (int(header["round"]), kind, str(header["type"]))
        except Exception:  # presence is plain text
            key = (-1, kind, "raw")
        topic = len(msg.topic.encode())
        body = 2 + topic + 2 + 1 + len(payload)  # topic length, topic, packet id, properties length (v5), payload
        wire = 1 + _varint_len(body) + body
        with self._lock:
            row = self.rows[key]
            row[0] += 1
            row[1] += len(payload)
            row[2] += wire
            now = time.time()
            row[3] = row[3] or now  # first and last seen
            row[4] = now
            if key[0] == -1:
                self.unparsed += 1

    def stop(self) -> list[dict[str, Any]]:
        time.sleep(1.0)  # what the broker still holds for us
        self.client.disconnect()
        self.client.loop_stop()
        with self._lock:
            return [{"round": r, "topic": k, "type": t, "messages": v[0], "bytes": v[1], "wire_bytes": v[2],
                     "first_unix": v[3], "last_unix": v[4]}
                    for (r, k, t), v in sorted(self.rows.items())]


def cost_config(devices: int, rounds: int, method: str, federation: str, secured: bool, model: str | None = None) -> dict[str, Any]:
    """bench/scale.py's config with every device selected every round (and the filter); for
    FedAvg, ``model`` replaces scale's 1 MiB CNN on every device."""
    raw = scale_config(devices, devices, 0.0, rounds, method, federation)
    if method == "fedavg" and model:
        raw["fleet"]["groups"] = [{"model": model, "count": devices}]
    raw["name"] = f"secagg-cost-{method}-{devices}-{'secagg' if secured else 'plain'}"
    if secured:
        raw["filters"] = [{"name": "secagg"}]  # default options: about log2(n) neighbours, t = floor(2k/3) + 1
    return raw


def per_device(traffic: list[dict[str, Any]], devices: int, rounds: int) -> dict[str, Any]:
    """Bytes each device sent and received per round (rounds 1..rounds), and the split by type."""
    up = down = wup = wdown = 0
    split: dict[str, float] = defaultdict(float)
    for row in traffic:
        if not 1 <= row["round"] <= rounds:
            continue
        if row["topic"] == "up":
            up += row["bytes"]
            wup += row["wire_bytes"]
            split[f"up {row['type']}"] += row["bytes"] / devices / rounds
        elif row["topic"] == "down":
            down += row["bytes"]
            wdown += row["wire_bytes"]
            split[f"down {row['type']}"] += row["bytes"] / devices / rounds
        elif row["topic"] == "announce":  # one publish, every device receives it
            down += row["bytes"] * devices
            wdown += row["wire_bytes"] * devices
            split["down announce"] += row["bytes"] / rounds
    n = devices * rounds
    return {"up": up / n, "down": down / n, "wire_up": wup / n, "wire_down": wdown / n,
            "split": {k: round(v, 1) for k, v in sorted(split.items())}}


def one_run(devices: int, secured: bool, args: argparse.Namespace, broker: str, work: Path) -> dict[str, Any]:
    tag = f"{devices}-{'secagg' if secured else 'plain'}"
    federation = f"cost-{uuid.uuid4().hex[:8]}"
    raw = cost_config(devices, args.rounds, args.method, federation, secured, args.model)
    cfg_path = work / f"config-{tag}.toml"
    cfg_path.write_text(tomli_w.dumps(raw))
    run_dir = work / f"run-{tag}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    processes = max(1, min(args.processes, devices // 100))
    per_proc = -(-devices // processes)
    counter = ByteCounter(broker, federation)
    gens, logs = [], []
    server_args = argparse.Namespace(profile_server=None, server_first=False)
    with PeakMemory() as mem:
        t0 = time.time()
        for i in range(processes):
            a, b = i * per_proc, min(devices, (i + 1) * per_proc)
            log = open(work / f"loadgen-{tag}-{i}.log", "wb")
            command = ["nice", "-n", "5", *EDGEFL, "loadgen", "--broker", broker, "--config", str(cfg_path), "--devices", f"{a}:{b}",
                       "--compute-s", str(args.compute_s), "--dropout", "0", "--seed", str(i),
                       "--stats", str(work / f"loadgen-{tag}-{i}.json"), "--timeout", str(args.timeout)]
            gens.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
            logs.append(log)
            mem.watch("loadgen", gens[-1].pid)
        server = start_server(server_args, broker, cfg_path, run_dir, work / f"server-{tag}.log", env, mem)
        try:
            server_rc = server.wait(timeout=args.timeout)
            gen_rcs = [g.wait(timeout=120) if server_rc == 0 else None for g in gens]
        finally:
            for p in [server, *gens]:
                if p.poll() is None:
                    p.kill()
            for log in logs:
                log.close()
        wall = time.time() - t0
    traffic = counter.stop()
    if server_rc != 0:
        raise SystemExit(f"the server failed ({server_rc}); its log: {work / f'server-{tag}.log'}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = []
    for m in metrics:
        sec = (m.get("filters") or {}).get("secagg") or {}
        groups = sec.get("groups") or {}
        rounds.append({"round": m["round"], "outcome": m["outcome"], "accepted": m["accepted"], "selected": len(m["selected"]),
                       "round_time_s": m["round_time_s"], "bytes_up_record": m.get("bytes_up"),
                       "bytes_down_record": m.get("bytes_down"), "stages": m.get("stages"),
                       "secagg_summed": sum(g.get("summed", 0) for g in groups.values()) if groups else None,
                       "secagg_groups": groups or None})
    ok = all(r["outcome"] == "complete" and r["accepted"] == devices for r in rounds) and len(rounds) == args.rounds
    if secured:
        ok = ok and all(r["secagg_summed"] == devices for r in rounds)
    times = [r["round_time_s"] for r in rounds]
    return {"devices": devices, "secured": secured, "loadgen_processes": processes, "rounds": rounds, "records_ok": ok,
            "round_time_s_mean": statistics.fmean(times), "round_time_s_median": statistics.median(times),
            "per_device": per_device(traffic, devices, args.rounds), "traffic": traffic,
            "server_cpu_s": round(mem.cpu.get("server", 0.0), 2), "server_peak_rss_mib": round(mem.peak.get("server", 0) / 2**20, 1),
            "loadgen_peak_rss_mib": round(mem.peak.get("loadgen", 0) / 2**20, 1),
            "loadgen_cpu_s": round(mem.cpu.get("loadgen", 0.0), 2), "loadgen_exit_codes": gen_rcs,
            "wall_s": round(wall, 1)}


def kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n:.0f} B"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--method", choices=["fedhe", "fedavg"], default="fedhe")
    p.add_argument("--model", help="FedAvg: the model on every device (default: bench/scale.py's 1.02 MiB CNN), e.g. lenet5")
    p.add_argument("--compute-s", type=float, default=1.0, help="median seconds from download to upload (lognormal, sigma 0.5)")
    p.add_argument("--first", choices=["plain", "secagg"], default="plain", help="which run of the first pair goes first "
                                                                                     "(the order alternates from one count to the next)")
    p.add_argument("--processes", type=int, default=2, help="load-generator processes at most (one per 100 devices)")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--keep", type=users_path, help="keep logs, configs, run directories and stats in this folder")
    p.add_argument("--tag", default="", help="names the results file (secagg_cost-TAG.json)")
    args = p.parse_args()
    raise_open_files(max(args.devices) * 2 + 1024)
    rows: list[dict[str, Any]] = []
    name = "secagg_cost" + (f"-{args.tag}" if args.tag else "") + (f"-{args.method}" if args.method != "fedhe" else "")
    name += f"-{args.model}" if args.model else ""
    with tempfile.TemporaryDirectory(prefix="edgefl-secagg-cost-") as tmp:
        work = Path(tmp)
        if args.keep:
            work = args.keep
            work.mkdir(parents=True, exist_ok=True)
        broker = start_mosquitto(work / "broker", max_packet_bytes=(1 << 20) + (1 << 16))  # one broker for every run
        try:
            for i, devices in enumerate(args.devices):
                order = [False, True] if (i % 2 == 0) == (args.first == "plain") else [True, False]
                pair = {}
                for secured in order:
                    row = one_run(devices, secured, args, broker.url, work)
                    pair[secured] = row
                    rows.append(row)
                    d = row["per_device"]
                    print(f"{devices:>5} devices {'secagg' if secured else 'plain ':6}: round {row['round_time_s_median']:.2f} s "
                          f"(median of {args.rounds}), per device up {kib(d['up'])}, down {kib(d['down'])}; records ok "
                          f"{row['records_ok']}; wall {row['wall_s']} s", flush=True)
                plain, sec = pair[False], pair[True]
                bytes_ratio = (sec["per_device"]["up"] + sec["per_device"]["down"]) / (plain["per_device"]["up"] + plain["per_device"]["down"])
                time_ratio = sec["round_time_s_median"] / plain["round_time_s_median"]
                sec["ratios"] = {"up": sec["per_device"]["up"] / plain["per_device"]["up"],
                                 "down": sec["per_device"]["down"] / plain["per_device"]["down"],
                                 "bytes": bytes_ratio, "time": time_ratio,
                                 "goal_holds": bytes_ratio <= GOAL_BYTES and time_ratio <= GOAL_TIME}
                print(f"{devices:>5} devices: secured/plain bytes {bytes_ratio:.2f}x (up {sec['ratios']['up']:.2f}x, down "
                      f"{sec['ratios']['down']:.2f}x), round time {time_ratio:.2f}x", flush=True)
                save(name, {"rows": rows, "args": vars(args), "partial": True})  # what is done so far survives an interrupted run
        finally:
            broker.stop()
    path = save(name, {"rows": rows, "args": vars(args)})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
