"""A device as it really is: edgefl on 64-bit ARM with a Pi's memory, beside the same device on x86.

Run by ``./dev.sh arm-device`` (root), which first builds the emulated device: a Debian bookworm
arm64 root file system (``debootstrap``), run through ``qemu-user-static``'s binfmt handler, with
edgefl installed in it as on a Raspberry Pi: a venv, the aarch64 torch/torchvision wheels from PyPI,
edgefl's core package from a wheel of this checkout. Then, side by side in one run:

1. ``edgefl device-profile --quick`` inside the ARM device: the architecture it reports.
2. The same fleet run twice with the same seed (FedAvg, Fashion-MNIST, two devices, server and
   mosquitto on the host over loopback): once with ``client-1`` on the ARM device, under a memory
   cap of its device class's RAM (``--profile``, default pi-zero-2w: 512 MiB, a cgroup's memory
   limit, swap included where the kernel accounts it), once with both devices on x86. The rounds'
   numbers must agree within float tolerance.
3. Footprints: the peak resident memory (VmHWM) of one ``edgefl client`` process training each
   model that ``edgefl assign`` can pick, for one short round, on x86 (``--x86-models``) and on the
   ARM device (``--arm-models``); and the runtime alone (the process after its imports, before a
   model exists): what ``edgefl assign`` subtracts from a device's RAM.

Under emulation the ARM process's memory includes qemu's own (its translated-code cache and
mappings), so ARM footprints are upper bounds for a real Pi; the x86 numbers are native.
Results go to bench/results/arm_device.json; docs/devices.md records them with this command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import tomli_w
from common import save, users_path

from edgefl.fleet.broker import start_mosquitto
from edgefl.profile.schema import load_profile

HOST_EDGEFL = [sys.executable, "-m", "edgefl"]
DEVICE_VENV = "/opt/edgefl"
LADDER = ["cnn-small", "lenet5", "fedhe-cnn-0", "fedhe-cnn-3", "fedhe-cnn-5", "fedhe-cnn-9", "resnet10:width=0.25",
          "resnet18:width=0.25", "vgg9:width=0.25", "resnet18", "resnet34", "resnet50"]


# --- the emulated device ----------------------------------------------------------------------------
@contextlib.contextmanager
def mounted(root: Path) -> Iterator[None]:
    """/proc, /sys and /dev inside the root file system, as a booted device has them."""
    done = []
    try:
        for what, args in (("proc", ["-t", "proc", "proc"]), ("sys", ["--rbind", "/sys"]), ("dev", ["--rbind", "/dev"])):
            target = root / what
            if not os.path.ismount(target):
                subprocess.run(["mount", *args, str(target)], check=True)
                done.append(target)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-R", "-l", str(target)], check=False)


def root_problem(root: Path) -> str | None:
    """Why ``root`` is not a built ARM device (None when it is): checked before anything is mounted
    in it, so a mistyped --root mounts nothing under some other folder."""
    if not root.is_dir():
        return f"--root {root} is not a folder"
    for inside in ("usr/bin/env", f"{DEVICE_VENV.lstrip('/')}/bin/python", "proc", "sys", "dev"):
        if not os.path.lexists(root / inside):
            return f"--root {root} holds no /{inside}: not a built arm64 device"
    return None


def arm_command(root: Path, *args: str) -> list[str]:
    return ["chroot", str(root), "/usr/bin/env", "-i", "HOME=/root", "PATH=/opt/edgefl/bin:/usr/bin:/bin", "LANG=C.UTF-8",
            f"{DEVICE_VENV}/bin/edgefl", *args]


class MemoryCap:
    """A memory cgroup with a hard limit (cgroup v2 ``memory.max``, else v1 ``limit_in_bytes``)."""

    def __init__(self, limit_bytes: int, name: str) -> None:
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists():
            self.path, self.version = Path("/sys/fs/cgroup") / name, 2
            self.path.mkdir(exist_ok=True)
            (self.path / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (self.path / "memory.swap.max").write_text("0")
        else:
            self.path, self.version = Path("/sys/fs/cgroup/memory") / name, 1
            self.path.mkdir(exist_ok=True)
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):  # only where swap is accounted
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        self.limit = limit_bytes

    def enter(self) -> None:
        """For preexec_fn: the child joins the group before it execs."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        f = self.path / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        return int(f.read_text()) if f.exists() else None

    def oom_kills(self) -> int:
        f = self.path / ("memory.events" if self.version == 2 else "memory.oom_control")
        if not f.exists():
            return 0
        for line in f.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def emulator_split(pid: int) -> tuple[int, int]:
    """(total, emulator) resident bytes of a qemu-user process, from its smaps: the emulator's
    part is its translated-code buffer (anonymous executable mappings), its own [heap] and its
    binary; the rest is the emulated program's memory, what a real ARM board would hold."""
    total = emulator = 0
    path, perms = "", ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if MAPPING.match(line):
                perms, path = head[1], head[5] if len(head) > 5 else ""
            elif line.startswith("Rss:"):
                kb = int(head[1]) * 1024
                total += kb
                if ("x" in perms and not path) or path == "[heap]" or "qemu" in path:
                    emulator += kb
    return total, emulator


class PeakRss:
    """Watches a process's resident memory until it exits: VmHWM (the kernel's own peak) and,
    for an emulated process, the peak of its own part without the emulator (sampled)."""

    def __init__(self, pid: int, emulated: bool = False) -> None:
        self.pid, self.emulated, self.peak = pid, emulated, 0
        self.guest_peak = self.emulator_peak = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while True:
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
                if self.emulated:
                    total, emu = emulator_split(self.pid)
                    self.guest_peak = max(self.guest_peak, total - emu)
                    self.emulator_peak = max(self.emulator_peak, emu)
            except (OSError, ValueError, IndexError):
                return
            time.sleep(0.2 if self.emulated else 0.05)

    def join(self) -> int:
        self._thread.join(timeout=5)
        return self.peak


# --- fleet runs --------------------------------------------------------------------------------------
def fleet_config(model: str, devices: int, rounds: int, seed: int, steps: int, samples: int | None = None) -> dict[str, Any]:
    name, _, opts = model.partition(":")
    options = {k: float(v) for k, v in (kv.split("=") for kv in opts.split(","))} if opts else {}
    return {
        "name": f"arm-{name}", "seed": seed, "rounds": rounds, "threads": 1,
        "method": {"name": "fedavg"},
        "data": {"dataset": "fashion-mnist", "partition": "iid", "test_samples": 500,
                 **({"samples_per_client": samples} if samples else {})},
        "train": {"epochs": 1, "batch_size": 32, "max_steps": steps},
        "eval": {"every": 1},
        "network": {"round_deadline_s": 3600.0, "keepalive_s": 300, "quorum": 1.0},
        "fleet": {"groups": [{"model": name, "count": devices, **({"options": options} if options else {})}]},
    }


def run_fleet(cfg: dict[str, Any], where: list[str], root: Path | None, cap_bytes: int | None, work: Path) -> dict[str, Any]:
    """Server and broker on the host; device i on ``where[i]`` ("x86" or "arm")."""
    work.mkdir(parents=True, exist_ok=True)
    host_cfg = work / "run.toml"
    host_cfg.write_text(tomli_w.dumps(cfg))
    dev_cfg = str(host_cfg)
    if root is not None and "arm" in where:
        inside = root / "tmp" / "edgefl-bench" / work.name
        inside.mkdir(parents=True, exist_ok=True)
        shutil.copy(host_cfg, inside / "run.toml")
        dev_cfg_arm = f"/tmp/edgefl-bench/{work.name}/run.toml"
    broker = start_mosquitto(work / "broker")
    procs, watchers, caps = [], [], []
    t0 = time.perf_counter()
    try:
        server = subprocess.Popen([*HOST_EDGEFL, "server", "--config", str(host_cfg), "--broker", broker.url, "--out", str(work / "run")],
                                  stdout=open(work / "server.log", "w"), stderr=subprocess.STDOUT)
        for i, kind in enumerate(where):
            args = ["client", "--broker", broker.url, "--device-id", f"client-{i}", "--no-state"]
            log = open(work / f"client-{i}-{kind}.log", "w")
            if kind == "arm":
                cap = MemoryCap(cap_bytes, f"edgefl-arm-{os.getpid()}-{i}") if cap_bytes else None
                caps.append(cap)
                p = subprocess.Popen(arm_command(root, *args, "--config", dev_cfg_arm), stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=cap.enter if cap else None)
            else:
                p = subprocess.Popen([*HOST_EDGEFL, *args, "--config", dev_cfg], stdout=log, stderr=subprocess.STDOUT)
            procs.append(p)
            watchers.append(PeakRss(p.pid, emulated=kind == "arm"))
        codes = [p.wait(timeout=7200) for p in procs]
        server_code = server.wait(timeout=600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        broker.stop()
    metrics = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()] if (work / "run" / "metrics.jsonl").exists() else []
    out = {"where": where, "exit_codes": codes, "server_exit": server_code, "seconds": time.perf_counter() - t0,
           "peak_rss_bytes": [w.join() for w in watchers], "metrics": metrics,
           "guest_peak_bytes": [w.guest_peak if w.emulated else None for w in watchers],
           "emulator_peak_bytes": [w.emulator_peak if w.emulated else None for w in watchers]}
    arm_caps = [c for c in caps if c is not None]
    if arm_caps:
        out["cap_bytes"] = cap_bytes
        out["cgroup_peak_bytes"] = [c.peak() for c in arm_caps]
        out["oom_kills"] = [c.oom_kills() for c in arm_caps]
        for c in arm_caps:
            c.remove()
    return out


def numbers(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number in a metrics record, flattened (times left out: they differ by design)."""
    out: dict[str, float] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if any(t in k for t in ("time", "_s", "seconds", "bytes", "wall", "started", "deadline")):
            continue
        if isinstance(v, dict):
            out.update(numbers(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def compare(a: list[dict], b: list[dict], rtol: float, atol: float) -> dict[str, Any]:
    worst, worst_key, n = 0.0, None, 0
    for ra, rb in zip(a, b):
        na, nb = numbers(ra), numbers(rb)
        for k in sorted(set(na) & set(nb)):
            diff = abs(na[k] - nb[k])
            n += 1
            if diff > atol + rtol * abs(nb[k]) and diff >= worst:
                worst, worst_key = diff, k
    return {"rounds": min(len(a), len(b)), "numbers_compared": n, "equal_within_tolerance": worst_key is None and n > 0,
            "worst_difference": worst, "worst_key": worst_key, "rtol": rtol, "atol": atol}


def footprint(model: str, kind: str, root: Path | None, work: Path, samples: int) -> dict[str, Any]:
    """One device, one short round, its own ``samples`` (what `edgefl assign` budgets a round for);
    no cap: this measures, the fleet run enforces."""
    res = run_fleet(fleet_config(model, 1, 1, 0, steps=5, samples=samples), [kind], root, None, work)
    ok = res["exit_codes"] == [0] and res["server_exit"] == 0
    return {"model": model, "where": kind, "ok": ok, "peak_rss_bytes": res["peak_rss_bytes"][0],
            "guest_peak_bytes": res["guest_peak_bytes"][0], "emulator_peak_bytes": res["emulator_peak_bytes"][0],
            "cgroup_peak_bytes": (res.get("cgroup_peak_bytes") or [None])[0], "seconds": res["seconds"]}


def runtime_only(kind: str, root: Path | None) -> dict[str, Any]:
    """Resident memory of a process that imports what `edgefl client` imports and takes one step
    of a tiny model, read while it waits (emulated: split into program and emulator)."""
    code = ("import sys, time, torch\n"
            "import edgefl.cli, edgefl.device, edgefl.fleet.launcher, edgefl.transport.mqtt\n"
            "m = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(72, 2))\n"
            "o = torch.optim.Adam(m.parameters()); m(torch.zeros(2, 1, 8, 8)).sum().backward(); o.step()\n"
            "print('ready', flush=True); sys.stdin.readline()\n")
    cmd = ([sys.executable, "-c", code] if kind == "x86" else
           ["chroot", str(root), "/usr/bin/env", "-i", "HOME=/root", f"{DEVICE_VENV}/bin/python", "-c", code])
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    total, emulator = emulator_split(p.pid) if kind == "arm" else (psutil.Process(p.pid).memory_info().rss, 0)
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(timeout=60)
    return {"model": "(runtime only)", "where": kind, "ok": True, "peak_rss_bytes": total,
            "guest_peak_bytes": total - emulator if kind == "arm" else None, "emulator_peak_bytes": emulator if kind == "arm" else None}


def mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.0f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=users_path, required=True, help="the arm64 root file system (./dev.sh arm-device builds it)")
    ap.add_argument("--profile", default="pi-zero-2w", help="device class whose RAM caps the ARM device")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="training steps per device per round")
    ap.add_argument("--arm-models", default="cnn-small,lenet5,fedhe-cnn-3", help="footprints on the ARM device (slow: emulated)")
    ap.add_argument("--x86-models", default=",".join(LADDER), help="footprints on x86")
    ap.add_argument("--samples", type=int, default=600, help="a footprint device's own training samples (assign's default round)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: profile, fleet, footprints")
    args = ap.parse_args()
    problem = root_problem(args.root)
    if problem:
        print(f"{problem} (./dev.sh arm-device builds it and passes its --root)", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("the ARM device needs root (chroot, a memory cgroup)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unmount and remove the cgroup on a kill too
    skip = set(filter(None, args.skip.split(",")))
    profile = load_profile(args.profile)
    ram = int(profile.memory.ram_bytes.value)
    result: dict[str, Any] = {"profile": args.profile, "ram_bytes": ram}
    failures = []
    with mounted(args.root), tempfile.TemporaryDirectory(prefix="edgefl-arm-") as tmp:
        work = Path(tmp)
        if "profile" not in skip:
            t0 = time.perf_counter()
            p = subprocess.run(arm_command(args.root, "device-profile", "--quick", "--out", "/tmp/arm-profile.toml"),
                               capture_output=True, text=True, timeout=3600)
            text = (args.root / "tmp" / "arm-profile.toml").read_text() if p.returncode == 0 else ""
            arch = next((line.split("=", 1)[1].strip().strip('"') for line in text.splitlines() if line.startswith("arch")), None)
            result["device_profile"] = {"exit": p.returncode, "arch": arch, "seconds": time.perf_counter() - t0,
                                        "profile_toml": text, "stderr_tail": p.stderr[-2000:]}
            print(f"device-profile --quick on the ARM device: exit {p.returncode}, arch {arch} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if p.returncode != 0 or arch != "aarch64":
                failures.append("device-profile")
        # the cap: the class's RAM for the program, plus what the emulator itself holds (its
        # translated-code buffer is a fixed 128 MiB once full, plus its heap and binary), measured
        # here on the runtime alone with a margin for the code translated while training
        probe = runtime_only("arm", args.root)
        allowance = probe["emulator_peak_bytes"] + (64 << 20)
        cap = ram + allowance
        result.update(cap_bytes=cap, emulator_allowance_bytes=allowance, runtime_probe=probe)
        print(f"memory cap for the ARM device: {mib(ram)} ({args.profile}) + {mib(allowance)} for the emulator itself", flush=True)
        if "fleet" not in skip:
            from edgefl.profile.assign import assign

            chosen = assign(profile).chosen  # the model `edgefl assign --profile` gives this class
            model = chosen.label.replace("(", ":").replace(")", "") if chosen else "cnn-small"
            result["assigned_model"] = model
            print(f"edgefl assign --profile {args.profile} -> {model}", flush=True)
            cfg = fleet_config(model, 2, args.rounds, 0, args.steps)
            arm = run_fleet(cfg, ["x86", "arm"], args.root, cap, work / "fleet-arm")
            x86 = run_fleet(cfg, ["x86", "x86"], None, None, work / "fleet-x86")
            same = compare(arm["metrics"], x86["metrics"], rtol=1e-4, atol=1e-5)
            result["fleet"] = {"arm": arm, "x86": x86, "comparison": same}
            counted = arm["exit_codes"] == [0, 0] and arm["server_exit"] == 0 and len(arm["metrics"]) == args.rounds
            within = (arm["guest_peak_bytes"][1] or 0) <= ram
            print(f"fleet with client-1 on ARM under {mib(cap)}: exits {arm['exit_codes']} server {arm['server_exit']}, "
                  f"{len(arm['metrics'])} rounds, ARM peak {mib(arm['guest_peak_bytes'][1])} without the emulator "
                  f"({'within' if within else 'OVER'} {mib(ram)}; {mib(arm['peak_rss_bytes'][1])} with it, cgroup peak {mib(arm['cgroup_peak_bytes'][0])}, "
                  f"OOM kills {arm['oom_kills'][0]}), {arm['seconds']:.0f} s; same numbers as all-x86: {same['equal_within_tolerance']} "
                  f"({same['numbers_compared']} numbers, worst {same['worst_difference']:.2g} at {same['worst_key']})", flush=True)
            if not counted or not same["equal_within_tolerance"] or not within:
                failures.append("fleet")
        if "footprints" not in skip:
            rows = [runtime_only("x86", None), probe]
            for kind, models in (("x86", args.x86_models), ("arm", args.arm_models)):
                for model in filter(None, models.split(",")):
                    rows.append(footprint(model, kind, args.root if kind == "arm" else None, work / f"fp-{kind}-{model}",
                                          args.samples))
            result["footprints"] = rows
            print(f"{'model':22} {'where':5} {'peak RSS':>9} {'program':>9} {'emulator':>9} {'ok':>4}")
            for r in rows:
                print(f"{r['model']:22} {r['where']:5} {mib(r['peak_rss_bytes']):>9} {mib(r.get('guest_peak_bytes')):>9} "
                      f"{mib(r.get('emulator_peak_bytes')):>9} {str(r['ok']):>4}")
                if not r["ok"]:
                    failures.append(f"footprint {r['model']} on {r['where']}")
    result["failures"] = failures
    path = save("arm_device", result)
    print(f"results in {path}" + (f"; FAILED: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
