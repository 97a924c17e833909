"""Benchmark 19: what federation buys in the main job (`./dev.sh demo`), over seeds.

Each run is the real command, `edgefl simulate` on the embedded demo preset (or CONFIG) with its
Local-only baseline (`simulation.baseline = "local"`), one at a time; the table gives the method's
final overall accuracy, the baseline's, and the gain, per seed and as mean +- std, with the wall and
CPU time of each whole run (method and baseline). `--methods fedavg,fedhe` runs other methods on the
same fleet; the baseline does not depend on the method, so it runs once per seed, with the first
method, and the others are compared with it.

    ./dev.sh bench demo_gain --seeds 0,1,2
    ./dev.sh bench demo_gain --seeds 0,1,2 --methods fedhe --set 'method.alpha=0.3'
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import mean_std, save

EDGEFL = shutil.which("edgefl", path=str(Path(sys.executable).parent)) or "edgefl"


def one_run(config: str | None, method: str | None, seed: int, sets: list[str], out: Path, baseline: dict | None = None) -> dict:
    """One `edgefl simulate`; ``baseline``: that seed's Local-only numbers from an earlier run (none is trained then)."""
    cmd = [EDGEFL, "simulate", *([config] if config else []), "--quiet", "--out", str(out), "--set", f"seed={seed}",
           "--set", f'simulation.baseline="{"none" if baseline else "local"}"']
    if method:
        cmd += ["--set", f'method.name="{method}"']
    for s in sets:
        cmd += ["--set", s]
    before, t0 = os.times(), time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall, after = time.perf_counter() - t0, os.times()
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    if baseline is None:
        base = summary["baseline"]
        theirs, base_wall = base["accuracy"], json.loads((out / "baseline" / "summary.json").read_text()).get("wall_time_s")
    else:
        theirs, base_wall = baseline, None
    mine = {"overall": summary["final_accuracy"]["overall"], "per_arch": summary["final_accuracy"]["per_arch"]}
    gain = {"overall": mine["overall"] - theirs["overall"],
            "per_arch": {a: mine["per_arch"][a] - theirs["per_arch"][a] for a in mine["per_arch"] if a in theirs["per_arch"]}}
    return {
        "seed": seed, "method": summary["method"], "command": " ".join(cmd[1:]), "baseline_reused": baseline is not None,
        "accuracy": mine, "baseline_accuracy": theirs, "gain": gain, "round": summary["rounds"],
        "bytes": summary["bytes_up_total"] + summary["bytes_down_total"],
        "fedavg_bytes": summary["fedavg_equivalent"]["bytes_up_total"] + summary["fedavg_equivalent"]["bytes_down_total"],
        "wall_s": round(wall, 1), "cpu_s": round(after.children_user - before.children_user + after.children_system - before.children_system, 1),
        "method_wall_s": summary.get("wall_time_s"), "baseline_wall_s": base_wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", help="run config (default: the embedded demo preset)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default="", help="comma-separated method names (default: the config's own)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a config override for every run (repeatable)")
    ap.add_argument("--tag", default="", help="suffix of bench/results/demo_gain[-TAG].json")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = [m for m in args.methods.split(",") if m] or [None]
    runs = []
    with tempfile.TemporaryDirectory(prefix="demo-gain-") as tmp:
        for seed in seeds:
            baseline = None
            for method in methods:
                run = one_run(args.config, method, seed, args.sets, Path(tmp) / f"{method or 'preset'}-s{seed}", baseline)
                baseline = run["baseline_accuracy"]
                runs.append(run)
                print(f"{run['method']:>8} seed {seed}: {100 * run['accuracy']['overall']:.2f} vs Local-only "
                      f"{100 * run['baseline_accuracy']['overall']:.2f} ({100 * run['gain']['overall']:+.2f}) at round {run['round']}, "
                      f"wall {run['wall_s']:.0f} s, CPU {run['cpu_s']:.0f} s", flush=True)
    print()
    print("| method | accuracy | Local-only | gain (points) | gain per seed | wall per run | CPU per run |")
    print("|---|---|---|---|---|---|---|")
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method]
        a, sa = mean_std([100 * r["accuracy"]["overall"] for r in mine])
        b, sb = mean_std([100 * r["baseline_accuracy"]["overall"] for r in mine])
        g, sg = mean_std([100 * r["gain"]["overall"] for r in mine])
        per_seed = " / ".join(f"{100 * r['gain']['overall']:+.2f}" for r in mine)
        wall, _ = mean_std([r["wall_s"] for r in mine])
        cpu, _ = mean_std([r["cpu_s"] for r in mine])
        print(f"| {method} | {a:.2f} +- {sa:.2f} | {b:.2f} +- {sb:.2f} | **{g:+.2f} +- {sg:.2f}** | {per_seed} | {wall:.0f} s | {cpu:.0f} s |")
        archs = sorted(mine[0]["gain"]["per_arch"])
        for arch in archs:
            ga, sga = mean_std([100 * r["gain"]["per_arch"][arch] for r in mine])
            print(f"|   {arch} | {mean_std([100 * r['accuracy']['per_arch'][arch] for r in mine])[0]:.2f} | "
                  f"{mean_std([100 * r['baseline_accuracy']['per_arch'][arch] for r in mine])[0]:.2f} | {ga:+.2f} +- {sga:.2f} | | | |")
    path = save(f"demo_gain{'-' + args.tag if args.tag else ''}", {"runs": runs, "seeds": seeds, "sets": args.sets, "config": args.config})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
