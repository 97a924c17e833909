"""FedMHO side by side: the authors' public code (YXShi2000/FedMHO, PyTorch + MPI, built on
FedDF's code) and edgefl's ``fedmho`` / ``fedmho-md`` / ``fedmho-sd``, on the same Fashion-MNIST
Dirichlet split, the same initial weights, models (VGG-9 scaled by ``--width``, CVAE-small),
optimisers and lengths, on this machine (issue 38, item 3).

The authors' code is run from ``--authors-dir`` (a checkout of their repository; nothing of it is
copied here). Their processes talk over MPI (``mpirun`` + ``torch.distributed``); here one process
plays them in turn:

* each client is the authors' ``pcode.worker_lmf.Worker`` (what ``main.py`` starts for
  ``scheme=semi_supervised``) running its own ``run()`` loop, with ``torch.distributed``'s
  ``broadcast / recv / send / barrier`` answered in-process (the activation message, the
  initial weights, the upload); it builds its own model, criterion, optimiser and scheduler
  from the authors' ``parameters.py`` arguments and trains with the authors' loop;
* the server is the authors' ``pcode.aggregation.fedavg._fedavg`` (the uniform average per
  architecture the master takes first) and ``pcode.aggregation.semi_supervised.aggregate`` (the
  FedMHO server: generation, K-means filtering, fusion), called as ``master_lmf`` calls them,
  once per variant (``--is_md`` / ``--is_sd``; FedMHO itself is both false).

What is changed around their code: edgefl's split replaces their Dirichlet partitioner (the
worker's ``data_partitioner`` and the master's ``shared_targets_of_partitions``); the initial
weights they receive are edgefl's (``--init edgefl``, the default: the shared VGG-9 start and each
CVAE client's own start), or their own template's (``--init authors``); their ``VGG9`` is narrowed
to ``--width`` after it is built (edgefl's rounding, their layer order kept); ``Tensor.cuda()``
is the identity on a machine without CUDA (their MD / SD loss calls it); the few modules that
only their ImageNet / compression paths import (``lmdb``, ``cv2``, ``bit2byte``) are empty
stand-ins when not installed. Their stdout goes to a log file (its path is printed).

edgefl runs the same clients and server variants as ``bench/fedmho_table4.py`` (the product's
client and server halves; one set of uploads fused by every variant) with the authors' settings:
CVAE Adam at 5e-2 (their worker's value for Fashion-MNIST CVAE-small), VGG-9 SGD at ``--vgg-lr``
with momentum 0.9, batch 64, server Adam 5e-4 for 20 epochs (their hard-coded Fashion value),
``keep_ratio`` 0.8, and ``fusion_loss = "authors-code"`` for MD / SD.

Both sides' models are judged here by one evaluator on the same test images.

    python bench/authors_fedmho.py --authors-dir /tmp/authors/FedMHO [--seed 0] [--alpha 0.5]
        [--width 0.25] [--vgg-epochs 2] [--cvae-epochs 5] [--cvae-lr 5e-2] [--synthetic 1000]
        [--samples-per-client N] [--test-samples 2500] [--init edgefl|authors] [--threads 1] [--tag NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import os
import struct
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
from common import checkout_problem, load, save, users_path
from fedmho_table4 import _average_accuracy, fit, fuse
from torch import nn

from edgefl.algorithms.training import evaluate_accuracy
from edgefl.config import validate_config
from edgefl.messages import decode
from edgefl.sim import Simulation

NUM_CLIENTS, PER_ARCH = 10, 5
VARIANTS = {"FedMHO": ("fedmho", False, False), "FedMHO-MD": ("fedmho-md", True, False), "FedMHO-SD": ("fedmho-sd", False, True)}
GLOBAL_EPOCHS, GLOBAL_LR = 20, 5e-4  # semi_supervised.py: Fashion-MNIST (not FedCVAE) -> 20 epochs at 5e-4, batch 64
CVAE_LR = 5e-2  # worker_lmf.py: mnist / fashionmnist, CVAE-small -> Adam(lr=5e-2)


_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:7.0f} s] {msg}", flush=True)


# --- edgefl's side -----------------------------------------------------------------------------

def edgefl_config(args, method: str) -> dict:
    vgg_train = {"optimizer": "sgd", "lr": args.vgg_lr, "momentum": 0.9, "epochs": args.vgg_epochs}
    cvae_train = {"optimizer": "adam", "lr": args.cvae_lr, "epochs": args.cvae_epochs}
    data = {"dataset": "fashion-mnist", "partition": "dirichlet", "alpha": args.alpha, "min_samples": 10,
            "test_samples": args.test_samples}
    if args.samples_per_client:
        data["samples_per_client"] = args.samples_per_client
    return {
        "name": f"authors-fedmho-{method}", "seed": args.seed, "rounds": 1, "threads": args.threads,
        "method": {"name": method, "global_epochs": GLOBAL_EPOCHS, "global_lr": GLOBAL_LR, "global_batch": 64,
                   "synthetic_samples": args.synthetic, "keep_ratio": 0.8, "device": "cpu",
                   **({"fusion_loss": "authors-code"} if method != "fedmho" else {})},
        "data": data,
        "train": {"batch_size": 64},
        "fleet": {"groups": [{"model": "vgg9", "count": PER_ARCH, "options": {"width": args.width}, "train": vgg_train},
                             {"model": "cvae-small", "count": PER_ARCH, "train": cvae_train}]},
    }


def run_edgefl(args, ds) -> tuple[dict, dict]:
    raw = edgefl_config(args, "fedmho")
    sim = Simulation(validate_config(raw, "authors_fedmho config"), dataset=ds, show_progress=False)
    x_test, y_test = sim.x_test, sim.y_test
    order = [s.client_id for s in sim.slots]  # slot i <-> the authors' client i + 1 (vgg9 x 5, then cvae x 5)
    assert [s.model for s in sim.slots] == ["vgg9"] * PER_ARCH + ["cvae-small"] * PER_ARCH
    vgg_arch = sim.slots[0].arch
    sim.server.begin_round(1)
    inits = [{k: v.detach().clone() for k, v in sim.server.initial[vgg_arch].items()}] * PER_ARCH
    inits += [{k: v.detach().clone() for k, v in sim.clients[cid].model.state_dict().items()} for cid in order[PER_ARCH:]]
    shared = {"order": order, "parts": [np.asarray(s.sample_indices) for s in sim.slots], "inits": inits,
              "x_test": x_test, "y_test": y_test}
    uploads, t0 = {}, time.perf_counter()
    for i, cid in enumerate(order):
        uploads[cid] = fit(sim, cid)
        log(f"edgefl: client {i + 1} ({sim.slots[i].model}) trained ({time.perf_counter() - t0:.0f} s)")
    vggs = order[:PER_ARCH]
    out = {"w0 (average of the VGG-9 clients)": _average_accuracy(sim, vggs, uploads, x_test, y_test),
           "local VGG-9 clients (mean)": float(np.mean([evaluate_accuracy(sim.clients[c].model, x_test, y_test) for c in vggs]))}
    for name, (method, _, _) in VARIANTS.items():
        acc, rec = fuse(edgefl_config(args, method), sim.ds, sim.slots, uploads, x_test, y_test)
        out[name] = acc
        log(f"edgefl: {name}: {acc:.4f} (kept {rec.get('kept')} synthetic samples, {rec.get('server_s')} s)")
    out["upload bytes, VGG-9 / CVAE"] = [len(uploads[vggs[0]]), len(uploads[order[-1]])]
    out["CVAE upload tensors"] = sorted(decode(uploads[order[-1]]).tensors)
    return out, shared


# --- the authors' side -------------------------------------------------------------------------

def narrow_vgg9(model: nn.Module, width: float) -> None:
    """The authors' VGG9 with edgefl's width rounding (edgefl.models.vgg.build_vgg9), their layer order kept."""
    c = [max(4, round(n * width)) for n in (64, 128, 256, 256)]
    fc = max(16, round(4096 * width))
    convs = [i for i, m in enumerate(model.features) if isinstance(m, nn.Conv2d)]
    cin = model.features[convs[0]].in_channels
    for i, cout in zip(convs, c, strict=True):
        model.features[i] = nn.Conv2d(cin, cout, kernel_size=3, padding=1)
        cin = cout
    linears = [i for i, m in enumerate(model.classifier) if isinstance(m, nn.Linear)]
    for i, a, b in zip(linears, (c[-1] * 49, fc, fc), (fc, fc, model.output_size), strict=True):
        model.classifier[i] = nn.Linear(a, b)


def fashion_root(work: Path, ds) -> Path:
    """edgefl's Fashion-MNIST written back as the four uncompressed IDX files, where torchvision's
    FashionMNIST looks for them (``<data_dir>/fashionmnist/FashionMNIST/raw``): the same pixels."""
    raw = work / "data" / "fashionmnist" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for split, x, y in (("train", ds.x_train, ds.y_train), ("t10k", ds.x_test, ds.y_test)):
        pixels = (x.squeeze(1) * 255).round().to(torch.uint8).numpy()
        (raw / f"{split}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, *pixels.shape) + pixels.tobytes())
        labels = y.to(torch.uint8).numpy()
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, len(labels)) + labels.tobytes())
    return work / "data"


class _Wire:
    """What MPI would carry between the master and the one worker playing now."""

    def __init__(self) -> None:
        self.activation: torch.Tensor | None = None
        self.to_worker: torch.Tensor | None = None
        self.from_worker: torch.Tensor | None = None


@contextlib.contextmanager
def in_process_dist(wire: _Wire):
    import torch.distributed as dist

    names = ("barrier", "broadcast", "send", "recv", "is_initialized")
    saved = {n: getattr(dist, n) for n in names}

    def broadcast(tensor, src=0, **_):
        tensor.copy_(wire.activation)

    def recv(tensor, src=None, **_):
        tensor.copy_(wire.to_worker)
        return src

    def send(tensor, dst=None, **_):
        wire.from_worker = tensor.detach().clone()

    dist.barrier, dist.broadcast, dist.send, dist.recv = (lambda *a, **k: None), broadcast, send, recv
    dist.is_initialized = lambda: False
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


@contextlib.contextmanager
def adam_lr(lr: float | None):
    """Their worker builds the CVAE's ``torch.optim.Adam`` with a hard-coded rate (5e-2 for
    Fashion-MNIST CVAE-small); ``--cvae-lr`` other than that replaces it, on both sides."""
    if lr is None:
        yield
        return
    saved = torch.optim.Adam

    def adam(params, lr_=None, *a, **k):
        k.pop("lr", None)
        return saved(params, *a, lr=lr, **k)

    torch.optim.Adam = adam
    try:
        yield
    finally:
        torch.optim.Adam = saved


@contextlib.contextmanager
def cuda_as_identity():
    if torch.cuda.is_available():
        yield
        return
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = saved


def run_authors(args, ds, shared: dict, stdout) -> dict:
    authors = str(Path(args.authors_dir).resolve())
    for name in ("lmdb", "cv2", "bit2byte"):  # imported at module level by paths this run never takes
        if importlib.util.find_spec(name) is None:
            sys.modules.setdefault(name, types.ModuleType(name))
    import matplotlib

    matplotlib.use("Agg")
    work = Path(tempfile.mkdtemp(prefix="authors-fedmho-"))
    data_dir = fashion_root(work, ds)
    # the README's FedMHO command, for Fashion-MNIST on this CPU (n_participated: what run.py passes to main.py)
    argv = ["main.py", "--arch", "vgg9", "--complex_arch", f"master=vgg9,worker=vgg9:cvae,num_clients_per_model={PER_ARCH}",
            "--experiment", "heterogeneous", "--data", "fashionmnist", "--data_dir", str(data_dir), "--pin_memory", "False",
            "--batch_size", "64", "--num_workers", "0", "--partition_data", "non_iid_dirichlet",
            "--non_iid_alpha", str(args.alpha), "--train_data_ratio", "1", "--val_data_ratio", "0",
            "--n_clients", str(NUM_CLIENTS), "--participation_ratio", "1", "--n_participated", str(NUM_CLIENTS),
            "--n_comm_rounds", "1", "--local_n_epochs", str(args.vgg_epochs), "--cvae_local_epoch", str(args.cvae_epochs),
            "--world_conf", "0,0,1,1,100", "--on_cuda", "False",
            "--fl_aggregate", "scheme=semi_supervised,clean_rate=0.8", "--optimizer", "sgd", "--lr", str(args.vgg_lr),
            "--local_prox_term", "0", "--lr_warmup", "False", "--lr_warmup_epochs", "5",
            "--lr_warmup_epochs_upper_bound", "150", "--lr_scheduler", "MultiStepLR", "--lr_decay", "0.01",
            "--weight_decay", "0", "--use_nesterov", "False", "--momentum_factor", "0.9", "--track_time", "False",
            "--manual_seed", str(args.seed), "--pn_normalize", "False", "--same_seed_process", "True",
            "--use_hog_feature", "False", "--latent_size", "20", "--num_synthesis_sample", str(args.synthetic)]
    saved_argv, saved_cwd, saved_path = sys.argv, os.getcwd(), list(sys.path)
    sys.argv, sys.path[:0] = argv, [authors]
    os.chdir(work)  # their data_clean writes example_images/ into the working directory
    wire = _Wire()
    try:
        with contextlib.redirect_stdout(stdout):
            import parameters
            import pcode.aggregation.fedavg as fedavg
            import pcode.aggregation.semi_supervised as semi_supervised
            import pcode.create_dataset as create_dataset
            import pcode.create_model as create_model
            import pcode.datasets.partition_data as partition_data
            from pcode.utils.logging import Logger
            from pcode.utils.param_parser import dict_parser
            from pcode.utils.tensor_buffer import TensorBuffer
            from pcode.worker_lmf import Worker

            vgg = sys.modules["pcode.models.vgg"]  # the package re-exports a function of the same name

            for mod in (parameters, semi_supervised, vgg):
                assert mod.__file__.startswith(authors), f"{mod.__name__} was imported from {mod.__file__}, not --authors-dir"
            if args.width != 1:
                build = vgg.VGG9.__init__

                def narrowed(self, dataset="svhn"):
                    build(self, dataset)
                    narrow_vgg9(self, args.width)

                vgg.VGG9.__init__ = narrowed

            conf = parameters.get_args()
            # main.init_config without MPI: one graph per process, the seed every process gets (same_seed_process)
            conf.graph = types.SimpleNamespace(rank=0, worker_id=0, client_id=0, comm_round=1, on_cuda=False)
            conf.random_state = np.random.RandomState(conf.manual_seed)
            torch.manual_seed(conf.manual_seed)
            conf.arch_info = dict_parser(conf.complex_arch)
            conf.arch_info["worker"] = conf.arch_info["worker"].split(":")
            conf._fl_aggregate = conf.fl_aggregate
            conf.fl_aggregate = dict_parser(conf.fl_aggregate)
            for k, v in conf.fl_aggregate.items():
                setattr(conf, f"fl_aggregate_{k}", v)
            conf.checkpoint_dir = str(work)
            conf.logger = Logger(str(work))

            # the master's templates, arch map and data (master_lmf.Master.__init__)
            conf.clientid2arch = {cid: create_model.determine_arch(conf, cid, use_complex_arch=True)
                                  for cid in range(1, 1 + NUM_CLIENTS)}
            archs = sorted(set(conf.clientid2arch.values()))
            client_models = dict(create_model.define_model(conf, to_consistent_model=False, arch=a) for a in archs)
            data = create_dataset.define_dataset(conf, data=conf.data)
            raw_train = data["train"].data  # torchvision's FashionMNIST (train is an 'origin' Partition of all of it)
            partition_data.shared_targets_of_partitions = partition_data.record_class_distribution(
                shared["parts"], raw_train.targets, print_fn=conf.logger.log).items()
            partitioner = object.__new__(partition_data.DataPartitioner)
            partitioner.data, partitioner.partitions = raw_train, [list(map(int, p)) for p in shared["parts"]]

            activation = torch.zeros((3, NUM_CLIENTS))
            activation[0, :] = torch.arange(1, 1 + NUM_CLIENTS)
            activation[1, :] = 1
            activation[2, :] = conf.local_n_epochs
            wire.activation = activation
            flat = {}
            for cid in range(1, 1 + NUM_CLIENTS):
                arch = conf.clientid2arch[cid]
                template = copy.deepcopy(client_models[arch])
                if args.init == "edgefl":
                    values = list(template.state_dict().values())
                    edgefl_init = list(shared["inits"][cid - 1].values())
                    assert [tuple(v.shape) for v in values] == [tuple(v.shape) for v in edgefl_init], f"{arch}: layouts differ"
                    template.load_state_dict(dict(zip(template.state_dict(), edgefl_init, strict=True)))
                wire.to_worker = TensorBuffer(list(template.state_dict().values())).buffer
                wconf = copy.copy(conf)
                wconf.graph = types.SimpleNamespace(rank=cid, worker_id=cid, client_id=cid, comm_round=1, on_cuda=False)
                torch.manual_seed(conf.manual_seed)  # every MPI process starts from the same seed
                t0 = time.perf_counter()
                override = args.cvae_lr if "vae" in arch and args.cvae_lr != CVAE_LR else None
                with in_process_dist(wire), adam_lr(override):
                    worker = Worker(wconf)
                    worker.data_partitioner = partitioner  # edgefl's split: client cid trains on shared["parts"][cid - 1]
                    try:
                        worker.run()
                    except RuntimeError as exc:  # their CVAE at Adam 5e-2 can diverge: BCE then refuses NaN reconstructions
                        raise SystemExit(f"the authors' client {cid} ({arch}) failed: {exc}; see {stdout.name}") from None
                tb = TensorBuffer(list(client_models[arch].state_dict().values()))
                tb.buffer = wire.from_worker
                flat[cid] = tb
                print(f"[{time.perf_counter() - t0:.0f} s] client {cid} ({arch}) trained", file=sys.__stdout__, flush=True)

            # the master: uniform average per architecture, then the FedMHO server once per variant
            vgg_ids = [c for c in flat if "vae" not in conf.clientid2arch[c]]
            fedavg_models = {"vgg9": fedavg._fedavg(conf.clientid2arch, len(vgg_ids), {c: flat[c] for c in vgg_ids}, client_models)}
            x_test, y_test = shared["x_test"], shared["y_test"]
            out = {"w0 (average of the VGG-9 clients)": evaluate_accuracy(fedavg_models["vgg9"], x_test, y_test)}
            locals_ = []
            for c in vgg_ids:
                m = copy.deepcopy(client_models["vgg9"])
                state = m.state_dict()
                flat[c].unpack(state.values())  # rebinds each tensor's .data (their TensorBuffer): load it, as their _fedavg does
                m.load_state_dict(state)
                locals_.append(evaluate_accuracy(m, x_test, y_test))
            out["local VGG-9 clients (mean)"] = float(np.mean(locals_))
            test_set = partition_data.Partition(data["test"], [int(i) for i in shared["test_idx"]])
            test_loader = torch.utils.data.DataLoader(test_set, batch_size=conf.batch_size, shuffle=False)
            for name, (_, is_md, is_sd) in VARIANTS.items():
                conf.is_md, conf.is_sd = is_md, is_sd
                torch.manual_seed(conf.manual_seed)
                t0 = time.perf_counter()
                with cuda_as_identity():
                    fused, *_ = semi_supervised.aggregate(conf, fedavg_models, client_models, None, None, flat, test_loader,
                                                          [[] for _ in range(10)], train_global_model=True)
                out[name] = evaluate_accuracy(fused["vgg9"], x_test, y_test)
                print(f"[{time.perf_counter() - t0:.0f} s] authors: {name}: {out[name]:.4f}", file=sys.__stdout__, flush=True)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
    out["work_dir"] = str(work)
    return out


# --- the comparison ----------------------------------------------------------------------------

#: what of the authors' checkout this script imports (checked before any training)
AUTHORS_FILES = ("parameters.py", "pcode/aggregation/fedavg.py", "pcode/aggregation/semi_supervised.py", "pcode/create_dataset.py",
                 "pcode/create_model.py", "pcode/datasets/partition_data.py", "pcode/worker_lmf.py")

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--authors-dir", type=users_path, help="a checkout of github.com/YXShi2000/FedMHO")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration of edgefl's split (both sides)")
    p.add_argument("--width", type=float, default=0.25, help="VGG-9 width on both sides (paper: 1, 69 M parameters)")
    p.add_argument("--vgg-epochs", type=int, default=2, help="local VGG-9 epochs (README: 200)")
    p.add_argument("--vgg-lr", type=float, default=5e-3, help="local VGG-9 SGD learning rate, momentum 0.9 (README: 1e-3 for "
                                                             "EMNIST; bench/fedmho_table4.py: 5e-3)")
    p.add_argument("--cvae-epochs", type=int, default=5, help="local CVAE epochs (authors' Fashion default: 40)")
    p.add_argument("--cvae-lr", type=float, default=CVAE_LR, help="CVAE Adam learning rate, both sides (authors' code: 5e-2, "
                                                                   "hard-coded; bench/fedmho_table4.py: 1e-3)")
    p.add_argument("--synthetic", type=int, default=1000, help="synthetic samples N before filtering (authors' default 6000; "
                                                              "at least 1000: their filter draws an 8 x 8 grid of each class)")
    p.add_argument("--samples-per-client", type=int, default=None, help="edgefl's data.samples_per_client (both sides)")
    p.add_argument("--test-samples", type=int, default=2500)
    p.add_argument("--init", choices=("edgefl", "authors"), default="edgefl",
                   help="initial weights the authors' workers receive: edgefl's (the same as edgefl's clients) or their template's")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    if args.authors_dir is None:
        p.error("--authors-dir is needed: git clone https://github.com/YXShi2000/FedMHO and pass its folder")
    if problem := checkout_problem(args.authors_dir.resolve(), AUTHORS_FILES, "YXShi2000/FedMHO"):
        p.error(problem)  # before the edgefl side trains (minutes), not after it
    if args.synthetic < 1000:
        p.error("--synthetic must be at least 1000: the authors' data_clean shows 64 kept samples of every class")
    torch.set_num_threads(args.threads)
    ds = load("fashion-mnist")

    results: dict = {}
    t0 = time.perf_counter()
    results["edgefl"], shared = run_edgefl(args, ds)
    results["edgefl"]["seconds"] = round(time.perf_counter() - t0)
    shared["test_idx"] = (np.sort(np.random.default_rng(0).choice(len(ds.y_test), args.test_samples, replace=False))
                          if args.test_samples < len(ds.y_test) else np.arange(len(ds.y_test)))
    assert torch.equal(ds.y_test[shared["test_idx"]], shared["y_test"]), "edgefl's test subset is not the one rebuilt here"
    log(f"split Dirichlet({args.alpha}): samples per client {[len(x) for x in shared['parts']]}")

    t0 = time.perf_counter()
    log_path = Path(tempfile.mkdtemp(prefix="authors-fedmho-log-")) / "authors-stdout.txt"
    log(f"authors' code: their output goes to {log_path}")
    with open(log_path, "w") as stdout:
        results["authors"] = run_authors(args, ds, shared, stdout)
    results["authors"]["seconds"] = round(time.perf_counter() - t0)
    results["authors"]["stdout"] = str(log_path)
    torch.set_num_threads(args.threads)

    setting = (f"Fashion-MNIST Dir({args.alpha}), seed {args.seed}, VGG-9 width {args.width}, {args.vgg_epochs} VGG / "
               f"{args.cvae_epochs} CVAE epochs (CVAE Adam {args.cvae_lr}), N = {args.synthetic}, init {args.init}")
    rows = ["local VGG-9 clients (mean)", "w0 (average of the VGG-9 clients)", *VARIANTS]
    print(f"\n{setting}\n| setting | authors' code | edgefl |\n|---|---|---|")
    for r in rows:
        print(f"| {r} | {100 * results['authors'][r]:.2f} | {100 * results['edgefl'][r]:.2f} |")
    print(f"| seconds | {results['authors']['seconds']} | {results['edgefl']['seconds']} |")
    name = "authors_fedmho" + (f"-{args.tag}" if args.tag else "")
    path = save(name, {"setting": setting, "args": {k: str(v) for k, v in vars(args).items()},
                       "split_sizes": [len(x) for x in shared["parts"]], "results": results})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
