"""One model's training-step measurement, run as its own process.

``python -m edgefl.profile.child '{"model": "resnet18", "options": {...}, "batch": 32, ...}'``
prints one JSON object. A separate process gives a clean peak: the resident memory before the
model is built is the baseline, a 1 ms sampling thread gives the peak, and nothing the parent
allocated counts. Results travel as JSON on stdout, never pickled.

On Linux the training memory is the *anonymous* resident memory (``RssAnon`` in
``/proc/self/status``: tensors, the allocator's pools, Python objects). The file-backed part of
the RSS is library code paged in as new kernels run for the first time; how much of it a fault
maps depends on what the page cache already holds (the kernel maps pages around a fault when
they are cached), so it varied by 20 MiB between identical runs of CVAE-small. Where that
breakdown is not readable (macOS, Windows) the whole RSS is used, plus ``ru_maxrss``.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import threading
import time

import psutil
import torch
from torch.nn import functional as F


def anonymous_rss() -> int | None:
    """This process's anonymous resident bytes (Linux), None where the kernel does not say."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


class RssSampler:
    """Samples the process's resident memory every ``interval`` seconds and keeps the maximum:
    anonymous memory where Linux reports it (``method = "RssAnon"``), else the RSS."""

    def __init__(self, interval: float = 0.001) -> None:
        self.proc = psutil.Process()
        self.interval = interval
        self.method = "RssAnon" if anonymous_rss() is not None else "rss"
        self.baseline = self.read()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> int:
        if self.method == "RssAnon":
            return anonymous_rss() or 0
        return self.proc.memory_info().rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


def _warm_up_runtime(device: torch.device) -> None:
    """One tiny conv + linear training step: initialises the kernels' pools and buffers."""
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)).to(device)
    opt = torch.optim.Adam(net.parameters())
    loss = net(torch.rand(2, 1, 8, 8, device=device)).sum()
    loss.backward()
    opt.step()


def measure(spec: dict) -> dict:
    from edgefl.models import build_model, count_flops, example_inputs

    torch.set_num_threads(int(spec.get("threads") or torch.get_num_threads()))
    device = torch.device(spec.get("device", "cpu"))
    shape = tuple(spec["input_shape"])
    batch, steps, num_classes = int(spec["batch"]), int(spec["steps"]), int(spec.get("num_classes", 10))
    imported = psutil.Process().memory_info().rss
    _warm_up_runtime(device)
    # baseline after the runtime's own first-use allocations (thread pools, oneDNN/MKL
    # buffers), so train_memory_bytes is what this model's training step adds
    baseline = psutil.Process().memory_info().rss
    with RssSampler() as sampler:
        model = build_model(spec["model"], num_classes=num_classes, input_shape=shape, **spec.get("options", {})).to(device)
        params = sum(p.numel() for p in model.parameters())
        flops = count_flops(model, tuple(t.to(device) for t in example_inputs(model, 1, shape, num_classes)))
        inputs = tuple(t.to(device) for t in example_inputs(model, batch, shape, num_classes))
        y = (torch.arange(batch) % num_classes).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3) if spec.get("optimizer", "adam") == "adam" else torch.optim.SGD(
            model.parameters(), lr=0.01, momentum=0.9)
        conditional = getattr(model, "conditional", False)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def step() -> float:
            """One training step; returns the seconds the optimizer part took (zero_grad + step),
            which the cost model fits apart from the forward and backward passes."""
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            t_opt = time.perf_counter() - t0
            if conditional:
                recon, mu, logvar = model(*inputs)
                loss = model.loss(recon, inputs[0], mu, logvar)
            else:
                loss = F.cross_entropy(model(*inputs), y)
            loss.backward()
            sync()
            t1 = time.perf_counter()
            opt.step()
            sync()
            return t_opt + time.perf_counter() - t1

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model.train()
        step()  # warm-up: allocator, kernels, optimizer state
        step()  # the peak: a second step holds the optimizer state and a full autograd graph
        sync()
    # Timed after the sampler has stopped: its thread, waking every millisecond, took CPU time
    # from the training threads and made step times vary between runs of the same model.
    times, optimizer_times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        optimizer_times.append(step())
        times.append(time.perf_counter() - t0)
    model.eval()
    with torch.no_grad():
        model(*inputs)
        t0 = time.perf_counter()
        for _ in range(max(1, steps // 2)):
            model(*inputs)
        sync()
        infer = (time.perf_counter() - t0) / max(1, steps // 2)
    step_s = statistics.median(times)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    # ru_maxrss is the whole RSS: it bounds the peak only where the whole RSS is what is sampled
    peak = max(sampler.peak, maxrss) if sampler.method == "rss" else sampler.peak
    out = {
        "model": spec["model"], "options": spec.get("options", {}), "batch": batch, "params": params,
        "flops_per_sample": flops, "step_s": step_s, "step_s_all": times, "optimizer_s": statistics.median(optimizer_times),
        "train_gflops": 3 * flops * batch / step_s / 1e9,
        "infer_s_per_sample": infer / batch,
        "runtime_bytes": baseline - imported, "baseline_rss_bytes": baseline, "peak_rss_bytes": maxrss,
        "memory_method": sampler.method, "baseline_memory_bytes": sampler.baseline, "peak_memory_bytes": peak,
        "train_memory_bytes": peak - sampler.baseline,
        "param_bytes": params * 4,
    }
    if device.type == "cuda":
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        print(json.dumps(measure(spec)))
    except Exception as exc:  # reported to the parent as data; the parent decides what to show
        print(json.dumps({"model": spec.get("model"), "error": f"{type(exc).__name__}: {exc}"}))


if __name__ == "__main__":
    main()
