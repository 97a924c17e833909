"""FedHe side by side: the authors' public code (ChanYunHin/FedHe, TensorFlow 2 / Keras) and
edgefl's ``fedhe``, on the same Fashion-MNIST split, the same ten CNNs (scaled by ``--width``),
the same optimiser, batches, schedule and length, on this machine (issue 38, item 3).

The authors' code is run from ``--authors-dir`` (a checkout of their repository; nothing of it is
copied here) through its own entry point, ``main.main()``, which builds their ``Server`` and runs
their asynchronous loop (``Server.asynchronous_training``). What this script changes around it:

* ``tensorflow`` is not installed here (and is too large to add): a small module placed in
  ``sys.modules`` maps ``tf.keras`` to Keras 3 on its PyTorch backend (``pip install keras``),
  with ``tf.GradientTape`` over ``torch.autograd.grad``. Keras 3 keeps the Keras layers'
  semantics the authors relied on (BatchNormalization momentum 0.99 / epsilon 1e-3, LecunNormal
  kernels, zero biases, TF's "same" average pooling, Adam epsilon 1e-7).
* ``tf.keras.datasets.mnist.load_data`` returns Fashion-MNIST (MNIST is not on this machine),
  test images restricted to edgefl's fixed test subset; the authors' own normalisation runs.
* their contiguous ten-way split (``Dataset.splited_batch``) is replaced by edgefl's split: the
  authors' client ``k`` (model ``k`` of their list) gets the indices of edgefl's device that runs
  ``fedhe-cnn-k``;
* their model constructors get the filter counts scaled by ``--width`` (edgefl's rounding);
* ``Client.train_step``'s logits come back detached, as a NumPy array whose ``+=`` makes a new
  array (TensorFlow eager tensors are immutable and carry no tape; torch tensors would chain one
  autograd graph through the whole run in the authors' in-place ``+=`` sums).

edgefl runs the ``fedhe-paper`` preset (asynchronous, one device at a time, 3 batches of 50,
Adam 1e-3, alpha 1, MSE) aligned to the authors' code where edgefl has the option:
``count_offset = 0`` (their client sends the plain per-class mean), ``warmup_rounds = 10``
(distillation from iteration 11), ``server_weighting = "uniform"``. ``--variants`` adds edgefl
runs that each make one change: ``per-round-adam`` (a new Adam per download, edgefl's default
outside the preset; the preset, as the authors' clients, keeps each device's Adam for the run:
``train.optimizer_state = "kept"``), and, patched here toward the authors' code (not options of
edgefl): ``keras-bn`` (BatchNorm momentum 0.99 / epsilon 1e-3 in Keras' terms), ``lecun-init``
(LecunNormal kernels, zero biases), ``mean-image`` (their input normalisation: pixels / 255 minus
the mean training image), ``all`` (those three); ``preset`` is the preset's own defaults (Eq. 8's +1).

Both sides are judged twice: by their own evaluator (the authors': the mean over the ten clients
of their Keras ``evaluate``; edgefl: the summary's final mean device accuracy) and by one common
evaluator here (every client's final model in inference mode on the same test images).

    python bench/authors_fedhe.py --authors-dir /tmp/authors/FedHe [--iterations 501] [--seed 0]
        [--partition iid|dirichlet] [--width 0.25] [--test-samples 2500] [--samples-per-client N]
        [--variants per-round-adam,keras-bn,lecun-init,mean-image,all,preset] [--no-authors]
        [--threads 1] [--tag NAME]
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import importlib.util
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
from common import accuracy_logger, checkout_problem, load, save, users_path

from edgefl.build import build_run
from edgefl.config import preset_text, validate_config
from edgefl.sim import Simulation

try:
    import tomllib
except ImportError:  # pragma: no cover
    import tomli as tomllib

NUM_CLIENTS = 10
EVAL_EVERY = 100  # the authors' loop evaluates at ep % 100 == 0 (Server.py:293)


_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:7.0f} s] {msg}", flush=True)


# --- edgefl's side -----------------------------------------------------------------------------

def edgefl_config(args, **method_options) -> dict:
    raw = copy.deepcopy(tomllib.loads(preset_text("fedhe-paper")))
    raw.update(seed=args.seed, rounds=args.iterations, threads=args.threads)
    raw["eval"] = {"every": EVAL_EVERY}
    raw["data"]["partition"] = args.partition
    raw["data"]["alpha"] = args.alpha
    raw["data"]["test_samples"] = args.test_samples
    if args.samples_per_client:
        raw["data"]["samples_per_client"] = args.samples_per_client
    for group in raw["fleet"]["groups"]:
        group["options"] = {"width": args.width}
    raw["method"].update(method_options)
    return raw


ALIGNED = {"count_offset": 0, "warmup_rounds": NUM_CLIENTS, "server_weighting": "uniform", "alpha": 1.0, "logit_loss": "mse"}


def per_round_optimizer(raw: dict) -> dict:
    """A new Adam per download (edgefl's default outside the preset); the authors' client keeps one
    Adam for the whole run (Client.py:199), as the preset does (train.optimizer_state = "kept")."""
    raw["train"]["optimizer_state"] = "per_round"
    return raw


def keras_batchnorm(model: torch.nn.Module) -> None:
    """Keras' BatchNormalization defaults: moving averages with momentum 0.99 (torch: 0.01), epsilon 1e-3."""
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum, m.eps = 0.01, 1e-3


@torch.no_grad()
def lecun_init(model: torch.nn.Module) -> None:
    """Keras' LecunNormal kernels (truncated normal, std sqrt(1 / fan_in)) and zero biases, as the authors' layers."""
    for m in model.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            fan_in = m.weight[0].numel()
            std = (1.0 / fan_in) ** 0.5 / 0.87962566103423978  # Keras' truncation correction
            torch.nn.init.trunc_normal_(m.weight, std=std, a=-2 * std, b=2 * std)
            if m.bias is not None:
                m.bias.zero_()


def mean_image(ds):
    """The authors' normalisation (Dataset.py:118-122): pixels / 255 minus the mean training image."""
    import dataclasses

    mean = ds.x_train.mean(0, keepdim=True)
    return dataclasses.replace(ds, x_train=ds.x_train - mean, x_test=ds.x_test - mean)


# name: (method options, config change, per-model tweaks, data transform); each is one change from "aligned"
VARIANTS = {
    "preset": ({}, None, (), None),  # the preset as shipped: Eq. 8's +1 (count_offset = 1)
    "per-round-adam": (ALIGNED, per_round_optimizer, (), None),  # one change away from the authors' code
    "keras-bn": (ALIGNED, None, (keras_batchnorm,), None),
    "lecun-init": (ALIGNED, None, (lecun_init,), None),
    "mean-image": (ALIGNED, None, (), mean_image),
    "all": (ALIGNED, None, (keras_batchnorm, lecun_init), mean_image),  # every patch toward their code at once
}


def run_edgefl(raw: dict, ds, label: str, tweaks=()) -> dict:
    cfg = validate_config(raw, "authors_fedhe config")

    on_record = accuracy_logger(log, f"edgefl {label}: update", "mean device accuracy")
    sim = Simulation(cfg, None, dataset=ds, show_progress=False, on_round=on_record)
    for tweak in tweaks:
        for client in sim.clients.values():
            tweak(client.model)
    summary = sim.run()
    per_client = {}
    for cid, client in sim.clients.items():
        per_client[sim.slot_of[cid].model] = evaluate_torch(client.model, sim.x_test, sim.y_test)
    curve = [(h["round"], h["accuracy"]["overall"]) for h in sim.history if h.get("accuracy")]
    return {"own": summary["final_accuracy"]["overall"], "common": float(np.mean(list(per_client.values()))),
            "per_client": per_client, "curve": curve}


@torch.no_grad()
def evaluate_torch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 500) -> float:
    model.eval()
    correct = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum()) for i in range(0, len(y), batch))
    return correct / len(y)


# --- the authors' side -------------------------------------------------------------------------

class _TFArray(np.ndarray):
    """A NumPy array whose ``+=`` returns a new array, like a TensorFlow eager tensor's."""

    def __iadd__(self, other):
        return np.add(self, other)


#: what of the authors' checkout this script runs (checked before any training)
AUTHORS_FILES = ("main.py", "parameters.py", "modules/Client.py", "modules/Dataset.py", "modules/Server.py")


def install_tensorflow_shim(fashion: tuple, seed: int) -> None:
    """``import tensorflow`` for the authors' code: Keras 3 on PyTorch, plus the few tf.* names
    their modules use (GradientTape, zeros, nn.softmax, gen_math_ops.mean, keras.datasets)."""
    os.environ["KERAS_BACKEND"] = "torch"
    try:
        import keras
    except ImportError:
        sys.exit("the authors' FedHe needs Keras 3 here (pip install keras): TensorFlow is replaced by Keras on PyTorch")
    if keras.backend.backend() != "torch":
        sys.exit(f"Keras runs on {keras.backend.backend()}; set KERAS_BACKEND=torch before anything imports keras")
    keras.utils.set_random_seed(seed)  # Python, NumPy, torch and Keras' own generators (before tf.* exists here)
    if not hasattr(keras.metrics.Metric, "reset_states"):  # Keras 2's name, used by the authors (Client.py:314)
        keras.metrics.Metric.reset_states = keras.metrics.Metric.reset_state

    class GradientTape:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def gradient(self, loss, variables):
            return list(torch.autograd.grad(loss, [v.value for v in variables]))

    datasets = types.SimpleNamespace(mnist=types.SimpleNamespace(load_data=lambda: fashion),
                                     cifar10=types.SimpleNamespace(load_data=lambda: sys.exit("cifar10 is not used here")))
    def stacked(y_true):  # TF 2 turned a list of per-sample arrays into one tensor; Keras 3 reads a list as a structure
        return np.stack(y_true) if isinstance(y_true, list) else y_true

    class MSELoss(keras.losses.MeanSquaredError):
        def __call__(self, y_true, y_pred, sample_weight=None):
            return super().__call__(stacked(y_true), y_pred, sample_weight)

    class MSEMetric(keras.metrics.MeanSquaredError):
        def update_state(self, y_true, y_pred, sample_weight=None):
            return super().update_state(stacked(y_true), y_pred, sample_weight)

    def proxy(name: str, target, **overrides) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__getattr__ = lambda attr: getattr(target, attr)  # PEP 562: everything else is Keras 3's
        module.__dict__.update(overrides)
        return module

    tf_keras = proxy("tensorflow.keras", keras, datasets=datasets,
                     losses=proxy("tensorflow.keras.losses", keras.losses, MeanSquaredError=MSELoss),
                     metrics=proxy("tensorflow.keras.metrics", keras.metrics, MeanSquaredError=MSEMetric))
    tf = types.ModuleType("tensorflow")
    tf.keras, tf.GradientTape, tf.zeros = tf_keras, GradientTape, keras.ops.zeros
    tf.nn = types.SimpleNamespace(softmax=keras.ops.softmax)
    tf.image = types.SimpleNamespace()  # only the CIFAR "distorted" path uses it
    tf.random = types.SimpleNamespace(set_seed=lambda s: None)  # Keras' set_random_seed looks for it
    python, ops, gen = (types.ModuleType(n) for n in ("tensorflow.python", "tensorflow.python.ops",
                                                       "tensorflow.python.ops.gen_math_ops"))
    gen.mean = keras.ops.mean
    tf.python, python.ops, ops.gen_math_ops = python, ops, gen
    sys.modules.update({"tensorflow": tf, "tensorflow.keras": tf_keras, "tensorflow.keras.utils": keras.utils,
                        "tensorflow.python": python, "tensorflow.python.ops": ops, "tensorflow.python.ops.gen_math_ops": gen})


def scaled(n: int, width: float) -> int:
    return max(2, round(n * width))  # edgefl.models.cnn._scaled


def run_authors(args, ds, parts_by_model: dict[int, np.ndarray], test_idx: np.ndarray) -> dict:
    x_train = (ds.x_train.squeeze(1) * 255).round().to(torch.uint8).numpy()
    x_test = (ds.x_test[test_idx].squeeze(1) * 255).round().to(torch.uint8).numpy()
    y_train, y_test = ds.y_train.numpy(), ds.y_test[test_idx].numpy()
    install_tensorflow_shim(((x_train, y_train), (x_test, y_test)), args.seed)
    import keras
    import matplotlib

    matplotlib.use("Agg")
    authors = str(Path(args.authors_dir).resolve())
    iterations = args.iterations
    if int(iterations * NUM_CLIENTS * 0.1) != iterations:  # their loop runs int(epoch * clients * ratio) iterations
        sys.exit(f"--iterations {iterations}: the authors' int({iterations} * 10 * 0.1) rounds it off; pick another")
    argv = ["main.py", "--GPU_num", "0", "--clients_number", str(NUM_CLIENTS), "--clients_sample_ratio", "0.1",
            "--epoch", str(iterations), "--learning_rate", "0.001", "--decay_rate", "1", "--batch_size", "50",
            "--clients_training_epoch", "3", "--alpha", "1", "--num_classes", "10", "--dataset", "mnist"]  # run_mnist.sh
    saved_argv, saved_cwd, saved_path = sys.argv, os.getcwd(), list(sys.path)
    work = tempfile.mkdtemp(prefix="authors-fedhe-")
    sys.argv, sys.path[:0] = argv, [authors]
    os.chdir(work)  # their run() writes txt_result/ and pic/ into the working directory
    try:
        import main as authors_main  # parses argv (parameters.py), imports their modules
        from modules import Client as client_mod
        from modules import Dataset as dataset_mod
        from modules import Server as server_mod

        for name in ("main", "modules"):
            where = getattr(sys.modules[name], "__file__", None) or list(sys.modules[name].__path__)[0]
            assert str(where).startswith(authors), f"{name} was imported from {where}, not from --authors-dir"

        # edgefl's split instead of ten contiguous slices; their normalisation has already run on the whole set
        def edgefl_split(self, x_data, y_data, count):
            assert count == NUM_CLIENTS and len(x_data) == len(x_train)
            return [dataset_mod.BatchGenerator(x_data[parts_by_model[k]], y_data[parts_by_model[k]]) for k in range(count)]

        dataset_mod.Dataset.splited_batch = edgefl_split

        two, three = client_mod.ClientModel_2CNN, client_mod.ClientModel
        w = args.width
        client_mod.ClientModel_2CNN = lambda shape, classes, layer1=128, layer2=256, dropout_rate=0.2: two(
            shape, classes, layer1=scaled(layer1, w), layer2=scaled(layer2, w), dropout_rate=dropout_rate)
        client_mod.ClientModel = lambda shape, classes, layer1=128, layer2=192, layer3=256, dropout_rate=0.2: three(
            shape, classes, layer1=scaled(layer1, w), layer2=scaled(layer2, w), layer3=scaled(layer3, w), dropout_rate=dropout_rate)

        train_step = client_mod.Client.train_step

        def detached_train_step(self, x, y, logit_vectors=None, distillation=False):
            predictions = train_step(self, x, y, logit_vectors, distillation)
            return predictions.detach().cpu().numpy().view(_TFArray)

        client_mod.Client.train_step = detached_train_step

        held: dict = {}
        run = server_mod.Server.run

        def run_and_keep(self):
            held["server"] = self
            log(f"authors: {iterations} iterations (one client each, 3 batches of 50); tqdm's bar follows")
            return run(self)

        server_mod.Server.run = run_and_keep
        try:
            authors_main.main()
        except KeyError as exc:  # Client.py:133 looks every label up in the server's logits, with no mask
            sys.exit(f"the authors' code stopped: class {exc} had no server logits when distillation began "
                     "(their client has no mask for it; a skewed split can do this)")
        server = held["server"]
        own_curve = np.atleast_1d(np.loadtxt(glob.glob("txt_result/**/evaluate_acc.txt", recursive=True)[0]))
        # the common evaluator: every client's final model, inference mode, the same test images (their normalisation)
        x_eval, y_eval = server.dataset_server.test.x, server.dataset_server.test.y.argmax(1)
        per_client = {}
        for cid, client in server.clients_dict.items():
            preds = np.concatenate([keras.ops.convert_to_numpy(client.model(x_eval[i:i + 500], training=False)).argmax(1)
                                    for i in range(0, len(y_eval), 500)])
            per_client[f"fedhe-cnn-{cid}"] = float((preds == y_eval).mean())
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
    curve = [(1 + EVAL_EVERY * i, float(a)) for i, a in enumerate(own_curve)]  # evaluated after iterations 1, 101, ...
    return {"own": float(own_curve[-1]), "common": float(np.mean(list(per_client.values()))), "per_client": per_client,
            "curve": curve, "work_dir": work}


# --- the comparison ----------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--authors-dir", type=users_path, help="a checkout of github.com/ChanYunHin/FedHe (not needed with --no-authors)")
    p.add_argument("--iterations", type=int, default=501, help="server updates = client trainings (authors: --epoch); "
                                                                "100k+1 ends on one of their evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partition", choices=("iid", "dirichlet"), default="iid",
                   help="edgefl's split, given to both (the authors' code itself only has ten contiguous slices)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (--partition dirichlet)")
    p.add_argument("--width", type=float, default=0.25, help="filter scale of the ten CNNs on both sides (paper: 1)")
    p.add_argument("--test-samples", type=int, default=2500, help="a multiple of 2500: the authors evaluate in batches of "
                                                                  "batch_size**2 and average nothing when there are fewer")
    p.add_argument("--samples-per-client", type=int, default=None, help="edgefl's data.samples_per_client (both sides)")
    p.add_argument("--variants", default="", help=f"extra edgefl runs, comma-separated: {', '.join(VARIANTS)} (each is one "
                                                  "change from 'aligned' toward the authors' code, 'preset' the preset's defaults)")
    p.add_argument("--no-authors", action="store_true", help="skip the authors' run (edgefl runs only, e.g. more variants)")
    p.add_argument("--no-aligned", action="store_true", help="skip edgefl's aligned run (variants only)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    if not args.no_authors:  # said before any training, not after the edgefl side's minutes
        if args.authors_dir is None:
            p.error("--authors-dir is needed for the authors' run (git clone https://github.com/ChanYunHin/FedHe), "
                    "or --no-authors for edgefl's runs only")
        if problem := checkout_problem(args.authors_dir.resolve(), AUTHORS_FILES, "ChanYunHin/FedHe"):
            p.error(problem)
        if importlib.util.find_spec("keras") is None:
            p.error("the authors' FedHe needs Keras 3 here (pip install keras; TensorFlow is replaced by Keras on PyTorch), "
                    "or --no-authors for edgefl's runs only")
    if args.test_samples % 2500 or not 2500 <= args.test_samples <= 10000:
        p.error("--test-samples must be 2500, 5000, 7500 or 10000")
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}: {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    ds = load("fashion-mnist")

    aligned = edgefl_config(args, **ALIGNED)
    parts = build_run(validate_config(aligned, "authors_fedhe config"), ds)
    by_model = {int(s.model.rsplit("-", 1)[1]): np.asarray(s.sample_indices) for s in parts.slots}
    test_idx = np.sort(np.random.default_rng(0).choice(len(ds.y_test), args.test_samples, replace=False))
    if args.test_samples < len(ds.y_test):  # edgefl.build.test_subset's subset, given to the authors too
        assert torch.equal(ds.y_test[test_idx], parts.y_test), "edgefl's test subset is not the one rebuilt here"
    else:
        test_idx = np.arange(len(ds.y_test))
    sizes = [len(by_model[k]) for k in range(NUM_CLIENTS)]
    log(f"split {args.partition}: samples per client {sizes}; test images {len(test_idx)}")

    results: dict = {}
    if not args.no_authors:
        t0 = time.perf_counter()
        results["authors"] = run_authors(args, ds, by_model, test_idx)
        results["authors"]["seconds"] = round(time.perf_counter() - t0)
        log(f"authors' code: {results['authors']['own']:.4f} (their evaluator), {results['authors']['common']:.4f} (common)")
        torch.set_num_threads(args.threads)
    runs = [("aligned", aligned, None, (), None)] if not args.no_aligned else []
    runs += [(v, edgefl_config(args, **VARIANTS[v][0]), *VARIANTS[v][1:]) for v in variants]
    for label, raw, change, tweaks, transform in runs:
        t0 = time.perf_counter()
        raw = change(raw) if change else raw
        results[f"edgefl {label}"] = run_edgefl(raw, transform(ds) if transform else ds, label, tweaks)
        results[f"edgefl {label}"]["seconds"] = round(time.perf_counter() - t0)
        log(f"edgefl {label}: {results[f'edgefl {label}']['own']:.4f} (own), {results[f'edgefl {label}']['common']:.4f} (common)")

    setting = f"Fashion-MNIST {args.partition}, {args.iterations} iterations, seed {args.seed}, width {args.width}"
    cols = list(results)
    print(f"\n{setting}\n| setting | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    print("| mean device accuracy, own evaluator | " + " | ".join(f"{100 * results[c]['own']:.2f}" for c in cols) + " |")
    print("| mean device accuracy, common evaluator | " + " | ".join(f"{100 * results[c]['common']:.2f}" for c in cols) + " |")
    for k in range(NUM_CLIENTS):
        name = f"fedhe-cnn-{k}"
        print(f"| {name} | " + " | ".join(f"{100 * results[c]['per_client'][name]:.2f}" for c in cols) + " |")
    print("| seconds | " + " | ".join(str(results[c]["seconds"]) for c in cols) + " |")
    name = "authors_fedhe" + (f"-{args.tag}" if args.tag else "")
    path = save(name, {"setting": setting, "args": {k: str(v) for k, v in vars(args).items()}, "split_sizes": sizes,
                       "edgefl_aligned_options": ALIGNED, "results": results})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
