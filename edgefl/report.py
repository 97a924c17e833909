"""Plots and tables of a run, drawn from its run directory alone (so ``edgefl report`` can
re-draw any finished or interrupted run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from edgefl.errors import EdgeflError
from edgefl.rundir import RunDir


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgeflError("plots need matplotlib", hint="pip install 'edgefl[sim]'") from None
    return plt


PARTITION_BARS_MAX = 100  # more clients: the partition is drawn as a clients x classes image


def draw_plots(run: RunDir) -> list[Path]:
    """Accuracy per round per architecture, the partition, and communication per round."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    metrics = run.metrics()
    out_dir = run.path / "plots"
    out_dir.mkdir(exist_ok=True)
    written: list[Path] = []

    def round_axis(ax, rounds: list[int]) -> None:
        """Whole rounds only; every round labelled when there are few."""
        if len(rounds) <= 20:
            ax.set_xticks(sorted(set(rounds)))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(min(rounds) - 0.6, max(rounds) + 0.6)

    evaluated = [m for m in metrics if m.get("accuracy") and m["accuracy"].get("overall") is not None]
    if evaluated:
        fig, ax = plt.subplots(figsize=(8, 5))
        archs = sorted({a for m in evaluated for a in m["accuracy"]["per_arch"]})
        rounds = [m["round"] for m in evaluated]
        for arch in archs:  # markers, so a single evaluation is a visible point
            ax.plot(rounds, [m["accuracy"]["per_arch"].get(arch) for m in evaluated], marker="o", markersize=4, linewidth=1, label=arch)
        ax.plot(rounds, [m["accuracy"]["overall"] for m in evaluated], color="black", marker="o", linewidth=2.5,
                label=f"overall ({OVERALL})")
        ax.set(xlabel="round", ylabel="test accuracy", title="Accuracy per round and architecture", ylim=(0, 1))
        round_axis(ax, rounds)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        written.append(_save(fig, out_dir / "accuracy.png", plt))

    _remove(out_dir / "communication.png")
    if any(m["bytes_up"] or m["bytes_down"] for m in metrics):  # a method that shares nothing gets no empty chart
        fig, ax = plt.subplots(figsize=(8, 4))
        rounds = [m["round"] for m in metrics]
        peak = max(max(m["bytes_up"], m["bytes_down"]) for m in metrics)
        unit, scale = next((u, f) for u, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("bytes", 1)) if peak >= f or f == 1)
        ax.bar([r - 0.2 for r in rounds], [m["bytes_up"] / scale for m in metrics], width=0.4, label="up (all clients)")
        ax.bar([r + 0.2 for r in rounds], [m["bytes_down"] / scale for m in metrics], width=0.4, label="down (all clients)")
        label = unit if unit == "bytes" else f"{unit} (10^{len(str(int(scale))) - 1} bytes)"
        ax.set(xlabel="round", ylabel=f"{label}, linear axis", title="Communication per round (serialised messages)")
        ax.set_ylim(bottom=0)
        round_axis(ax, rounds)
        ax.legend()
        written.append(_save(fig, out_dir / "communication.png", plt))

    timed = [m for m in metrics if m.get("virtual_time_by_profile")]
    if timed:
        fig, ax = plt.subplots(figsize=(8, 4))
        for profile in sorted({p for m in timed for p in m["virtual_time_by_profile"]}):
            ax.plot([m["round"] for m in timed], [m["virtual_time_by_profile"].get(profile) for m in timed], marker="o", label=profile)
        deadline = run.read_json("run.json").get("deadline_s") if (run.path / "run.json").is_file() else None
        if deadline:
            ax.axhline(deadline, color="red", linestyle="--", label=f"deadline {deadline:g} s")
        for m in timed:
            if m.get("stragglers"):
                ax.annotate(f"{len(m['stragglers'])} dropped", (m["round"], deadline or 0), fontsize=7, color="red")
        ax.set(xlabel="round", ylabel="virtual seconds (mean per device)", title="Round time by device class (virtual clock)")
        round_axis(ax, [m["round"] for m in timed])
        ax.legend(fontsize=7)
        written.append(_save(fig, out_dir / "round_time.png", plt))

    async_records = [m for m in metrics if m.get("mode") == "async"]
    if async_records:
        # an asynchronous run: accuracy against the clock it ran on, and who reported how often
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
        judged = [m for m in async_records if m["accuracy"] and m["accuracy"]["overall"] is not None]
        ax.plot([m["clock_s"] for m in judged], [m["accuracy"]["overall"] for m in judged], color="black", marker="o")
        clock = "virtual seconds" if async_records[0].get("virtual_clock") else "seconds"
        ax.set(xlabel=clock, ylabel="test accuracy (overall)", title="Accuracy over time (asynchronous run)", ylim=(0, 1))
        ax.grid(alpha=0.3)
        totals: dict[str, int] = {}
        for m in async_records:
            for key, n in (m.get("reports_by_profile") or {}).items():
                totals[key] = totals.get(key, 0) + n
        bx.bar(list(totals), list(totals.values()))
        bx.set(ylabel="reports accepted", title="Reports by device class (- : no class)")
        bx.tick_params(axis="x", labelrotation=30)
        written.append(_save(fig, out_dir / "async.png", plt))

    part_path = run.path / "partition.json"
    if part_path.is_file():
        part = run.read_json("partition.json")
        clients = part["clients"]
        if len(clients) > PARTITION_BARS_MAX:
            # thousands of bars (and ids) would make a figure metres wide: one column per client
            fig, ax = plt.subplots(figsize=(10, 4))
            counts = [[cl["class_counts"][c] for cl in clients] for c in range(len(part["class_names"]))]
            image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis")
            ax.set_yticks(range(len(part["class_names"])), part["class_names"], fontsize=7)
            ax.set(xlabel=f"client (0 .. {len(clients) - 1}, config order)", title="Training samples per client and class")
            fig.colorbar(image, ax=ax, label="samples")
        else:
            fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(clients)), 4))
            bottoms = [0] * len(clients)
            for c, name in enumerate(part["class_names"]):
                vals = [cl["class_counts"][c] for cl in clients]
                ax.bar(range(len(clients)), vals, bottom=bottoms, label=name)
                bottoms = [b + v for b, v in zip(bottoms, vals)]
            ax.set_xticks(range(len(clients)), [cl["client_id"] for cl in clients], rotation=60, fontsize=7)
            ax.set(ylabel="samples", title="Training samples per client and class")
            ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
        written.append(_save(fig, out_dir / "partition.png", plt))
    return written


#: what "overall" means everywhere (plots, tables, summary.json): edgefl.server.evaluation
OVERALL = "mean over judged devices"


def _remove(path: Path) -> None:
    if path.is_file():
        path.unlink()


def _save(fig: Any, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_table(run: RunDir) -> Table:
    """Final accuracy per architecture and overall, with the best round for each."""
    evaluated = [m for m in run.metrics() if m.get("accuracy") and m["accuracy"].get("overall") is not None]
    table = Table(title=f"accuracy - {run.path}")
    table.add_column("architecture")
    table.add_column("clients", justify="right")
    table.add_column("final", justify="right")
    table.add_column("best (round)", justify="right")
    if not evaluated:
        return table
    final = evaluated[-1]["accuracy"]
    if final.get("overall") is None:
        return table
    counts: dict[str, int] = {}
    part_path = run.path / "partition.json"
    if part_path.is_file():
        for cl in run.read_json("partition.json")["clients"]:
            counts[cl["arch"]] = counts.get(cl["arch"], 0) + 1
    for arch in sorted(final["per_arch"]):
        best = max(evaluated, key=lambda m: m["accuracy"]["per_arch"].get(arch, -1))
        table.add_row(arch, str(counts.get(arch, "")), f"{final['per_arch'][arch]:.4f}",
                      f"{best['accuracy']['per_arch'][arch]:.4f} ({best['round']})")
    best = max(evaluated, key=lambda m: m["accuracy"]["overall"])
    judged = sum(counts.get(arch, 0) for arch in final["per_arch"])  # generator clients are not judged
    table.add_row(f"[bold]overall ({OVERALL})", str(judged or ""), f"[bold]{final['overall']:.4f}",
                  f"{best['accuracy']['overall']:.4f} ({best['round']})")
    return table


def communication_table(run: RunDir) -> Table:
    metrics = run.metrics()
    table = Table(title="communication")
    for col in ("", "total", "per round", "per client per round"):
        table.add_column(col, justify="right")
    n_sel = sum(len(m["selected"]) for m in metrics) or 1
    for key in ("bytes_up", "bytes_down"):
        total = sum(m[key] for m in metrics)
        table.add_row(key.replace("bytes_", ""), human_bytes(total), human_bytes(total / len(metrics)), human_bytes(total / n_sel))
    return table


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
