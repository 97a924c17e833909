"""Where a batched round's time goes on this device: torch.profiler over one timed round."""
import sys
import time
import warnings

sys.path.insert(0, "bench")
import torch
from torch.profiler import profile, ProfilerActivity
from common import load
from edgefl.config import validate_config
from edgefl.sim import Simulation
import batched_clients as bc

warnings.simplefilter("always")
try:
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
except Exception as e:
    print("no fallback warning switch", e)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2
count = int(sys.argv[2]) if len(sys.argv) > 2 else 100
ds = load()
for batch in ("on", "off"):
    raw = bc.config("fedavg", [{"model": "resnet18", "count": count, "options": {"width": 0.25}}], batch, steps)
    sim = Simulation(validate_config(raw), dataset=ds, show_progress=False)
    sim.run_round(1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        sim.run_round(2)
    print(f"\n===== batch_clients={batch}: round {time.perf_counter() - t0:.2f} s (profiled)", flush=True)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60), flush=True)
