"""Felo and Velo side by side: the authors' public code (ChanYunHin/Felo_Velo, PyTorch) and edgefl's
``felo`` and ``velo``, each against its own local-only training, on the same Fashion-MNIST split, the same share of
clients sampled an iteration (each side draws its own), the same optimiser (but for their learning
rate drop at half the run, which ``--lr-milestones 0.5`` gives edgefl too), batches and length, on
this machine (issue 38, item 3).

The two sides train different ResNets: the authors' are their own (a 3x3 stem with max pooling,
three stages of bottleneck-like blocks whose depth comes from re-applying one shared block, a
1024-channel feature at 32x32 input); edgefl's are torchvision's BasicBlock ResNet10-26. So the
comparison is of what each method adds to its own models: Felo's accuracy minus local-only
training's, on each side, as well as the two Felo numbers. edgefl's Felo runs twice: as the paper
has it (weights averaged among the clients of one architecture) and with personal models, as the
authors' code has it (no weights averaged at all; ``edgefl_config(personal=True)``).

The authors' code runs from ``--authors-dir`` (a checkout of their repository; nothing of it is
copied here): their ``modules.Server_op.Server`` (Felo; their README: "op is Felo") or
``modules.Server_new_VAE.Server`` (Velo: "new_VAE is Velo"; ``--methods velo``) and its
``asynchronous_training`` loop, unchanged. What this script changes around it:

* two modules their Felo path imports exist in their repository only as compiled ``.pyc`` files
  (``modules/utils``, ``modules/Model``; ``GAN_model``, Velo's, too), and a few imports are unused
  on this path (``tkinter``, ``numpy.lib.function_base``, ``objgraph``, ``pandas``, TensorBoard):
  small stand-ins are placed in ``sys.modules`` while their code runs, and the previous entries
  put back after it; TensorBoard's writer is a no-op.
* their ``Dataset`` (torchvision download of Fashion-MNIST, ``ToTensor`` then ``Resize(32)``) is
  replaced by edgefl's Fashion-MNIST in [0, 1] resized to 32x32 the same way (bilinear), split as
  edgefl splits it: their client ``k`` gets edgefl's device ``k`` (two clients per model on both
  sides; their five models are not in size order: 6, 9, 10, 7 and 13 block applications), and
  their test set is edgefl's fixed test subset.
* their ResNets are narrowed by ``--width`` (every convolution's and BatchNorm's channel count,
  and ``args.latent_size``, the feature width): at full width a run of this length takes hours here.
* their per-iteration seed (``torch.random.seed()``, Server_op.py:385, Server_new_VAE.py:374, which
  also reseeds torch's global generator from the clock; the stand-in only returns a number) and
  the clock seed their
  Velo server gives torch after generating its features (``torch.seed()``, Server_new_VAE.py:354)
  are drawn from a generator seeded by ``--seed``; NumPy's and torch's global generators are
  seeded before their server is built, so a run is repeatable. Their Velo CVAE's trainings are
  counted and timed (their ``server_extractor_training``, unchanged). Their CVAE has a BatchNorm
  and their loader keeps a last batch of one when the store's size is 1 more than a multiple of 50
  (possible while some classes' stores are full and others not): BatchNorm then stops their run
  with "Expected more than 1 value per channel". Their code, not changed here; rerun with another
  ``--seed`` if it happens.
* their in-loop evaluation (every 1 % of the run, every client over the test set) runs only at
  ``--curve`` points (the nearest of their evaluation iterations), with NumPy's global generator
  saved and restored around it (their test batches shuffle it), so the curve does not change the
  run; the final numbers come from their own ``Server.evaluate`` on every client. (Commit
  ``a897723``, which produced docs/methods.md's tables, evaluated without the restore.)
* the SHA-256 of every ``.py`` file of their checkout is saved with the results.

Local-only on their side is their own switch: the same run without ``--y_distillation_flag``
(Server_op.py:453), i.e. no features or logits in the loss. edgefl's side runs ``felo`` with the
authors' settings where edgefl has them (alpha 0.5, MSE on logits, CE only for the first 5 %,
Adam 1e-3 kept for the run, 10 batches of 50 per selection, 2 of 10 clients an iteration) and
``local`` with the same training; its ``velo`` takes their CVAE's choices where edgefl has the
option (latent and hidden width = each side's own feature width: 256 theirs, 128 edgefl's at width
0.25; 10 epochs every 1 % of the run; one synthetic feature per class); it trains on the
clients' per-class means (Algorithm 2), or with ``--velo-cvae-data sample_features`` on the features of every
trained sample, as theirs does (500 a client an iteration, the last 4,999 a class kept). What edgefl does not do as their code does is listed in
docs/methods.md ("Felo and Velo beside the authors' code").

Time on a 2-core CPU at 200 iterations and width 0.25: their Felo or local-only about 11 minutes;
their Velo 60 to 72 (IID: 4,341 s, of which 4,047 s are their CVAE's 95 trainings over up to 50,000
stored features; Dirichlet 0.5: 3,499 s, CVAE 3,238 s; on a slower 2-core machine about two hours,
one to two minutes an iteration once the store is full); each edgefl run 1 to 5 minutes. Results are saved after every run; ``--resume`` keeps
what an earlier sitting of the same setting and ``--tag`` finished, so the sides and methods can be
run in several sittings (``--sides``, ``--methods``) and on several machines (each run records its own).

    python bench/authors_felo.py --authors-dir /tmp/authors/Felo_Velo [--iterations 200] [--seed 0]
        [--partition iid|dirichlet] [--width 0.25] [--test-samples 2000] [--sides authors,edgefl]
        [--methods felo,velo,local] [--velo-cvae-data class_means|sample_features] [--resume]
        [--threads 2] [--tag NAME] [--plot-dir docs/img]
    python bench/authors_felo.py --replot bench/results/authors_felo-TAG.json --plot-dir docs/img
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from common import RESULTS, accuracy_logger, load, plot_curves, save, users_file, users_path
from common import checkout_problem as common_checkout_problem

from edgefl.build import build_run
from edgefl.environment import machine, source_commit
from edgefl.config import validate_config
from edgefl.sim import Simulation

NUM_CLIENTS = 10  # their model table is written for ten clients (Server_op.py:138-148)
SAMPLE_RATIO = 0.2
STEPS, BATCH = 10, 50  # their client: clients_training_epoch (10) batches of batch_size (50) per selection
RESNETS = ("resnet10", "resnet14", "resnet18", "resnet22", "resnet26")

_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:7.0f} s] {msg}", flush=True)


# --- edgefl's side -----------------------------------------------------------------------------

def edgefl_config(args, method: str, personal: bool = False) -> dict:
    """``personal``: every device its own architecture group, so no weights are averaged and each
    device trains on its own model from round to round, as the authors' code does (it never sets a
    client's weights outside its asynchronous-FedAvg branch, Server_op.py:513-515). edgefl averages
    within an architecture (the paper, Algorithm 1 line 5); a group is its model and options, so a
    width that rounds to the same channel counts (0.25 + k * 1e-6) makes ten groups of one."""
    m: dict = {"name": method}
    if method in ("felo", "velo"):
        m.update(alpha=0.5, logit_loss="mse", feature_dim=args.feature_dim)
    if method == "velo":  # their CVAE's sizes and schedule where edgefl has the option (VAE_model.py, Server_new_VAE.py:448-455)
        m.update(latent_dim=args.feature_dim, hidden_dim=args.feature_dim, retrain_every=max(1, args.iterations // 100),
                 cvae_epochs=10, synthetic_per_class=1, cvae_data=args.velo_cvae_data)
        if args.velo_cvae_data == "sample_features":  # their clients send every trained sample's feature; their store keeps 4,999 a class
            m.update(samples_per_upload=STEPS * BATCH, sample_store_size=4999)
    return {
        "name": f"authors-felo-{method}", "seed": args.seed, "rounds": args.iterations, "threads": args.threads,
        "method": m,
        "data": {"dataset": "fashion-mnist", "partition": args.partition, "alpha": args.alpha,
                 "test_samples": args.test_samples},
        "train": {"epochs": 1, "max_steps": STEPS, "batch_size": BATCH, "optimizer": "adam", "lr": 1e-3,
                  "optimizer_state": "kept", **({"lr_milestones": args.lr_milestones} if args.lr_milestones else {})},
        "fleet": {"sample_ratio": SAMPLE_RATIO,
                  "groups": [{"model": d, "count": 1 if personal else 2,
                              "options": {"width": args.width + (1e-6 * (2 * i + k) if personal else 0.0), "stem": args.stem,
                                          "feature_dim": args.feature_dim}}
                             for i, d in enumerate(RESNETS) for k in range(2 if personal else 1)]},
        "eval": {"every": max(1, args.iterations // args.curve)},
        "simulation": {"checkpoint_every": 0},
    }


def run_edgefl(raw: dict, ds, label: str) -> dict:
    cfg = validate_config(raw, "authors_felo config")

    on_record = accuracy_logger(log, f"edgefl {label}: round", "mean accuracy")
    sim = Simulation(cfg, None, dataset=ds, show_progress=False, on_round=on_record)
    summary = sim.run()
    final = summary["final_accuracy"]
    curve = [(h["round"], h["accuracy"]["overall"]) for h in sim.history if h.get("accuracy")]
    per_model = {name: float(np.mean([acc for arch, acc in final["per_arch"].items() if arch.split("(")[0] == name]))
                 for name in RESNETS}
    out = {"own": final["overall"], "per_model": per_model, "per_arch": final["per_arch"], "curve": curve}
    trainings = [h["server"]["cvae"] for h in sim.history if isinstance(h.get("server"), dict) and h["server"].get("cvae")]
    if trainings:  # velo: the server's CVAE time, beside their code's
        out["cvae"] = {"trainings": len(trainings), "seconds": round(sum(t["seconds"] for t in trainings))}
        log(f"edgefl {label}: the CVAE trained {len(trainings)} times, {out['cvae']['seconds']} s in all")
    return out


# --- the authors' side -------------------------------------------------------------------------

def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


class _NoWriter:
    def __init__(self, *a, **k) -> None: ...
    def __getattr__(self, name):
        return lambda *a, **k: None


def install_stand_ins(mask: str = "felo") -> dict[str, types.ModuleType | None]:
    """What their imports need on this path and their repository lacks (source) or this machine lacks;
    returns what ``sys.modules`` held under those names, for ``restore_modules``."""
    previous: dict[str, types.ModuleType | None] = {}

    class _Unused:
        def __init__(self, *a, **k) -> None:
            raise RuntimeError("the authors' CNN path is not used here (--resnet_flag)")

    for name, attrs in {
        "modules.utils": {"get_model_mask": lambda a: mask, "get_tb_logs_name": lambda a: "unused"},
        "modules.Model": {"ClientModel": _Unused, "ClientModel_2CNN": _Unused},
        "modules.old_Model": {"ClientModel": _Unused, "ClientModel_2CNN": _Unused},
        "modules.GAN_model": {},
        "tkinter": {"X": "x"},
        "numpy.lib.function_base": {"select": np.select, "gradient": np.gradient},
        "objgraph": {}, "pandas": {}, "pdb": {"set_trace": lambda *a, **k: None},
        "torch.utils.tensorboard": {"SummaryWriter": _NoWriter},
        "tqdm": {"tqdm": lambda it, *a, **k: it},
    }.items():
        previous[name] = sys.modules.get(name)
        sys.modules[name] = _module(name, **attrs)
    try:
        import psutil  # noqa: F401
    except ImportError:
        previous["psutil"], sys.modules["psutil"] = None, _module("psutil")
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        plt = _module("matplotlib.pyplot")
        previous["matplotlib"], previous["matplotlib.pyplot"] = None, None
        sys.modules["matplotlib"] = _module("matplotlib", pyplot=plt, use=lambda *a: None)
        sys.modules["matplotlib.pyplot"] = plt
    return previous


def restore_modules(previous: dict[str, types.ModuleType | None]) -> None:
    """Put back what the stand-ins replaced (a stand-in left behind breaks later imports: torch's
    compiler probes ``pandas``), and forget their modules and ``parameters``."""
    for name, module in previous.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
    for name in [m for m in sys.modules if m == "parameters" or m == "modules" or m.startswith("modules.")]:
        del sys.modules[name]


def their_feature_width(width: float) -> int:
    """Their ResNets' feature width narrowed (1024 channels at full width), the ``--latent_size``
    their Velo CVAE and feature loss are built for: it must equal what the narrowed nets emit."""
    return max(1, int(round(1024 * width)))


def narrowed_nn(width: float) -> types.ModuleType:
    """``torch.nn`` as their ResnetModel sees it, with every channel count scaled by ``width``
    (the single input channel kept): their layer order and block reuse untouched."""
    import inspect

    def scale(c: int) -> int:
        return max(1, int(round(c * width)))

    conv_sig = inspect.signature(torch.nn.Conv2d.__init__)

    def conv2d(*a, **k):
        b = conv_sig.bind(None, *a, **k)
        b.apply_defaults()
        kw = dict(b.arguments)
        kw.pop("self")
        if kw["in_channels"] > 3:
            kw["in_channels"] = scale(kw["in_channels"])
        kw["out_channels"] = scale(kw["out_channels"])
        return torch.nn.Conv2d(**kw)

    def batchnorm2d(num_features, *a, **k):
        return torch.nn.BatchNorm2d(scale(num_features), *a, **k)

    proxy = _module("torch.nn (narrowed)")
    proxy.__dict__.update({k: getattr(torch.nn, k) for k in dir(torch.nn) if not k.startswith("__")})
    proxy.Conv2d, proxy.BatchNorm2d = conv2d, batchnorm2d
    return proxy


def resized(x: torch.Tensor) -> np.ndarray:
    """Their transform (ToTensor, then Resize(32)) on edgefl's [0, 1] images."""
    out = [F.interpolate(x[i:i + 4096], size=32, mode="bilinear", antialias=True, align_corners=False)
           for i in range(0, len(x), 4096)]
    return torch.cat(out).numpy().astype("float32")


def run_authors(args, ds, parts: list[np.ndarray], test_idx: np.ndarray, method: str, label: str) -> dict:
    """``method``: felo (their Server_op with distillation), velo (Server_new_VAE with it) or local
    (Server_op without it)."""
    authors = args.authors_dir.resolve()
    epoch = args.iterations // 2  # their loop runs int(epoch * clients * ratio) iterations (Server_op.py:421)
    argv = ["authors_felo", "--new_VAE" if method == "velo" else "--op", "--resnet_flag", "--dataset", "Fmnist", "--epoch", str(epoch),
            "--clients_number", str(NUM_CLIENTS), "--clients_sample_ratio", str(SAMPLE_RATIO),
            "--batch_size", str(BATCH), "--clients_training_epoch", str(STEPS), "--learning_rate", "1e-3",
            "--alpha", "0.5", "--latent_size", str(their_feature_width(args.width))]
    if method != "local":
        argv.append("--y_distillation_flag")
    saved_argv, sys.argv = sys.argv, argv
    sys.path.insert(0, str(authors))
    for name in [m for m in sys.modules if m == "parameters" or m.startswith("modules")]:
        del sys.modules[name]  # a fresh args namespace and fresh modules for each run
    replaced = install_stand_ins(method if method != "local" else "felo")
    try:
        import modules.Dataset as dataset_mod
        import modules.ResnetModel as resnet_mod
        server_mod = importlib.import_module("modules.Server_new_VAE" if method == "velo" else "modules.Server_op")
    except BaseException:
        restore_modules(replaced)
        sys.path.remove(str(authors))
        raise
    finally:
        sys.argv = saved_argv
    real_torch_seed = torch.seed
    try:  # whatever happens, their modules, path and patches go: a later run (or caller) starts clean
        resnet_mod.nn = narrowed_nn(args.width)

        x_train, y_train = resized(ds.x_train), ds.y_train.numpy().astype("int64")
        x_test, y_test = resized(ds.x_test[test_idx]), ds.y_test[test_idx].numpy().astype("int64")

        class EdgeflSplit:
            """Their Dataset's interface (train: one BatchGenerator per client, test: one), edgefl's data."""

            def __init__(self, *a, **k) -> None:
                self.train = [dataset_mod.BatchGenerator(x_train[p], y_train[p]) for p in parts]
                self.test = dataset_mod.BatchGenerator(x_test, y_test)

        server_mod.Dataset = EdgeflSplit
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        seeds = np.random.default_rng(args.seed + 1)
        iterations = epoch * 2
        every = int(iterations / 100)  # their loop evaluates at ep % every == 0 (Server_op.py:593-599)
        curve_at = {(round(i * iterations / args.curve) - 1) // every * every for i in range(1, args.curve)}  # 0-based ep
        state = {"ep": -1, "scores": {}}
        real_evaluate = server_mod.Server.evaluate
        real_choose = server_mod.Server.choose_clients

        def choose_clients(self):
            state["ep"] += 1
            return real_choose(self)

        def evaluate(self, dataset, batch_size, eval_model):
            if state["ep"] not in curve_at:
                return 0.0, 0.0  # their loop evaluates every 1 %: only the curve's points are worth the time here
            return judged(self, dataset, batch_size, eval_model, keep=True)

        def judged(self, dataset, batch_size, eval_model, keep=False):
            rng = np.random.get_state()  # their test batches shuffle NumPy's generator: judging must not change the run
            loss, acc = real_evaluate(self, dataset, batch_size, eval_model)
            np.random.set_state(rng)
            if keep:
                state["scores"].setdefault(state["ep"], []).append(acc)
            return loss, acc

        def reseed() -> int:
            """``torch.seed()`` as their Velo server calls it after generating (Server_new_VAE.py:354):
            a seed from ``seeds``, not from the clock, so the run repeats."""
            s = int(seeds.integers(2**31))
            torch.manual_seed(s)
            return s

        cvae = {"trainings": 0, "seconds": 0.0}
        if method == "velo":
            real_training = server_mod.CVAE.server_extractor_training

            def timed_training(*a, **k):
                t0 = time.perf_counter()
                out = real_training(*a, **k)
                cvae["trainings"] += 1
                cvae["seconds"] += time.perf_counter() - t0
                return out

            server_mod.CVAE.server_extractor_training = timed_training
        server_mod.Server.choose_clients = choose_clients
        server_mod.Server.evaluate = evaluate
        server_mod.Server.get_random_seed = lambda self: int(seeds.integers(2**31))

        from collections import namedtuple

        fields = ["clients_number", "clients_sample_ratio", "epoch", "learning_rate", "decay_rate", "num_input",
                  "num_input_channel", "num_classes", "batch_size", "clients_training_epoch", "distorted_data", "dataset", "device"]
        params = namedtuple("parameters", fields)(NUM_CLIENTS, SAMPLE_RATIO, epoch, 1e-3, 1, 32, 1, 10, BATCH, STEPS,
                                                  False, "Fmnist", torch.device("cpu"))
        cwd = os.getcwd()
        with tempfile.TemporaryDirectory() as work:
            os.chdir(work)  # their loop saves every model into ./state_dict/ at each evaluation
            os.makedirs("state_dict")
            try:
                torch.seed = reseed
                server = server_mod.Server(params)
                sizes = [c.model.__class__.__name__ for c in server.clients_dict.values()]
                n_params = [sum(p.numel() for p in c.model.parameters()) for c in server.clients_dict.values()]
                log(f"authors {label}: clients {sizes}, parameters {n_params}")
                server.asynchronous_training()
                # the final evaluation: every client, their evaluator
                per_client = [float(judged(server, server.dataset_server.test, BATCH * 10, server.clients_dict[k])[1])
                              for k in range(NUM_CLIENTS)]
            finally:
                os.chdir(cwd)
                server_mod.Server.evaluate, server_mod.Server.choose_clients = real_evaluate, real_choose
    finally:
        torch.seed = real_torch_seed
        sys.path.remove(str(authors))
        restore_modules(replaced)
    curve = [(ep + 1, float(np.mean(a))) for ep, a in sorted(state["scores"].items()) if len(a) == NUM_CLIENTS]
    curve.append((iterations, float(np.mean(per_client))))
    per_model = {}
    for k in range(0, NUM_CLIENTS, 2):  # their clients 2k, 2k+1 share a model (Server_op.py:138-148), named by its class
        per_model[sizes[k]] = float(np.mean(per_client[k:k + 2]))
    out = {"own": float(np.mean(per_client)), "per_model": per_model, "per_client": per_client, "curve": curve,
           "parameters": n_params}
    if method == "velo":
        out["cvae"] = {"trainings": cvae["trainings"], "seconds": round(cvae["seconds"])}
        log(f"authors {label}: their CVAE trained {cvae['trainings']} times, {cvae['seconds']:.0f} s in all")
    return out


AUTHORS_FILES = ("modules/Server_op.py", "modules/Client_op.py", "modules/Server_new_VAE.py", "modules/Client_new_VAE.py",
                 "modules/VAE_model.py", "modules/ResnetModel.py", "modules/Dataset.py", "parameters.py")


def checkout_problem(authors: Path) -> str | None:
    """Why ``authors`` cannot be run here, or None: checked before any data is loaded."""
    return common_checkout_problem(authors, AUTHORS_FILES, "ChanYunHin/Felo_Velo")


SAME_RUN = ("iterations", "seed", "partition", "alpha", "width", "feature_dim", "test_samples", "curve")
#: settings recorded only when they differ from the default (results saved before they existed stay resumable)
SAME_RUN_IF_SET = ("stem", "lr_milestones", "velo_cvae_data")


def earlier_results(path: Path, same: dict[str, str]) -> dict:
    """The finished runs of an earlier sitting, if it ran the same setting (else none, said why)."""
    import json

    if not path.exists():
        return {}
    try:
        saved = json.loads(path.read_text())
    except ValueError as exc:
        sys.exit(f"{path} is not a result this script wrote ({exc}); move it away or drop --resume")
    if saved.get("same_run") != same:
        changed = sorted(k for k in same if (saved.get("same_run") or {}).get(k) != same[k])
        sys.exit(f"{path} holds another setting ({', '.join(changed) or 'no setting recorded'} differ); "
                 "give this one another --tag, or drop --resume")
    return dict(saved.get("results") or {})


def checkout_digests(authors: Path) -> dict[str, str]:
    """SHA-256 of each .py file of their checkout: what ran, checkable without its git history."""
    import hashlib

    return {str(f.relative_to(authors)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(authors.rglob("*.py"))}


def plot(payload: dict, out: Path) -> Path:
    curves = {label: ([x for x, _ in r["curve"]], [100 * y for _, y in r["curve"]]) for label, r in payload["results"].items()}
    title = "\n".join(textwrap.wrap(payload["setting"], 80))  # lines that fit the 7-inch-wide figure
    return plot_curves(curves, title, "mean accuracy (%)", out, highlight="authors")


def main() -> None:
    summary, _, details = __doc__.partition("\n\n")  # what it does first; how, after the options
    p = argparse.ArgumentParser(description=summary, epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--authors-dir", type=users_path, help="a checkout of github.com/ChanYunHin/Felo_Velo (measured at 33eaa18)")
    p.add_argument("--iterations", type=int, default=200, help="server iterations (edgefl rounds); even, at least 100 "
                                                               "(their loop divides by 1 %% of it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partition", choices=("iid", "dirichlet"), default="iid", help="edgefl's split, given to both")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (--partition dirichlet)")
    p.add_argument("--width", type=float, default=0.25, help="channel scale of both sides' ResNets (paper: 1)")
    p.add_argument("--feature-dim", type=int, default=128, help="edgefl's common feature width (theirs: 1024 x width)")
    p.add_argument("--test-samples", type=int, default=2000, help="a multiple of 500 (they evaluate in batches of 500)")
    p.add_argument("--curve", type=int, default=5, help="evaluations over the run (the last at its end)")
    p.add_argument("--sides", default="authors,edgefl", help="authors, edgefl or both")
    p.add_argument("--methods", default="felo,local", help="felo, velo, local, comma-separated (velo: their Server_new_VAE)")
    p.add_argument("--stem", choices=("imagenet", "small"), default="imagenet",
                   help="edgefl's ResNet stem (small: 3x3 stride 1 without max-pool, nearer their 3x3 stem at 32x32 "
                        "and several times the compute)")
    p.add_argument("--lr-milestones", type=lambda v: [float(x) for x in v.split(",") if x], default=[],
                   help="edgefl's train.lr_milestones, comma-separated (0.5: a ten-fold drop at half the run, as their "
                        "Fashion-MNIST schedule; default none)")
    p.add_argument("--velo-cvae-data", choices=("class_means", "sample_features"), default="class_means",
                   help="what edgefl's Velo CVAE learns from: the per-class means (Algorithm 2) or every trained sample's "
                        "feature (their code)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--tag", default="", help="names the result: bench/results/authors_felo-TAG.json")
    p.add_argument("--plot-dir", type=users_path, default=None, help="also draw the accuracy curves there")
    p.add_argument("--replot", type=users_file, default=None, help="draw the curves of a saved result (no runs)")
    p.add_argument("--resume", action="store_true", help="keep the runs an earlier sitting of the same setting and --tag "
                                                         "finished (bench/results/authors_felo-TAG.json), run the rest")
    args = p.parse_args()
    if args.replot:
        import json

        try:
            out = plot(json.loads(args.replot.read_text()), (args.plot_dir or Path("bench/results")) / (args.replot.stem + ".png"))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # (not a results file of this benchmark)
            raise SystemExit(f"{args.replot} is not a result authors_felo wrote ({type(exc).__name__}: {str(exc)[:80]})") from None
        print(f"drew {out}")
        return
    sides = {s for s in args.sides.split(",") if s}
    if not sides <= {"authors", "edgefl"} or not sides:
        p.error(f"--sides {args.sides!r}: it takes authors, edgefl or both, comma-separated")
    methods = list(dict.fromkeys(m for m in args.methods.split(",") if m))
    if not methods or not set(methods) <= {"felo", "velo", "local"}:
        p.error(f"--methods {args.methods!r}: it takes felo, velo and local, comma-separated")
    if "authors" in sides and args.authors_dir is None:
        p.error("--authors-dir is needed for the authors' side (git clone https://github.com/ChanYunHin/Felo_Velo)")
    if "authors" in sides and (problem := checkout_problem(args.authors_dir.resolve())):
        p.error(problem)
    if args.iterations < 100 or args.iterations % 2:
        p.error("--iterations must be even and at least 100")
    if not 1 <= args.curve <= args.iterations // 2:
        p.error("--curve must be at least 1 and at most half of --iterations")
    if args.test_samples % 500 or not 500 <= args.test_samples <= 10000:
        p.error("--test-samples must be a multiple of 500, at most 10000")
    torch.set_num_threads(args.threads)
    ds = load("fashion-mnist")

    run = build_run(validate_config(edgefl_config(args, "felo"), "authors_felo config"), ds)
    parts = [np.asarray(s.sample_indices) for s in run.slots]
    assert [s.model for s in run.slots] == [d for d in RESNETS for _ in range(2)], "edgefl's device order changed"
    test_idx = np.sort(np.random.default_rng(0).choice(len(ds.y_test), args.test_samples, replace=False))
    if args.test_samples < len(ds.y_test):  # edgefl.build.test_subset's subset, given to the authors too
        assert torch.equal(ds.y_test[test_idx], run.y_test), "edgefl's test subset is not the one rebuilt here"
    else:
        test_idx = np.arange(len(ds.y_test))
    log(f"split {args.partition}: samples per client {[len(q) for q in parts]}; test images {len(test_idx)}")

    results: dict = {}
    jobs = []
    for method in methods:
        shown = method.capitalize() if method != "local" else "local"
        if "authors" in sides:
            jobs.append((f"authors {shown}", lambda m=method, n=shown: run_authors(args, ds, parts, test_idx, m, n)))
        if "edgefl" in sides:
            jobs.append((f"edgefl {shown}", lambda m=method, n=shown: run_edgefl(edgefl_config(args, m), ds, n)))
            if method != "local":
                jobs.append((f"edgefl {shown}, personal",
                             lambda m=method, n=shown: run_edgefl(edgefl_config(args, m, personal=True), ds, f"{n}, personal")))
    setting = (f"Fashion-MNIST {args.partition}, {args.iterations} iterations of 2 clients x {STEPS} batches of {BATCH}, "
               f"seed {args.seed}, width {args.width}" + (f", edgefl's stem {args.stem}" if args.stem != "imagenet" else "")
               + (f", edgefl's learning rate x 0.1 at {args.lr_milestones} of the run" if args.lr_milestones else "")
               + (", edgefl's Velo CVAE on per-sample features" if args.velo_cvae_data != "class_means" else ""))
    stem = "authors_felo" + (f"-{args.tag}" if args.tag else "")
    extra = {"authors_checkout_sha256": checkout_digests(args.authors_dir.resolve())} if "authors" in sides else {}
    same = {k: str(getattr(args, k)) for k in SAME_RUN}
    same.update({k: str(getattr(args, k)) for k in SAME_RUN_IF_SET if getattr(args, k) != p.get_default(k)})
    earlier = earlier_results(RESULTS / f"{stem}.json", same) if args.resume else {}
    results.update({label: r for label, r in earlier.items() if label in dict(jobs)})  # not run again
    if earlier:
        log(f"taken from {RESULTS / (stem + '.json')}: {', '.join(earlier)}")

    def record(complete: bool) -> Path:
        """Saved after every run, so a stopped command keeps what finished (--resume goes on from it);
        runs of an earlier sitting this command does not ask for (another --sides or --methods) stay."""
        return save(stem, {"setting": setting, "args": {k: str(v) for k, v in vars(args).items()}, "same_run": same,
                           "split_sizes": [len(q) for q in parts], "results": {**earlier, **results},
                           "complete": complete, **extra})

    for label, job in jobs:
        if label in results:
            continue
        t0 = time.perf_counter()
        results[label] = job()
        results[label]["seconds"] = round(time.perf_counter() - t0)
        results[label]["machine"] = machine()  # sittings may run on other machines (and code)
        results[label]["edgefl_commit"] = source_commit()
        torch.set_num_threads(args.threads)
        log(f"{label}: {results[label]['own']:.4f} in {results[label]['seconds']} s")
        record(complete=False)
    results = {label: results[label] for label, _ in jobs}  # the command's order, whichever sitting ran each

    cols = list(results)
    print(f"\n{setting}\n| | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
    print("| mean accuracy | " + " | ".join(f"{100 * results[c]['own']:.2f}" for c in cols) + " |")
    rows = list(dict.fromkeys(name for c in cols for name in results[c]["per_model"]))  # edgefl's depths, their classes
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{100 * results[c]['per_model'][row]:.2f}" if row in results[c]["per_model"] else ""
                                          for c in cols) + " |")
    print("| seconds | " + " | ".join(str(results[c]["seconds"]) for c in cols) + " |")
    for label in cols:
        side = label.split()[0]
        if label != f"{side} local" and f"{side} local" in results:
            gain = 100 * (results[label]["own"] - results[f"{side} local"]["own"])
            print(f"{label} - {side} local = {gain:+.2f} points")
    path = record(complete=True)
    print(f"saved {path}")
    if args.plot_dir:
        print(f"drew {plot({'setting': setting, 'results': results}, args.plot_dir / (stem + '.png'))}")


if __name__ == "__main__":
    main()
