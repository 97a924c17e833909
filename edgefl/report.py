"""Plots and tables of a run, drawn from its run directory alone (so ``edgefl report`` can
re-draw any finished or interrupted run)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from edgefl.baseline import BASELINE_LABEL, baseline_metrics, compare
from edgefl.errors import EdgeflError
from edgefl.rundir import RunDir
from edgefl.safetext import console_text, printable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgeflError("plots need matplotlib", hint="pip install -e '.[sim]' in the edgefl checkout") from None
    return plt


PARTITION_BARS_MAX = 100  # more clients: the partition is drawn as a clients x classes image
#: how plots name methods (the config's name otherwise)
METHOD_NAMES = {"fedhe": "FedHe", "fedavg": "FedAvg-groups", "local": BASELINE_LABEL, "felo": "Felo", "velo": "Velo", "fedin": "FedIN",
                "chfl": "CHFL", "fedmho": "FedMHO", "fedmho-md": "FedMHO-MD", "fedmho-sd": "FedMHO-SD", "fedcvae": "FedCVAE-Ens"}
DATASET_NAMES = {"fashion-mnist": "Fashion-MNIST", "mnist": "MNIST", "digits": "digits (scikit-learn)", "breast-cancer": "breast cancer"}


def run_facts(run: RunDir) -> dict[str, Any]:
    """Method, data set, partition, devices and seed of a run, from its config.toml (empty when
    the file is missing or unreadable: a plot then goes without them)."""
    try:
        cfg = tomllib.loads((run.path / "config.toml").read_text())
    except (OSError, ValueError):
        return {}
    data = cfg.get("data") or {}
    name = str((cfg.get("method") or {}).get("name", "?"))
    part = data.get("partition", "dirichlet")
    partition = {"dirichlet": f"Dirichlet({data.get('alpha', 0.5):g})", "iid": "IID",
                 "shards": f"{data.get('shards_per_client', 2)} label shards per device", "devices": "devices' own data",
                 "contiguous": "contiguous parts"}.get(part, part)
    devices = sum(int(g.get("count", 1)) for g in (cfg.get("fleet") or {}).get("groups", []))
    dataset = DATASET_NAMES.get(data.get("dataset", ""), data.get("idx_name") or data.get("dataset", "?"))
    return {"method": METHOD_NAMES.get(name, name), "method_id": name, "dataset": dataset, "partition": partition,
            "devices": devices, "seed": cfg.get("seed", 0), "mode": cfg.get("mode", "sync")}


def run_title(run: RunDir) -> str:
    """``FedHe on Fashion-MNIST, Dirichlet(0.5), 10 devices, seed 0``: what a figure is about."""
    f = run_facts(run)
    if not f:
        return run.path.name
    return f"{f['method']} on {f['dataset']}, {f['partition']}, {f['devices']} devices, seed {f['seed']}"


def line_styles(n: int) -> list[dict[str, Any]]:
    """Ten clearly different colours (tab10), then the same colours dashed, dotted...: lines stay
    apart for any number of architectures, and markers differ too."""
    from matplotlib import colormaps

    colours = colormaps["tab10"].colors
    dashes, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h"]
    return [{"color": colours[i % 10], "linestyle": dashes[(i // 10) % len(dashes)], "marker": markers[i % len(markers)]} for i in range(n)]


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
        written.append(_accuracy_plot(run, evaluated, out_dir, plt, round_axis))

    _remove(out_dir / "communication.png")
    if any(m["bytes_up"] or m["bytes_down"] for m in metrics):  # a method that shares nothing gets no empty chart
        fig, ax = plt.subplots(figsize=(8, 4))
        rounds = [m["round"] for m in metrics]
        peak = max(max(m["bytes_up"], m["bytes_down"]) for m in metrics)
        unit, scale = next((u, f) for u, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("bytes", 1)) if peak >= f or f == 1)
        ax.bar([r - 0.2 for r in rounds], [m["bytes_up"] / scale for m in metrics], width=0.4, label="up (all clients)")
        ax.bar([r + 0.2 for r in rounds], [m["bytes_down"] / scale for m in metrics], width=0.4, label="down (all clients)")
        label = unit if unit == "bytes" else f"{unit} (10^{len(str(int(scale))) - 1} bytes)"
        ax.set(xlabel="round", ylabel=f"{label}, linear axis", title=f"Communication per round (serialised messages)\n{run_title(run)}")
        ax.set_ylim(bottom=0)
        round_axis(ax, rounds)
        fedavg = _fedavg_equivalent(run)
        if fedavg and fedavg.get("per_round_up") and run_facts(run).get("method_id") != "fedavg":
            # FedAvg's weights would dwarf these bars on a linear axis: said in words instead
            up, down = fedavg["per_round_up"], fedavg["per_round_down"]
            mine = sum(m["bytes_up"] + m["bytes_down"] for m in metrics) / len(metrics)
            # under the axes, where it covers no bar; sizes as the console's communication table writes them
            ax.text(0, -0.2, f"FedAvg (every device's weights) would send {human_bytes(up)} up and {human_bytes(down)} down per round: "
                    f"{(up + down) / max(mine, 1):,.0f} x this method's traffic", transform=ax.transAxes, va="top", fontsize=8.5,
                    bbox={"boxstyle": "round", "facecolor": "#fff8e1", "edgecolor": "#c9a227"})
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
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
        ax.set(xlabel="round", ylabel="virtual seconds (mean per device)", title=f"Round time by device class (virtual clock)\n{run_title(run)}")
        round_axis(ax, [m["round"] for m in timed])
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        written.append(_save(fig, out_dir / "round_time.png", plt))

    _remove(out_dir / "stages.png")
    staged = [m for m in metrics if m.get("mode") != "async"]
    if has_stages(staged):
        written.append(_stages_plot(run, staged, out_dir, plt, round_axis))

    async_records = [m for m in metrics if m.get("mode") == "async"]
    if async_records:
        # an asynchronous run: accuracy against the clock it ran on, and who reported how often
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
        judged = [m for m in async_records if m["accuracy"] and m["accuracy"]["overall"] is not None]
        ax.plot([m["clock_s"] for m in judged], [m["accuracy"]["overall"] for m in judged], color="black", marker="o")
        clock = "virtual seconds" if async_records[0].get("virtual_clock") else "seconds"
        ax.set(xlabel=clock, ylabel=f"{accuracy_axis_label(judged)} (overall)", title=f"Accuracy over time (asynchronous run)\n{run_title(run)}", ylim=(0, 1))
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
            ax.set(xlabel=f"client (0 .. {len(clients) - 1}, config order)", title=f"Training samples per client and class\n{run_title(run)}")
            fig.colorbar(image, ax=ax, label="samples")
        else:
            fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(clients)), 4.8))
            bottoms = [0] * len(clients)
            for c, name in enumerate(part["class_names"]):
                vals = [cl["class_counts"][c] for cl in clients]
                ax.bar(range(len(clients)), vals, bottom=bottoms, label=name)
                bottoms = [b + v for b, v in zip(bottoms, vals)]
            # each device's model under its id: which architecture saw which classes
            ax.set_xticks(range(len(clients)), [f"{cl['client_id']}: {cl['arch']}" for cl in clients], rotation=60, fontsize=7,
                          ha="right", rotation_mode="anchor")
            ax.set(ylabel="samples", title=f"Training samples per client and class\n{run_title(run)}")
            ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
        written.append(_save(fig, out_dir / "partition.png", plt))
    return written


#: what "overall" means everywhere (plots, tables, summary.json): edgefl.server.evaluation
OVERALL = "mean over judged devices"


def _fedavg_equivalent(run: RunDir) -> dict[str, Any] | None:
    try:
        return run.read_json("summary.json").get("fedavg_equivalent")
    except (OSError, ValueError, AttributeError):
        return None


def accuracy_axis_label(records: list[dict[str, Any]]) -> str:
    """The y label of an accuracy plot, from what the last evaluated record says it was measured on
    (``accuracy.judged_on``): a run whose devices hold their data has no test set to name."""
    judged = next((m["accuracy"].get("judged_on") for m in reversed(records)
                   if isinstance(m.get("accuracy"), dict) and m["accuracy"].get("judged_on")), None)
    if not isinstance(judged, str):
        return "accuracy"
    if "validation data" in judged:
        return "validation accuracy (devices' own data)" + (" / test accuracy" if "test set" in judged else "")
    if "test split" in judged:
        return "test accuracy (devices' own test splits)"
    return "test accuracy" if "test set" in judged else "accuracy"


def _accuracy_plot(run: RunDir, evaluated: list[dict[str, Any]], out_dir: Path, plt, round_axis) -> Path:
    """Accuracy per round: one line per architecture, the overall mean in black and, when the run
    has one, the Local-only baseline's overall mean dashed, with a second panel of the final
    accuracy per architecture, method beside baseline. Legends sit outside the data."""
    facts = run_facts(run)
    method = facts.get("method", "method")
    base = baseline_metrics(run)
    base_eval = [m for m in base or [] if m.get("accuracy") and m["accuracy"].get("overall") is not None]
    archs = sorted({a for m in evaluated for a in m["accuracy"]["per_arch"]})
    rounds = [m["round"] for m in evaluated]
    if base_eval:
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [1.35, 1]})
    else:
        fig, ax = plt.subplots(figsize=(11, 5.5))
        bx = None
    for arch, style in zip(archs, line_styles(len(archs))):  # markers, so a single evaluation is a visible point
        ax.plot(rounds, [m["accuracy"]["per_arch"].get(arch) for m in evaluated], markersize=4, linewidth=1.2, alpha=0.9,
                label=arch, **style)
    ax.plot(rounds, [m["accuracy"]["overall"] for m in evaluated], color="black", marker="o", linewidth=2.8,
            label=f"{method}, overall ({OVERALL})")
    if base_eval:
        ax.plot([m["round"] for m in base_eval], [m["accuracy"]["overall"] for m in base_eval], color="black", linestyle="--",
                marker="o", markerfacecolor="white", linewidth=2.2, label=f"{BASELINE_LABEL} baseline, overall (no communication)")
    ax.set(xlabel="round", ylabel=accuracy_axis_label(evaluated), title=f"{method}: accuracy per round and architecture", ylim=(0, 1))
    round_axis(ax, rounds + [m["round"] for m in base_eval])
    ax.grid(alpha=0.3)
    if bx is None:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    else:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, borderaxespad=0)
        _gain_bars(bx, run, method)
    fig.suptitle(run_title(run), fontsize=12, fontweight="bold")
    return _save(fig, out_dir / "accuracy.png", plt)


def _stages_plot(run: RunDir, metrics: list[dict[str, Any]], out_dir: Path, plt, round_axis) -> Path:
    """Devices that dropped out per round, stacked by the stage they did not answer (and, secured,
    those that shared keys but sent no masked upload); failed rounds marked with a red x and listed
    with their reason under the axes; the title says how many rounds were secured."""
    rounds = [m["round"] for m in metrics]
    names = list(dict.fromkeys(name for m in metrics for name in (m.get("stages") or {})))
    series = [(f"no answer in stage {name}", [len(stage_drops(m).get(name, [])) for m in metrics]) for name in names]
    after = [len(dropped_after_sharing(m)) for m in metrics]
    if any(after):
        series.append(("secured: shared keys, no masked upload", after))
    fig, ax = plt.subplots(figsize=(10, 5))
    bottom = [0] * len(metrics)
    for (label, counts), style in zip(series, line_styles(len(series))):
        ax.bar(rounds, counts, bottom=bottom, width=0.6, label=label, color=style["color"])
        bottom = [b + c for b, c in zip(bottom, counts)]
    failed = [m for m in metrics if m.get("outcome") == "failed"]
    if failed:
        top = max(bottom + [1])
        ax.plot([m["round"] for m in failed], [top * 1.08] * len(failed), linestyle="none", marker="x", color="#b4321e",
                markersize=9, markeredgewidth=2, label="round failed")
        reasons = [f"round {m['round']}: {printable(m.get('failure') or 'no quorum by the deadline', 140)}" for m in failed[:4]]
        if len(failed) > 4:
            reasons.append(f"and {len(failed) - 4} more failed rounds")
        ax.text(0, -0.18, "\n".join(reasons), transform=ax.transAxes, va="top", fontsize=8, color="#b4321e",
                parse_math=False)  # a reason may quote a device id: "$" is no mathtext here
    secured = sum(1 for m in metrics if was_secured(m))
    note = f"secure aggregation: {secured} of {len(metrics)} rounds secured" if any(secagg_facts(m) for m in metrics) else ""
    ax.set(xlabel="round", ylabel="devices dropped out",
           title="\n".join(["Devices that dropped out of a round, by stage", *([note] if note else []), run_title(run)]))
    ax.set_ylim(bottom=0, top=max(bottom + [1]) * 1.2)
    ax.yaxis.get_major_locator().set_params(integer=True)
    round_axis(ax, rounds)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, out_dir / "stages.png", plt)


def _gain_bars(ax, run: RunDir, method: str) -> None:
    """Final accuracy per architecture and overall: the method against Local-only, the gain written beside."""
    comparison = compare(run)
    if not comparison or comparison.get("round") is None:
        ax.set_axis_off()
        return
    mine, theirs = comparison["method_accuracy"], comparison["accuracy"]
    rows = [a for a in mine["per_arch"] if a in theirs["per_arch"]]
    counts: dict[str, int] = {}
    if (run.path / "partition.json").is_file():
        for cl in run.read_json("partition.json")["clients"]:
            counts[cl["arch"]] = counts.get(cl["arch"], 0) + 1
    labels = [f"{r} x{counts[r]}" if r in counts else r for r in rows] + ["overall"]
    a = [mine["per_arch"][r] for r in rows] + [mine["overall"]]
    b = [theirs["per_arch"][r] for r in rows] + [theirs["overall"]]
    ys = list(range(len(labels)))[::-1]  # the first architecture on top, overall at the bottom
    h = 0.38
    ax.barh([y + h / 2 for y in ys], a, height=h, color="#1f77b4", label=method)
    ax.barh([y - h / 2 for y in ys], b, height=h, color="#bbbbbb", hatch="//", edgecolor="#777", label=f"{BASELINE_LABEL} (no communication)")
    for y, x1, x2 in zip(ys, a, b):
        gain = 100 * (x1 - x2)
        ax.text(max(x1, x2) + 0.01, y, f"{gain:+.1f}", va="center", fontsize=8, color="#18794e" if gain > 0 else "#b4321e",
                fontweight="bold")
    ax.set_yticks(ys, labels, fontsize=8)
    ax.get_yticklabels()[-1].set_fontweight("bold")
    ax.set_xlim(0, 1.12)
    ax.set(xlabel="test accuracy", title=f"Final accuracy (round {comparison['round']}); gain in points")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, borderaxespad=0)


def _remove(path: Path) -> None:
    if path.is_file():
        path.unlink()


def _save(fig: Any, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_table(run: RunDir) -> Table:
    """Final accuracy per architecture and overall, with the best round for each, and, when the
    run has a Local-only baseline, its accuracy at the same round and the gain over it."""
    evaluated = [m for m in run.metrics() if m.get("accuracy") and m["accuracy"].get("overall") is not None]
    comparison = compare(run)
    against = comparison if comparison and comparison.get("round") is not None else None
    table = Table(title=f"accuracy - {run_title(run)} - {run.path}")
    table.add_column("architecture")
    table.add_column("clients", justify="right")
    table.add_column("final", justify="right")
    unit = "update" if any(m.get("mode") == "async" for m in evaluated) else "round"  # an asynchronous run numbers server updates
    table.add_column(f"best ({unit})", justify="right")
    if against is not None:
        at = "" if against["round"] == (evaluated[-1]["round"] if evaluated else None) else f" (round {against['round']})"
        table.add_column(f"{BASELINE_LABEL}{at}", justify="right")
        table.add_column("gain (points)", justify="right")
    if not evaluated:  # (every round failed, or none was evaluated yet): said in the table, not an empty frame
        table.add_row("no round was evaluated", "", "-", "-", *(["-", "-"] if against is not None else []))
        return table
    final = evaluated[-1]["accuracy"]
    if final.get("overall") is None:
        return table
    counts: dict[str, int] = {}
    part_path = run.path / "partition.json"
    if part_path.is_file():
        for cl in run.read_json("partition.json")["clients"]:
            counts[cl["arch"]] = counts.get(cl["arch"], 0) + 1
    def versus(arch: str | None) -> list[str]:
        if against is None:
            return []
        theirs = against["accuracy"]["overall"] if arch is None else against["accuracy"]["per_arch"].get(arch)
        gain = against["gain"]["overall"] if arch is None else against["gain"]["per_arch"].get(arch)
        if theirs is None or gain is None:
            return ["", ""]
        colour = "green" if gain > 0 else "red" if gain < 0 else "white"
        return [f"{theirs:.4f}", f"[{colour}]{100 * gain:+.2f}[/]"]

    for arch in sorted(final["per_arch"]):
        best = max(evaluated, key=lambda m: m["accuracy"]["per_arch"].get(arch, -1))
        table.add_row(arch, str(counts.get(arch, "")), f"{final['per_arch'][arch]:.4f}",
                      f"{best['accuracy']['per_arch'][arch]:.4f} ({best['round']})", *versus(arch))
    best = max(evaluated, key=lambda m: m["accuracy"]["overall"])
    # the devices the record judged (with eval.unselected = "last_reported", perhaps not all); generator clients are not judged
    judged = len(final["per_client"]) if final.get("per_client") else sum(counts.get(arch, 0) for arch in final["per_arch"])
    table.add_row(f"[bold]overall ({OVERALL})", str(judged or ""), f"[bold]{final['overall']:.4f}",
                  f"{best['accuracy']['overall']:.4f} ({best['round']})", *versus(None))
    earlier = final.get("reported_earlier") or {}
    if earlier:  # devices judged by their own latest report: say whose is old (a device that died keeps its last one)
        whose = few([f"{console_text(str(d), 64)} ({unit} {r})" for d, r in earlier.items()], 5)
        last = evaluated[-1]
        since = final.get("reported_earlier_than")  # an asynchronous record: the first update of its window
        when = (f"before update {since}, the first of the last record's window (offline, busy or not asked since)"
                if since is not None else f"earlier {unit}s (offline, busy or not asked when {unit} {last['round']} was judged)")
        table.caption = f"{len(earlier)} of {judged} devices' accuracies are from {when}: {whose}"
    return table


def communication_table(run: RunDir) -> Table:
    """Bytes up and down, and (when the run recorded it) what FedAvg would have sent instead: every
    device's weights, each way, for the same rounds and devices."""
    metrics = run.metrics()
    table = Table(title="communication")
    # an asynchronous record selects no one: its units are the record and the report it counted
    asynchronous = any(m.get("mode") == "async" for m in metrics)
    for col in ("", "total", *(("per record", "per report") if asynchronous else ("per round", "per client per round"))):
        table.add_column(col, justify="right")
    if asynchronous:
        n_sel = sum(int(m.get("reports") or 0) for m in metrics) or 1
    else:
        n_sel = sum(len(m["selected"]) for m in metrics) or 1
    for key in ("bytes_up", "bytes_down"):
        total = sum(m[key] for m in metrics)
        table.add_row(key.replace("bytes_", ""), human_bytes(total), human_bytes(total / len(metrics)), human_bytes(total / n_sel))
    fedavg = _fedavg_equivalent(run)
    if fedavg and metrics and run_facts(run).get("method_id") != "fedavg":  # FedAvg's own bytes are these already
        for way in ("up", "down"):
            total = fedavg[f"bytes_{way}_total"]
            table.add_row(f"[dim]{way}, FedAvg would send (weights)[/]", f"[dim]{human_bytes(total)}", f"[dim]{human_bytes(total / len(metrics))}",
                          f"[dim]{human_bytes(total / n_sel)}")
    return table


def participation_notes(run: RunDir) -> list[str]:
    """Who did not take part, and why, in a few lines: devices that declined (their data or
    profile did not fit), devices missing from rounds, and the refusals the server counted."""
    notes: list[str] = []
    try:
        clients = run.read_json("partition.json").get("clients", [])
    except (OSError, ValueError, AttributeError):
        clients = []
    declined = [c for c in clients if isinstance(c, dict) and c.get("stage") == "declined"]
    for c in declined[:8]:
        notes.append(f"{printable(c.get('client_id'), 64)} declined: {printable(c.get('reason') or 'no reason given', 200)}")
    if len(declined) > 8:
        notes.append(f"and {len(declined) - 8} more devices declined (partition.json)")
    missed: dict[str, list[int]] = {}
    for m in run.metrics() if (run.path / "metrics.jsonl").is_file() else []:
        for device in m.get("missing") or []:
            missed.setdefault(str(device), []).append(m.get("round"))
    for device, rounds in sorted(missed.items(), key=lambda kv: -len(kv[1]))[:8]:
        notes.append(f"{printable(device, 64)} missing in {len(rounds)} round{'s' if len(rounds) > 1 else ''} "
                     f"({few([str(r) for r in rounds], 6)}; metrics.jsonl: receipts say why)")
    if len(missed) > 8:
        notes.append(f"and {len(missed) - 8} more devices missing in some rounds")
    try:
        rejections = run.read_json("summary.json").get("rejections") or {}
        refused = rejections.get("count", 0)
    except (OSError, ValueError, AttributeError):
        rejections, refused = {}, 0
    if isinstance(refused, int) and not isinstance(refused, bool) and refused > 0:
        notes.append(f"{refused} message{'s' if refused > 1 else ''} refused (summary.json: rejections, by reason and sender)")
        by_reason = rejections.get("by_reason") if isinstance(rejections.get("by_reason"), dict) else {}
        examples = rejections.get("examples") if isinstance(rejections.get("examples"), dict) else {}
        for reason, count in list(by_reason.items())[:5]:  # the most common first, as the record keeps them
            shown = examples.get(reason, reason)  # the first refusal word for word, where the reason was folded
            notes.append(f"  {count} x {printable(shown, 160)}")
    return notes


def few(ids: list[str], show: int = 8) -> str:
    """``a, b, c and 5 more``."""
    return ", ".join(str(i) for i in ids[:show]) + (f" and {len(ids) - show} more" if len(ids) > show else "")


def secagg_facts(record: dict[str, Any]) -> dict[str, Any]:
    """The record's secure aggregation (``filters.secagg``), or {} when the round had none."""
    filters = record.get("filters")
    secagg = filters.get("secagg") if isinstance(filters, dict) else None
    return secagg if isinstance(secagg, dict) else {}


def was_secured(record: dict[str, Any]) -> bool:
    """Whether the round's aggregate was secured: a round that failed (its sum never released) was not,
    whatever its key exchange did."""
    return bool(secagg_facts(record).get("secured")) and record.get("outcome") != "failed"


def dropped_after_sharing(record: dict[str, Any]) -> list[str]:
    """Devices of a secured round that shared their keys but whose masked upload never came."""
    groups = secagg_facts(record).get("groups") or {}
    return sorted(str(d) for g in groups.values() if isinstance(g, dict) for d in g.get("dropped_after_sharing") or [])


def stage_drops(record: dict[str, Any]) -> dict[str, list[str]]:
    """stage -> the devices that did not answer it, for the stages where someone did not."""
    stages = record.get("stages")
    if not isinstance(stages, dict):
        return {}
    return {str(name): [str(d) for d in facts["dropped"]] for name, facts in stages.items()
            if isinstance(facts, dict) and facts.get("dropped")}


def privacy_sources(record: dict[str, Any]) -> dict[str, Any]:
    """A record's privacy facts by name: its filters' (``filters.<name>``) and DP-SGD's (``dp_sgd``,
    from the devices' uploads: server.records.DPSGDLedger, as ``dp-sgd``)."""
    sources = dict(record.get("filters") or {})
    if isinstance(record.get("dp_sgd"), dict):
        sources["dp-sgd"] = record["dp_sgd"]
    return sources


def privacy_spent(record: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """The epsilon each differential-privacy filter reports after this round, with its delta
    (``filters.<name>.epsilon``, or ``epsilon_max`` over devices for local DP), and DP-SGD's
    largest device epsilon so far (``dp_sgd``, as ``dp-sgd``)."""
    out = {}
    for name, facts in privacy_sources(record).items():
        if not isinstance(facts, dict):
            continue
        epsilon = facts.get("epsilon", facts.get("epsilon_max"))
        if isinstance(epsilon, (int, float)) and isinstance(facts.get("delta"), (int, float)):
            out[str(name)] = (float(epsilon), float(facts["delta"]))
    return out


def privacy_notes(record: dict[str, Any]) -> list[str]:
    """``dp-fedavg epsilon 2.31 (delta 1e-05)`` for each DP filter of the round, with ``, noise
    multiplier 0.41 this round`` when its released sum held fewer devices than its noise was split over."""
    sources = privacy_sources(record)
    notes = []
    for name, (eps, delta) in privacy_spent(record).items():
        lower = (sources.get(name) or {}).get("released_noise_multiplier")
        short = f", noise multiplier {lower:.3g} this round (devices missing from the sum)" if isinstance(lower, (int, float)) else ""
        notes.append(f"{name} epsilon {eps:.3g} (delta {delta:g}){short}")
    return notes


def lr_note(record: dict[str, Any]) -> str | None:
    """``lr X`` (``train.lr_milestones``: the rate the round trained with; ``lr ARCH X, ...`` when groups
    train on schedules of their own), or None for a run without a schedule. Keys can come from a
    file: callers escape the line."""
    rate = record.get("lr")
    if isinstance(rate, (int, float)):
        return f"lr {rate:.3g}"
    if isinstance(rate, dict):  # each architecture's (or group's) rate, in the record's sorted order
        return "lr " + ", ".join(f"{key} {value:.3g}" for key, value in sorted(rate.items()) if isinstance(value, (int, float)))
    return None


def stage_notes(record: dict[str, Any], show: int = 8) -> list[str]:
    """What a round's stages and secure aggregation add to its console line: ``secured``, who
    dropped out of which stage (``dropped in secagg-unmask: client-7``), who shared keys but sent
    no masked upload, and why the round failed (``why: ...``). Empty for a round without them. Not escaped: ids
    and reasons come from the network, the caller escapes them for where it prints."""
    notes = ["secured"] if was_secured(record) else []
    notes += privacy_notes(record)
    notes += [f"dropped in {name}: {few(ids, show)}" for name, ids in stage_drops(record).items()]
    after = dropped_after_sharing(record)
    if after:
        notes.append(f"shared keys, no masked upload: {few(after, show)}")
    if record.get("failure"):
        notes.append(f"why: {record['failure']}")  # (the line says "failed" already)
    return notes


def has_stages(metrics: list[dict[str, Any]]) -> bool:
    """Any round of the run ran stages, was secured or failed in a stage."""
    return any(m.get("stages") or secagg_facts(m) or m.get("failure") for m in metrics)


#: rounds the rounds table lists in full; a longer run lists only its rounds with drop-outs or failures
ROUNDS_TABLE_MAX = 30


def rounds_table(run: RunDir) -> Table | None:
    """A run with stages or secure aggregation: per round, its outcome, whether it was secured,
    how many devices dropped out in which stage (and the first of them), and why a failed round
    failed. None for a run without stages. Ids and reasons are escaped (they come from devices)."""
    from edgefl.safetext import console_text

    metrics = [m for m in run.metrics() if m.get("mode") != "async"]
    if not has_stages(metrics):
        return None
    eventful = [m for m in metrics if m.get("outcome") == "failed" or m.get("failure") or stage_drops(m) or dropped_after_sharing(m)]
    rows = metrics if len(metrics) <= ROUNDS_TABLE_MAX else eventful
    secured = sum(1 for m in metrics if was_secured(m))
    title = f"rounds - {secured} of {len(metrics)} secured" if any(secagg_facts(m) for m in metrics) else "rounds"
    if rows is eventful and len(metrics) > ROUNDS_TABLE_MAX:
        title += f"; the {len(eventful)} with drop-outs or failures"
    table = Table(title=title)
    for col, justify in (("round", "right"), ("outcome", "left"), ("reported", "right"), ("secured", "left"),
                         ("dropped (stage: devices)", "left"), ("why it failed", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for m in rows:
        drops = [f"{name}: {len(ids)} ({few(ids, 3)})" for name, ids in stage_drops(m).items()]
        after = dropped_after_sharing(m)
        if after:
            drops.append(f"shared keys, no masked upload: {len(after)} ({few(after, 3)})")
        facts = secagg_facts(m)
        outcome = str(m.get("outcome"))
        table.add_row(str(m.get("round")), f"[red]{console_text(outcome)}[/]" if outcome == "failed" else console_text(outcome),
                      f"{len(m.get('reported') or [])}/{len(m.get('selected') or [])}",
                      ("[green]yes[/]" if was_secured(m) else "no") if facts else "",
                      "\n".join(console_text(d, 1000) for d in drops), console_text(m.get("failure") or "", 1000))
    return table


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
