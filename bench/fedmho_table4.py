"""FedMHO benchmark: paper 003's Table IV on Fashion-MNIST (10 clients = 5 VGG-9 + 5 CVAE-small,
one round, Dirichlet alpha), the Table VI ablation (no K-means filtering) and the upload sizes,
scaled to a 2-core CPU.

Every method is the product's client and server halves. The clients are trained once per
(alpha, seed) and their encoded uploads are handed, unchanged, to every server variant, so the
variants differ only in what the server does with the same knowledge:

==================  ==========================================================================
FedAvg              one-shot FedAvg: the 5 VGG-9 uploads averaged (sample-weighted); its small
                    prototype, 5 CNN-small clients on the constrained clients' data, reported too
FedCVAE-Ens         every client a CVAE-small (the 5 VGG-9 clients' data get their own CVAEs);
                    the server trains a VGG-9 from scratch on 6,000 samples in data proportion
FedMHO / -MD / -SD  the product's fedmho server, fusion = ce / md / sd, lambda 0.5, rho 0.8
-MD / -SD no filter Table VI: 4,800 samples, no K-means filtering (same training-set size)
w0                  the plain average of the VGG-9 clients (FedMHO's start, Eq. 4)
==================  ==========================================================================

The local-epoch trend (paper Fig. 7) comes from snapshots of the same VGG-9 clients: training
stops at each ``--snapshots`` epoch count, the server fuses (MD and SD) from that snapshot, and
training continues (a fresh optimiser per stretch, as a device that resumes would have).

Run one alpha per single-threaded process, then merge::

    python bench/fedmho_table4.py --alpha 0.5 --threads 1 --tag a05
    python bench/fedmho_table4.py --alpha 0.1 --threads 1 --snapshots --tag a01
    python bench/fedmho_table4.py --merge bench/results/fedmho-a05.json bench/results/fedmho-a01.json

At the paper's scale on a GPU (``--paper``: full-width VGG-9, 200 local epochs of SGD 1e-3, as the
paper trains them; ``--no-small-prototype`` skips FedAvg's CNN-small group, 200 epochs of its own)::

    python bench/fedmho_table4.py --paper --device cuda --alpha 0.1 --no-small-prototype --tag paper-a01

The FedAvg row is the sample-weighted average of the VGG-9 clients, as the FedMHO server records it
for every run (its ``fedavg-of-classifiers`` reference). The results file is written after every
stage (clients trained, each server variant), marked ``partial`` until the run ends, so a run stopped
by a time limit keeps what it finished; every stage's seconds are in ``stage_s``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
from common import load, read_results, save, users_file, users_path

from edgefl.algorithms.training import evaluate_accuracy
from edgefl.config import validate_config
from edgefl.messages import decode, encode
from edgefl.sim import Simulation
from edgefl.server.session import build_server

PAPER = {  # Table IV (Fashion) and Table VI (no filtering, Dir 0.5)
    0.5: {"FedAvg": 60.24, "FedCVAE-Ens": 69.11, "FedMHO": 75.30, "FedMHO-MD": 77.27, "FedMHO-SD": 77.73,
          "FedMHO-MD no filter": 74.56, "FedMHO-SD no filter": 75.11},
    0.3: {"FedAvg": 47.36, "FedCVAE-Ens": 68.39, "FedMHO": 72.36, "FedMHO-MD": 75.69, "FedMHO-SD": 76.45},
    0.1: {"FedAvg": 30.37, "FedCVAE-Ens": 64.01, "FedMHO": 62.14, "FedMHO-MD": 71.04, "FedMHO-SD": 69.65,
          "FedMHO-MD no filter": 65.13, "FedMHO-SD no filter": 65.42},
}
VARIANTS = ("FedMHO", "FedMHO-MD", "FedMHO-SD", "FedMHO-MD no filter", "FedMHO-SD no filter")
ORDER = ["FedAvg", "FedCVAE-Ens", "FedMHO", "FedMHO-MD", "FedMHO-SD", "FedMHO-MD no filter", "FedMHO-SD no filter"]


def config(method: str, groups: list[dict], alpha: float, seed: int, args, **method_options) -> dict:
    return {
        "name": f"fedmho-bench-{method}", "seed": seed, "rounds": 1, "device": args.device,
        "method": {"name": method, "global_epochs": args.global_epochs, "global_lr": args.global_lr, "global_batch": 64,
                   "synthetic_samples": args.synthetic, **method_options},
        "data": {"dataset": "fashion-mnist", "partition": "dirichlet", "alpha": alpha, "min_samples": 10},
        "train": {"batch_size": 64},
        "fleet": {"groups": groups},
        # a full-width VGG-9 is 277 MB, over the default message limit (the run would refuse to start)
        **({"network": {"max_message_bytes": 320 << 20, "max_partial_bytes_total": 1 << 30}} if args.width > 0.9 else {}),
    }


def groups(args, big: str, small: str) -> list[dict]:
    vgg_train = {"optimizer": "sgd", "lr": args.vgg_lr, "momentum": 0.9, "epochs": args.vgg_epochs}
    cvae_train = {"optimizer": "adam", "lr": args.cvae_lr, "epochs": args.cvae_epochs}
    spec = {
        "vgg9": {"model": "vgg9", "count": 5, "options": {"width": args.width}, "train": vgg_train},
        "cnn-small": {"model": "cnn-small", "count": 5, "train": vgg_train},
        "cvae-small": {"model": "cvae-small", "count": 5, "train": cvae_train},
    }
    return [spec[big], spec[small]]


def fit(sim: Simulation, cid: str, round_no: int = 1) -> bytes:
    down = sim.server.downlink(1, cid) if round_no == 1 else None
    up = sim.clients[cid].fit(decode(encode(down)) if down else None, round_no)
    up.round = 1  # a resumed stretch of the same one-shot round
    return encode(up)


def fuse(cfg_raw: dict, ds, slots, uploads: dict[str, bytes], x_test, y_test, art_dir: Path | None = None) -> tuple[float, dict]:
    cfg = validate_config(cfg_raw, "benchmark config")
    server = build_server(cfg, ds, slots)
    server.begin_round(1)
    for cid in sorted(uploads):
        receipt = server.receive(decode(uploads[cid]))
        assert receipt.status == "accepted", (cid, receipt)
    t0 = time.perf_counter()
    record = server.close_round(1)
    (arch, state), = server.global_models().items()
    model = server.build_global(arch)
    model.load_state_dict(state)
    acc = evaluate_accuracy(model, x_test, y_test, 1000)
    if art_dir is not None:
        server.write_artifacts(art_dir)
    record = {k: v for k, v in record.items() if k not in ("plan", "filter")}
    references = {}
    for name, (ref_arch, ref_state) in server.reference_models().items():  # FedMHO's start: the classifiers' FedAvg
        ref = server.build_global(ref_arch)
        ref.load_state_dict(ref_state)
        references[name] = evaluate_accuracy(ref, x_test, y_test, 1000)
    return acc, {**record, "references": references, "server_s": round(time.perf_counter() - t0, 1)}


def run_alpha(alpha: float, seed: int, args, ds, log, keep: Callable[[dict], None] = lambda out: None) -> dict:
    """One (alpha, seed): every stage's result goes into the returned dict, handed to ``keep`` after each
    stage (the caller saves it, so a stopped run keeps what it finished)."""
    out: dict = {"alpha": alpha, "seed": seed, "accuracy": {}, "server": {}, "upload_bytes": {}, "trend": {}, "stage_s": {}}

    def stage(name: str, t0: float) -> None:
        out["stage_s"][name] = round(time.perf_counter() - t0, 1)
        keep(out)

    mho_raw = config("fedmho-md", groups(args, "vgg9", "cvae-small"), alpha, seed, args)
    sim = Simulation(validate_config(mho_raw, "benchmark config"), dataset=ds, show_progress=False)
    x_test, y_test = sim.x_test, sim.y_test
    vggs = [c for c, cl in sim.clients.items() if cl.setup.arch.startswith("vgg9")]
    out["partition"] = [len(s.sample_indices) for s in sim.slots]
    cvaes = [c for c in sim.clients if c not in vggs]
    sim.server.begin_round(1)
    uploads: dict[str, bytes] = {}
    t0 = time.perf_counter()
    for cid in cvaes:
        uploads[cid] = fit(sim, cid)
    log(f"alpha {alpha}: 5 CVAE-small clients trained ({time.perf_counter() - t0:.0f} s)")
    stage("CVAE-small clients", t0)

    def variants(tag: str, up: dict[str, bytes], which: list[str], art: Path | None = None) -> None:
        opts = {
            "FedMHO": ("fedmho", {}), "FedMHO-MD": ("fedmho-md", {}), "FedMHO-SD": ("fedmho-sd", {}),
            "FedMHO-MD no filter": ("fedmho-md", {"keep_ratio": 1.0, "synthetic_samples": int(0.8 * args.synthetic)}),
            "FedMHO-SD no filter": ("fedmho-sd", {"keep_ratio": 1.0, "synthetic_samples": int(0.8 * args.synthetic)}),
        }
        for name in which:
            method, extra = opts[name]
            t0 = time.perf_counter()
            raw = config(method, groups(args, "vgg9", "cvae-small"), alpha, seed, args, **extra)
            key = name if tag == "final" else f"{name} @ {tag}"
            try:
                acc, rec = fuse(raw, sim.ds, sim.slots, up, x_test, y_test, art if name == "FedMHO-MD" else None)
            except Exception as exc:  # one variant's failure (on a lent GPU: its minutes) must not lose the others
                out.setdefault("errors", {})[key] = "".join(traceback.format_exception(exc)[-3:])[-2000:]
                log(f"alpha {alpha}: {key} FAILED: {exc!r}")
                stage(key, t0)
                continue
            (out["accuracy"] if tag == "final" else out["trend"])[key] = acc
            out["server"][key] = rec
            if tag == "final" and "fedavg-of-classifiers" in rec["references"]:
                out["accuracy"]["FedAvg"] = rec["references"]["fedavg-of-classifiers"]
            log(f"alpha {alpha}: {key}: {acc:.4f}  ({rec['server_s']} s on the server)")
            stage(key, t0)

    # VGG-9 clients, stretch by stretch (snapshots give the local-epoch trend)
    done = 0
    stops = sorted({*args.snapshots, args.vgg_epochs})
    for i, stop in enumerate(stops):
        t0 = time.perf_counter()
        for cid in vggs:
            sim.clients[cid].setup.train = sim.clients[cid].setup.train.model_copy(update={"epochs": stop - done})
            uploads[cid] = fit(sim, cid, round_no=1 + i)
        log(f"alpha {alpha}: 5 VGG-9 clients at {stop} epochs ({time.perf_counter() - t0:.0f} s)")
        done = stop
        w0 = _average_accuracy(sim, vggs, uploads, x_test, y_test)
        out["trend"][f"w0 @ {stop}"] = w0
        stage(f"VGG-9 clients to {stop} epochs", t0)
        if stop != args.vgg_epochs:
            variants(f"{stop} epochs", uploads, ["FedMHO-MD", "FedMHO-SD"])
    out["accuracy"]["w0 (average of the VGG-9 clients)"] = w0
    out["local_vgg_accuracy"] = [evaluate_accuracy(sim.clients[c].model, x_test, y_test) for c in vggs]
    art = Path(tempfile.mkdtemp())
    variants("final", uploads, args.variants, art)
    grid = args.plot_dir / f"fedmho-samples-dir{alpha}.png"
    if (art / "synthetic-samples.png").exists():
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(art / "synthetic-samples.png", grid)
    out["upload_bytes"] = {"VGG-9 client (weights)": len(uploads[vggs[0]]), "CVAE-small client (decoder + counts)": len(uploads[cvaes[0]])}

    if args.small_prototype:
        t0 = time.perf_counter()
        _fedavg_with_small_prototype(out, ds, vggs, cvaes, uploads, alpha, seed, args, x_test, y_test, log)
        stage("FedAvg with its CNN-small group", t0)
    if args.fedcvae:
        t0 = time.perf_counter()
        _fedcvae(out, ds, vggs, cvaes, uploads, alpha, seed, args, x_test, y_test, log)
        stage("FedCVAE-Ens", t0)
    return out


def _fedavg_with_small_prototype(out, ds, vggs, cvaes, uploads, alpha, seed, args, x_test, y_test, log) -> None:
    """One-shot FedAvg as a run of its own: the same VGG-9 uploads (same shared start) + 5 CNN-small clients."""
    avg_raw = config("fedavg", groups(args, "vgg9", "cnn-small"), alpha, seed, args)
    avg_raw["method"] = {"name": "fedavg"}
    avg = Simulation(validate_config(avg_raw, "benchmark config"), dataset=ds, show_progress=False)
    avg.server.begin_round(1)
    for cid in vggs:
        assert avg.server.receive(decode(uploads[cid])).status == "accepted"
    for cid in cvaes:
        assert avg.server.receive(decode(fit(avg, cid))).status == "accepted"
    avg.server.close_round(1)
    per_arch = {}
    for arch, state in avg.server.global_models().items():
        model = avg.server.build_global(arch)
        model.load_state_dict(state)
        per_arch[arch] = evaluate_accuracy(model, x_test, y_test, 1000)
    out["accuracy"]["FedAvg"] = next(v for a, v in per_arch.items() if a.startswith("vgg9"))
    out["fedavg_small_prototype"] = per_arch.get("cnn-small")
    log(f"alpha {alpha}: FedAvg {out['accuracy']['FedAvg']:.4f} (CNN-small group {out['fedavg_small_prototype']:.4f})")


def _fedcvae(out, ds, vggs, cvaes, uploads, alpha, seed, args, x_test, y_test, log) -> None:
    """FedCVAE-Ens: CVAE-small on every client; the 5 constrained clients' decoders are reused."""
    cv_raw = config("fedcvae", groups(args, "cvae-small", "cvae-small"), alpha, seed, args,
                    global_model="vgg9", global_model_options={"width": args.width})
    cv = Simulation(validate_config(cv_raw, "benchmark config"), dataset=ds, show_progress=False)
    cv.server.begin_round(1)
    cv_uploads = {cid: uploads[cid] for cid in cvaes}
    for cid in vggs:
        cv_uploads[cid] = fit(cv, cid)
    acc, rec = fuse(cv_raw, cv.ds, cv.slots, cv_uploads, x_test, y_test)
    out["accuracy"]["FedCVAE-Ens"], out["server"]["FedCVAE-Ens"] = acc, rec
    log(f"alpha {alpha}: FedCVAE-Ens {acc:.4f}")


def _average_accuracy(sim: Simulation, vggs: list[str], uploads: dict[str, bytes], x_test, y_test) -> float:
    from edgefl.server.methods.fedavg import weighted_average

    states = [decode(uploads[c]).tensors for c in vggs]
    model = sim.server.build_initial(sim.clients[vggs[0]].setup.arch)
    model.load_state_dict(weighted_average(states, [1.0] * len(states)))
    return evaluate_accuracy(model, x_test, y_test)


def table(results: list[dict]) -> str:
    alphas = sorted({r["alpha"] for r in results}, reverse=True)
    lines = ["| method | " + " | ".join(f"Dir({a}) ours | paper" for a in alphas) + " |",
             "|---|" + "---|---|" * len(alphas)]
    for name in [*ORDER, "w0 (average of the VGG-9 clients)"]:
        cells = []
        for a in alphas:
            vals = [100 * r["accuracy"][name] for r in results if r["alpha"] == a and name in r["accuracy"]]
            ours = f"{sum(vals) / len(vals):.2f}" if vals else "-"
            cells.append(f"{ours} | {PAPER.get(a, {}).get(name, '-')}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = sorted({r["alpha"] for r in results}, reverse=True)
    fig, axes = plt.subplots(1, len(alphas), figsize=(5.5 * len(alphas), 4), squeeze=False)
    for ax, a in zip(axes[0], alphas):
        names = [n for n in ORDER if any(n in r["accuracy"] for r in results if r["alpha"] == a)]
        ours = [100 * next(r["accuracy"][n] for r in results if r["alpha"] == a and n in r["accuracy"]) for n in names]
        paper = [PAPER.get(a, {}).get(n, 0) for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], ours, 0.4, label="edgefl (this machine)")
        ax.bar([x + 0.2 for x in xs], paper, 0.4, label="paper Table IV / VI", alpha=0.6)
        ax.set_xticks(list(xs), [n.replace(" no filter", "\nno filter") for n in names], rotation=45, ha="right", fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_title(f"Fashion-MNIST, Dir({a}), one round")
        ax.set_ylabel("top-1 accuracy (%)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alpha", type=float, nargs="+", default=[0.5, 0.1])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--paper", action="store_true", help="the paper's VGG-9 clients: width 1.0, 200 epochs, SGD lr 1e-3 (a GPU run)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where clients and server train")
    p.add_argument("--width", type=float, default=None, help="VGG-9 width (1.0 = the paper's 69 M parameters; default 0.5)")
    p.add_argument("--vgg-epochs", type=int, default=None, help="local VGG-9 epochs (paper: 200; default 10)")
    p.add_argument("--vgg-lr", type=float, default=None, help="local VGG-9 SGD learning rate (paper: 1e-3; default 5e-3, "
                   "which trains faster in 10 epochs)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="the server variants to fuse")
    p.add_argument("--small-prototype", action=argparse.BooleanOptionalAction, default=True,
                   help="FedAvg's small prototype: 5 CNN-small clients trained as long as the VGG-9s")
    p.add_argument("--fedcvae", action=argparse.BooleanOptionalAction, default=True, help="the FedCVAE-Ens baseline")
    p.add_argument("--snapshots", type=int, nargs="*", default=[], help="also fuse from these earlier epoch counts (Fig. 7 trend)")
    p.add_argument("--cvae-epochs", type=int, default=40, help="paper: 40 for Fashion")
    p.add_argument("--cvae-lr", type=float, default=1e-3)
    p.add_argument("--global-epochs", type=int, default=20, help="paper: 20 for Fashion")
    p.add_argument("--global-lr", type=float, default=5e-4, help="authors' code: 5e-4 for Fashion")
    p.add_argument("--synthetic", type=int, default=6000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tag", default="all")
    p.add_argument("--plot-dir", type=users_path, default=Path("docs/img"))
    p.add_argument("--merge", nargs="+", type=users_file, help="merge earlier result files instead of running")
    args = p.parse_args()
    for name, scaled, paper in (("width", 0.5, 1.0), ("vgg_epochs", 10, 200), ("vgg_lr", 5e-3, 1e-3)):
        if getattr(args, name) is None:
            setattr(args, name, paper if args.paper else scaled)
    if args.merge:
        results = [r for f in args.merge for r in read_results(f, "results")]
        print(table(results))
        print(f"plot: {plot(results, args.plot_dir / 'fedmho-table4.png')}")
        save("fedmho", {"results": results, "merged_from": [str(f) for f in args.merge]})
        return
    torch.set_num_threads(args.threads)
    ds = load()
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.0f} s] {msg}", flush=True)

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)")
    meta = {"args": {k: str(v) for k, v in vars(args).items()},
            "compute_device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
    results: list[dict] = []
    for alpha in args.alpha:
        for seed in args.seeds:
            def keep(out: dict) -> None:
                save(f"fedmho-{args.tag}", {"results": [*results, out], "partial": True, **meta})
            results.append(run_alpha(alpha, seed, args, ds, log, keep))
            save(f"fedmho-{args.tag}", {"results": results, "partial": len(results) < len(args.alpha) * len(args.seeds), **meta})
    print(table(results))


if __name__ == "__main__":
    main()
