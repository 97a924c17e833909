"""``edgefl device-profile``: measure the machine it runs on and describe it in the catalog schema.

Every number it writes is ``kind = "measured"`` with the method in ``source``; a fact it cannot
read is ``unknown``. Per-model training costs are measured in a child process each
(:mod:`edgefl.profile.child`), so one model's memory never counts toward another's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from edgefl.errors import EdgeflError
from edgefl.profile.schema import SCHEMA, DeviceProfile

# one or two of every family the zoo has (plain CNNs, wide-map FedHe CNNs, basic and bottleneck
# ResNets, VGG, both CVAEs): the host terms are fitted on these, so each kind of cost is seen
DEFAULT_MODELS = ["cnn-small", "lenet5", "fedhe-cnn-0:width=0.5", "fedhe-cnn-5:width=0.5", "resnet10:width=0.25",
                  "resnet18:width=0.25", "resnet50:width=0.25", "vgg9:width=0.25", "cvae-small", "cvae-large:width=0.5"]
QUICK_MODELS = ["cnn-small", "cvae-small"]
# the step fit has ten terms in two stages; from fewer models than this it is under-determined
# and extrapolates badly (three small models left matmuls free), so the profile keeps only the
# effective speed
MIN_FIT_MODELS = 6


@dataclass
class ModelCandidate:
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name + (f"({','.join(f'{k}={v}' for k, v in sorted(self.options.items()))})" if self.options else "")

    @classmethod
    def parse(cls, text: str) -> ModelCandidate:
        """``resnet18:width=0.25,stem=small`` -> name and builder options (values as TOML)."""
        from edgefl.config import parse_value
        from edgefl.models import get_spec

        name, _, rest = text.strip().partition(":")
        get_spec(name)  # unknown names fail here, with a suggestion
        options = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise EdgeflError(f"--models {text!r}: options are key=value, e.g. resnet18:width=0.25")
            options[key.strip()] = parse_value(value.strip())
        return cls(name, options)


def _measured(value: float | None, how: str) -> dict:
    if value is None:
        return {"kind": "unknown"}
    return {"value": value, "kind": "measured", "source": f"edgefl device-profile: {how}"}


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "processor\t: arm")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def matmul_gflops(n: int, seconds: float, device: torch.device) -> float:
    """Dense fp32 n x n matrix multiply, repeated for about ``seconds``: 2 n^3 FLOPs each."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    torch.mm(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or reps < 3:
        torch.mm(a, b)
        reps += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def fit_host(measured: list[dict[str, Any]], batch: int, input_shape: tuple[int, ...]):
    """The cost model's host terms (:class:`edgefl.profile.cost.StepFit`), fitted from measured training steps."""
    from edgefl.models import get_spec
    from edgefl.profile.cost import fit_step_model, forward_stats, freeze

    rows = []
    for m in measured:
        shape = tuple(get_spec(m["model"]).default_input_shape) if get_spec(m["model"]).family == "mlp" else tuple(input_shape)
        rows.append({"stats": forward_stats(m["model"], freeze(m["options"]), shape, 10), "params": m["params"],
                     "batch": batch, "step_s": m["step_s"], "optimizer_s": m.get("optimizer_s"),
                     "memory_measured": m["train_memory_bytes"]})
    return fit_step_model(rows)


def guess_class(cuda: bool) -> str:
    """ARM without CUDA is a board, ARM with CUDA a Jetson, x86 with CUDA a server, else a laptop."""
    arm = platform.machine().lower() in ("aarch64", "arm64", "armv7l", "armv6l")
    if arm:
        return "jetson" if cuda else "sbc"
    return "server" if cuda else "laptop"


def measure_model(candidate: ModelCandidate, input_shape: tuple[int, ...], batch: int, steps: int, device: str,
                  timeout: float = 300) -> dict[str, Any]:
    spec = {"model": candidate.name, "options": candidate.options, "input_shape": list(input_shape), "batch": batch,
            "steps": steps, "device": device}
    from edgefl.models import get_spec

    if get_spec(candidate.name).family == "mlp":  # tabular: its own default width, not an image
        spec["input_shape"] = list(get_spec(candidate.name).default_input_shape)
    try:
        res = subprocess.run([sys.executable, "-m", "edgefl.profile.child", json.dumps(spec)],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": candidate.label, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return {"model": candidate.label, "error": f"child exited {res.returncode}: {tail}"}
    out = json.loads(lines[-1])
    out["label"] = candidate.label
    return out


def broker_round_trip(url: str, messages: int = 20, size: int = 64 * 1024, timeout: float = 10.0) -> dict[str, float]:
    """Round-trip time (median, publish to own subscription, QoS 1) and throughput to a broker."""
    import queue
    from urllib.parse import urlparse

    import paho.mqtt.client as mqtt

    parsed = urlparse(url)
    if parsed.scheme not in ("mqtt", "tcp") or not parsed.hostname:
        raise EdgeflError(f"--broker {url!r}: expected mqtt://HOST:PORT")
    received: queue.Queue[float] = queue.Queue()
    topic = f"edgefl/profile/{uuid.uuid4().hex}"
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgefl-profile-{uuid.uuid4().hex[:8]}")
    client.on_message = lambda c, u, msg: received.put(time.perf_counter())
    try:
        client.connect(parsed.hostname, parsed.port or 1883, keepalive=30)
    except OSError as exc:
        raise EdgeflError(f"cannot reach the broker at {url}: {exc}", hint="is it running? is the port right?") from None
    client.loop_start()
    try:
        client.subscribe(topic, qos=1)
        time.sleep(0.2)
        payload = os.urandom(size)
        rtts = []
        for _ in range(messages):
            t0 = time.perf_counter()
            client.publish(topic, payload, qos=1)
            try:
                rtts.append(received.get(timeout=timeout) - t0)
            except queue.Empty:
                raise EdgeflError(f"no message came back from {url} within {timeout:.0f} s") from None
        t0 = time.perf_counter()
        for _ in range(messages):
            client.publish(topic, payload, qos=1)
        for _ in range(messages):
            received.get(timeout=timeout)
        throughput = messages * size * 8 / (time.perf_counter() - t0) / 1e6
    finally:
        client.disconnect()
        client.loop_stop()
    return {"rtt_ms_p50": statistics.median(rtts) * 1000, "throughput_mbps": throughput, "message_bytes": size}


_RUNTIME_PROBE = """
import json, psutil, torch
import edgefl.cli, edgefl.device, edgefl.fleet.launcher, edgefl.transport.mqtt
m = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(72, 2))
opt = torch.optim.Adam(m.parameters())
m(torch.zeros(2, 1, 8, 8)).sum().backward()
opt.step()
print(json.dumps({"rss": psutil.Process().memory_info().rss}))
"""


def runtime_footprint(timeout_s: float = 600.0) -> int | None:
    """Resident bytes of a fresh process that imports what `edgefl client` imports and takes one
    training step of a tiny model: the memory a device pays before its own model exists."""
    import json
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE], capture_output=True, text=True, timeout=timeout_s)
        return int(json.loads(out.stdout.strip().splitlines()[-1])["rss"]) if out.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError, KeyError, OSError):
        return None


def profile_host(
    models: list[ModelCandidate],
    batch: int = 32,
    steps: int = 5,
    matmul_n: int = 1024,
    matmul_seconds: float = 2.0,
    input_shape: tuple[int, ...] = (1, 28, 28),
    runs_dir: str | Path = ".",
    broker: str | None = None,
    profile_id: str | None = None,
    device_class: str | None = None,
    on_step: Callable[[str], None] = lambda msg: None,
) -> tuple[DeviceProfile, dict[str, Any]]:
    """Measure this machine. Returns the profile (catalog schema) and the detailed measurements."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    on_step("identity, CPU and memory")
    freq = psutil.cpu_freq()
    vm = psutil.virtual_memory()
    try:
        free_disk = shutil.disk_usage(Path(runs_dir)).free
    except OSError:
        free_disk = None
    on_step(f"matmul {matmul_n}x{matmul_n} on {device.type}")
    mm = matmul_gflops(matmul_n, matmul_seconds, device)
    details: dict[str, Any] = {"models": [], "matmul": {"n": matmul_n, "gflops": mm, "device": device.type}}
    for cand in models:
        on_step(f"training step: {cand.label}")
        details["models"].append(measure_model(cand, input_shape, batch, steps, device.type))
    ok = [m for m in details["models"] if "error" not in m]
    effective = statistics.median(m["train_gflops"] for m in ok) if ok else None
    speed_source = f"median over {len(ok)} zoo models of 3 x forward FLOPs x batch / train-step time"
    fit = fit_host(ok, batch, input_shape) if len(ok) >= MIN_FIT_MODELS else None
    if fit is not None:
        details["fit"] = dataclasses.asdict(fit)
    fit_source = (f"non-negative least-squares fit over {len(ok)} zoo models of step = fixed + operators x o + convolutions x c + conv FLOPs x 3 / conv rate "
                  "+ transposed-conv FLOPs x 3 / its rate + linear FLOPs x 3 / linear rate + random elements x r + memory-bound bytes x q; "
                  "optimizer time (timed apart) "
                  "= fixed + parameter tensors x t + params x p")
    memory_source = (f"fit over {len(ok)} zoo models of peak training memory - params x 16 "
                     "= activation factor x forward-tensor bytes x batch + factor x largest parameter tensor bytes + overhead")
    if broker:
        on_step(f"broker round trip: {broker}")
        details["broker"] = {"url": broker, **broker_round_trip(broker)}
    hostname = socket.gethostname()
    accel: dict[str, Any] = {"type": "none"}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        accel = {"type": "cuda", "name": f"{props.name} (capability {props.major}.{props.minor})",
                 "memory_bytes": _measured(props.total_memory, "torch.cuda.get_device_properties"),
                 "shared_memory": platform.machine() == "aarch64"}
    on_step("the edgefl client runtime's own footprint")
    runtime = runtime_footprint()
    # what a client would have: the available RAM, plus what this profiling process holds (it
    # exits before a client starts), minus the client runtime's own resident memory
    budget = vm.available + psutil.Process().memory_info().rss - runtime if runtime else vm.available
    raw = {
        "schema": SCHEMA,
        "id": profile_id or "".join(ch if ch.isalnum() else "-" for ch in hostname.lower()).strip("-") or "this-host",
        "name": f"{hostname} (measured {time.strftime('%Y-%m-%d')})",
        "class": device_class or guess_class(cuda),
        "notes": f"measured by edgefl device-profile, batch {batch}, {steps} steps per model, torch {torch.__version__}",
        "identity": {"os": f"{platform.system()} {platform.release()}", "arch": platform.machine(), "python": platform.python_version(),
                     "hostname": hostname, "torch": torch.__version__, **({"cuda": torch.version.cuda} if cuda else {})},
        "cpu": {"model": cpu_model_name(), "cores": _measured(os.cpu_count(), "os.cpu_count (logical)"),
                "clock_mhz": _measured(round(freq.max or freq.current) if freq and (freq.max or freq.current) else None, "psutil.cpu_freq")},
        "memory": {"ram_bytes": _measured(vm.total, "psutil.virtual_memory().total"),
                   "training_budget_bytes": _measured(budget, "psutil.virtual_memory().available at measurement time"
                                                      + (" + this profiler's RSS - the client runtime's footprint" if runtime else "")),
                   "runtime_bytes": _measured(runtime, "resident memory of a process importing what `edgefl client` imports, "
                                                       "after a first training step of a tiny model (VmRSS)"),
                   "step_overhead_bytes": _measured(round(fit.memory_overhead_bytes) if fit else None, memory_source),
                   "activation_factor": _measured(round(fit.activation_factor, 3) if fit else None, memory_source),
                   "largest_tensor_factor": _measured(round(fit.largest_tensor_factor, 3) if fit else None, memory_source),
                   "storage_bytes": _measured(free_disk, f"shutil.disk_usage({runs_dir})")},
        "compute": {"matmul_gflops": _measured(round(mm, 2), f"torch.mm {matmul_n}x{matmul_n} fp32 on {device.type}"),
                    "effective_gflops": _measured(round(effective, 3) if effective else None, speed_source),
                    **{key: _measured(float(f"{getattr(fit, key):.4g}") if fit else None,
                                      fit_source + (" (0: no separate term on this host)" if key.endswith("gflops") else ""))
                       for key in ("step_overhead_us", "layer_overhead_us", "conv_overhead_us", "conv_gflops", "transposed_conv_gflops", "linear_gflops",
                                   "random_ns_per_element", "traffic_ns_per_byte", "tensor_overhead_us", "param_overhead_ns")}},
        "accelerator": accel,
        "runtimes": {"trains_with": ["pytorch"], "runs": ["pytorch"]},
    }
    if broker:
        b = details["broker"]
        raw["network"] = {"uplink_mbps": _measured(round(b["throughput_mbps"], 2), f"QoS 1 publish to {broker}, {b['message_bytes']} B messages"),
                          "downlink_mbps": _measured(round(b["throughput_mbps"], 2), f"QoS 1 round trip via {broker}")}
    return DeviceProfile.model_validate(raw), details
