"""A phone-runtime device (issue 37): what a phone app does, in Python, with only what a phone has.

It trains with an ExecuTorch training program (``edgefl export --format executorch-train``:
NAME.train.pte and its sidecar NAME.train.pte.json) in ExecuTorch's runtime, through the runtime's
Python bindings standing in for the Kotlin/Swift ones (``TrainingModule``, ``SGD``), talks MQTT
with paho-mqtt (Eclipse Paho for Android, CocoaMQTT or HiveMQ on iOS), and speaks the wire
protocol (docs/PROTOCOL.md) with edgefl's envelope and message codec, which are pure wire code
(an app re-implements them from the document, as tests/foreign_device/device.js does). No PyTorch
training code and no edgefl model or training code: ``torch`` is imported only because the
runtime's Python bindings hand tensors over as torch tensors (a phone app gets ``Tensor`` objects
of ExecuTorch's own Java/Swift API instead); ``--report`` writes the edgefl modules the process
imported, which the fleet test checks.

Methods: FedAvg (download ``weights``, upload ``weights``; NAME.train.pte) and FedHe (download and
upload ``class_logits``; NAME.fedhe.train.pte, whose loss holds FedHe's distillation term with
``logit_loss = "mse"``, the method's default: a run with ``logit_loss = "kl"`` needs another
program and is not served by this one; ``--alpha``, ``--warmup-rounds`` and ``--count-offset``
must match the run's method options, which the protocol does not carry). Not implemented here: chunked
transfers (section 5; the exportable models' weights are far below the 512 KiB threshold: the
program refuses larger uploads with the reason), signed server messages are accepted unchecked,
evaluation requests (``evaluate``) and stages are ignored.

    python examples/phone_device.py --broker mqtt://127.0.0.1:1883 --federation fed --device-id client-2 \\
        --program mlp.train.pte --data client-2.npz --lr 0.05 --epochs 1
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgefl.messages import Message, decode, encode
from edgefl.transport.envelope import Envelope, pack, tensor_manifest, unpack

MAX_BYTES = 256 << 20
MAX_ROUNDS = 1_000_000  # a round announcement's ``rounds`` beyond this is not believed
CHUNK_THRESHOLD = 512 << 10
ACK_TIMEOUT_S, ACK_TIMEOUT_MAX_S = 10.0, 120.0


def round_rate(lr: float, round_no: int, rounds: int | None, milestones: tuple[float, ...], gamma: float) -> float:
    """The rate round ``round_no`` of ``rounds`` trains at under the run's ``train.lr_milestones`` and
    ``train.lr_gamma`` (docs/config.md): ``lr x gamma ^ #{m : round_no > floor(m x rounds)}``, torch's
    MultiStepLR over rounds. Written here because the phone has no edgefl config code."""
    if not milestones or rounds is None:
        return lr
    return lr * gamma ** sum(1 for m in milestones if round_no > int(m * rounds))


class PhoneTrainer:
    """The training program in ExecuTorch's runtime: forward-backward in the program, SGD in the runtime."""

    def __init__(self, program: Path) -> None:
        from executorch.extension.training import _load_for_executorch_for_training

        self.meta = json.loads(Path(str(program) + ".json").read_text())
        if self.meta.get("program") not in ("training", "training-fedhe"):
            raise SystemExit(f"{program}: not an ExecuTorch training program (its sidecar says {self.meta.get('program')!r})")
        self.module = _load_for_executorch_for_training(str(program))
        self.batch = int(self.meta["inputs_spec"][0]["shape"][0])
        self.x_shape = tuple(self.meta["inputs_spec"][0]["shape"][1:])
        self.distill = self.meta["program"] == "training-fedhe"  # inputs (x, y, teacher, has, alpha)
        self.num_classes = len(self.meta["class_labels"])
        self.order = self.meta["parameters_order"]  # program name -> state dict name
        self.params: dict[str, object] | None = None  # the runtime's own parameter tensors (known after a first pass)

    def _pass(self, x: np.ndarray, y: np.ndarray, teacher: np.ndarray | None = None, has: np.ndarray | None = None,
              alpha: float = 0.0) -> tuple[float, np.ndarray]:
        import torch  # the bindings' tensor type only

        inputs = [torch.from_numpy(x), torch.from_numpy(y)]
        if self.distill:
            b = len(x)
            teacher = np.zeros((b, self.num_classes), np.float32) if teacher is None else teacher
            has = np.zeros(b, np.float32) if has is None else has
            inputs += [torch.from_numpy(np.ascontiguousarray(teacher, np.float32)), torch.from_numpy(np.ascontiguousarray(has, np.float32)),
                       torch.tensor([alpha], dtype=torch.float32)]
        loss, logits = self.module.forward_backward("forward", tuple(inputs))
        if self.params is None:
            self.params = self.module.named_parameters()
        return float(loss), logits.numpy()

    def _ensure_params(self, x: np.ndarray, y: np.ndarray) -> None:
        if self.params is None:  # the bindings learn the parameters from a first pass (no step taken)
            self._pass(x[: self.batch], y[: self.batch])

    def load(self, weights: dict[str, np.ndarray]) -> None:
        """Write the downloaded state dict into the program's parameters, in place."""
        import torch

        for p in self.order:
            got = weights.get(p["state_dict_name"])
            if got is None or list(got.shape) != p["shape"]:
                raise ValueError(f"the download has no {p['state_dict_name']} of shape {p['shape']}")
            self.params[p["program_name"]].copy_(torch.from_numpy(np.ascontiguousarray(got, dtype=np.float32)))

    def weights(self) -> dict[str, np.ndarray]:
        return {p["state_dict_name"]: self.params[p["program_name"]].detach().clone().numpy() for p in self.order}

    def batches(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator | None):
        """Fixed-size batches (the program's shapes are fixed): the last one is filled from the start."""
        order = rng.permutation(len(x)) if rng is not None else np.arange(len(x))
        for start in range(0, len(x), self.batch):
            idx = order[start : start + self.batch]
            real = len(idx)
            if real < self.batch:
                idx = np.concatenate([idx, np.resize(order, self.batch - real)])
            yield np.ascontiguousarray(x[idx], dtype=np.float32), np.ascontiguousarray(y[idx], dtype=np.int64), real

    def train(self, x: np.ndarray, y: np.ndarray, epochs: int, lr: float, momentum: float, seed: int,
              server: tuple[np.ndarray, np.ndarray] | None = None, alpha: float = 0.0) -> tuple[float, np.ndarray, np.ndarray]:
        """SGD over the local data; returns the mean loss and, per class, the sum of the training
        logits of its real samples (padding excluded) and their count, every epoch counted (FedHe)."""
        from executorch.extension.training import get_sgd_optimizer

        self._ensure_params(x, y)
        sgd = get_sgd_optimizer(self.params, lr, momentum, 0.0, 0.0, False)  # a new optimizer each round
        rng, losses = np.random.default_rng(seed), []
        sums, counts = np.zeros((self.num_classes, self.num_classes)), np.zeros(self.num_classes, np.int64)
        for _ in range(epochs):
            for xb, yb, real in self.batches(x, y, rng):
                teacher = has = None
                if server is not None:
                    teacher, has = server[0][yb], server[1][yb].astype(np.float32)
                loss, logits = self._pass(xb, yb, teacher, has, alpha)
                sgd.step(self.module.named_gradients())
                losses.append(loss)
                np.add.at(sums, yb[:real], logits[:real])
                np.add.at(counts, yb[:real], 1)
        return float(np.mean(losses)), sums, counts

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        """Test accuracy from the program's logits (a pass without a step)."""
        right = 0
        for xb, yb, real in self.batches(x, y, None):
            _, logits = self._pass(xb, yb)
            right += int((logits[:real].argmax(1) == yb[:real]).sum())
        return right / len(x)


class PhoneDevice:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.fed, self.id = args, args.federation, args.device_id
        base = f"edgefl/v1/{self.fed}"
        self.t_round, self.t_down, self.t_up, self.t_presence = f"{base}/round", f"{base}/dev/{self.id}/down", \
            f"{base}/dev/{self.id}/up", f"{base}/presence/{self.id}"
        data = np.load(args.data, allow_pickle=False)
        self.x, self.y = data["x_train"].astype(np.float32), data["y_train"].astype(np.int64)
        self.x_test = data["x_test"].astype(np.float32) if "x_test" in data.files else None
        self.y_test = data["y_test"].astype(np.int64) if "y_test" in data.files else None
        self.trainer = PhoneTrainer(Path(args.program))
        self.inbox: queue.Queue = queue.Queue()
        self.served: dict[int, list[bytes]] = {}  # round -> the upload's packed envelope (a repeat gets the same bytes)
        self.pending: dict[str, tuple[bytes, float, float]] = {}  # upload id -> (bytes, resend at, wait)
        self.run_id: str | None = None
        self.rounds_total: int | None = None  # the run's length (round announcements say it): where milestones fall
        self.rounds_served: list[int] = []
        self.rates: dict[int, float] = {}  # round -> the learning rate it trained at
        self.acks: dict[int, str] = {}

    # --- MQTT (section 1) -----------------------------------------------------------------------
    def connect(self) -> None:
        url = urlparse(self.args.broker)
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgefl-{self.fed}-{self.id}", protocol=mqtt.MQTTv5)
        c.will_set(self.t_presence, b"offline", qos=1, retain=True)
        c.on_message = lambda _c, _u, msg: self.inbox.put((msg.topic, bytes(msg.payload), msg.retain))  # never block here

        def on_connect(client, _u, _flags, rc, _props=None):
            client.subscribe([(self.t_down, 1), (self.t_round, 1)])
            client.publish(self.t_presence, b"online", qos=1, retain=True)

        c.on_connect = on_connect
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        c.reconnect_delay_set(1, 30)
        c.connect(url.hostname, url.port or 1883, keepalive=30, clean_start=False, properties=props)
        c.loop_start()
        self.client = c

    def publish(self, data: bytes) -> None:
        self.client.publish(self.t_up, data, qos=1, retain=False)

    # --- the protocol (section 6) --------------------------------------------------------------
    def run(self) -> int:
        self.connect()
        end = time.monotonic() + self.args.timeout
        try:
            while time.monotonic() < end:
                self.resend_due()
                try:
                    topic, payload, retain = self.inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                try:
                    env = unpack(payload, MAX_BYTES)
                except Exception as exc:
                    print(f"[{self.id}] ignored a message on {topic}: {exc}", file=sys.stderr)
                    continue
                if env.sender != "server" or env.federation != self.fed:
                    continue
                if topic == self.t_round and self.round_over(env):
                    return 0
                if topic == self.t_down:
                    self.on_down(env)
            print(f"[{self.id}] timed out after {self.args.timeout} s", file=sys.stderr)
            return 2
        finally:
            self.client.publish(self.t_presence, b"offline", qos=1, retain=True).wait_for_publish(5)
            self.client.disconnect()
            self.client.loop_stop()

    def round_over(self, env: Envelope) -> bool:
        info = env.extra.get("info", {})
        total = info.get("rounds")
        if isinstance(total, int) and not isinstance(total, bool) and 1 <= total <= MAX_ROUNDS:
            self.rounds_total = total
        if not info.get("done"):
            self.run_id = info.get("run", self.run_id)
            return False
        return self.run_id is not None and info.get("run") == self.run_id  # an earlier run's retained end is not ours

    def on_down(self, env: Envelope) -> None:
        if env.type == "download":
            self.run_id = env.extra.get("info", {}).get("run", self.run_id)
            if env.round in self.served:  # a repeated download: the same upload again
                for data in self.served[env.round]:
                    self.publish(data)
                return
            self.serve(env)
        elif env.type in ("ack", "nack") and env.reply_to in self.pending:
            if env.type == "nack" and env.extra.get("missing"):
                return  # chunk recovery: this program sends no chunks
            self.pending.pop(env.reply_to)
            self.acks[env.round] = env.extra.get("status", "nack: " + env.extra.get("reason", ""))
            print(f"[{self.id}] round {env.round}: {env.type} {self.acks[env.round]}", file=sys.stderr)

    def serve(self, env: Envelope) -> None:
        if env.codec != "safetensors":
            print(f"[{self.id}] round {env.round}: codec {env.codec} (nothing to train from): not served", file=sys.stderr)
            return
        msg = decode(env.body)
        import torch  # the codec's tensor type

        t0 = time.perf_counter()
        seed = self.args.seed + env.round
        if self.args.lr_milestones and self.rounds_total is None:
            print(f"[{self.id}] round {env.round}: no round announcement has said the run's length yet: "
                  f"training at --lr {self.args.lr}, without the schedule", file=sys.stderr)
        lr = round_rate(self.args.lr, env.round, self.rounds_total, self.args.lr_milestones, self.args.lr_gamma)
        if msg.kind == "weights":  # FedAvg: start from the global weights, send the trained ones
            down = {k: v.numpy() for k, v in msg.tensors.items()}
            self.trainer._ensure_params(self.x, self.y)
            self.trainer.load(down)
            loss, _, _ = self.trainer.train(self.x, self.y, self.args.epochs, lr, self.args.momentum, seed)
            trained = self.trainer.weights()
            tensors = {k: (torch.from_numpy(trained[k]) if k in trained else msg.tensors[k]) for k in msg.tensors}  # buffers echoed
            kind = "weights"
        elif msg.kind == "class_logits" and self.trainer.distill:  # FedHe: own model, distilled toward the class logits
            server = None
            if "logits" in msg.tensors and env.round > self.args.warmup_rounds and self.args.alpha != 0:
                server = (msg.tensors["logits"].numpy(), msg.tensors["mask"].numpy().astype(bool))
            loss, sums, counts = self.trainer.train(self.x, self.y, self.args.epochs, lr, self.args.momentum, seed,
                                                    server, self.args.alpha)
            seen = np.flatnonzero(counts)
            tensors = {"logits": torch.from_numpy((sums[seen] / (counts[seen] + self.args.count_offset)[:, None]).astype(np.float32)),
                       "classes": torch.from_numpy(seen.astype(np.int64)), "counts": torch.from_numpy(counts[seen].astype(np.int64))}
            kind = "class_logits"
        else:
            print(f"[{self.id}] round {env.round}: a {msg.kind!r} download that program {self.args.program} cannot serve",
                  file=sys.stderr)
            return
        meta = {"num_samples": int(len(self.x)), "train_loss": loss}
        if kind == "weights":
            meta["arch"] = msg.meta.get("arch", "")[:64]
        if env.extra.get("info", {}).get("evaluate") and self.x_test is not None:
            meta["eval_accuracy"] = self.trainer.accuracy(self.x_test, self.y_test)
        up = Message(kind, env.round, self.id, tensors, meta)
        data = pack(Envelope("upload", self.fed, env.round, self.id, encode(up), message_id=up.message_id,
                             model_version=env.model_version, codec="safetensors", extra={"tensors": tensor_manifest(tensors)}))
        if len(data) > CHUNK_THRESHOLD:
            raise SystemExit(f"an upload of {len(data)} bytes needs chunked transfer (PROTOCOL.md section 5), "
                             "which this phone program does not implement")
        self.served[env.round] = [data]
        self.pending[up.message_id] = (data, time.monotonic() + ACK_TIMEOUT_S, ACK_TIMEOUT_S)
        self.rounds_served.append(env.round)
        self.rates[env.round] = lr
        print(f"[{self.id}] round {env.round}: trained {len(self.x)} samples in {time.perf_counter() - t0:.2f} s, "
              f"loss {loss:.4f}, lr {lr:.3g}", file=sys.stderr)
        self.publish(data)

    def resend_due(self) -> None:
        now = time.monotonic()
        for mid, (data, at, wait) in list(self.pending.items()):
            if now >= at:  # no answer: the same bytes again, the wait doubled (section 6.3)
                self.publish(data)
                wait = min(2 * wait, ACK_TIMEOUT_MAX_S)
                self.pending[mid] = (data, now + wait, wait)


def _milestones(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated fractions of the run, e.g. 0.5 or 0.5,0.75") from None
    if not all(0 < v < 1 for v in values) or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"{text!r}: increasing fractions strictly between 0 and 1, as train.lr_milestones")
    return values


def _gamma(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a factor above 0 and at most 1, as train.lr_gamma")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--broker", required=True, help="mqtt://HOST:PORT")
    p.add_argument("--federation", required=True)
    p.add_argument("--device-id", required=True)
    p.add_argument("--program", required=True, help="NAME.train.pte (its sidecar NAME.train.pte.json beside it)")
    p.add_argument("--data", required=True, help=".npz with x_train, y_train (and x_test, y_test), the model's input already scaled")
    p.add_argument("--lr", type=float, default=None, help="default: the sidecar's")
    p.add_argument("--momentum", type=float, default=None, help="default: the sidecar's")
    p.add_argument("--lr-milestones", type=_milestones, default=(),
                   help="the run's train.lr_milestones, comma-separated fractions of the run (e.g. 0.5): the rate drops "
                        "by --lr-gamma after each (the protocol does not carry the run's training settings to a device "
                        "that holds no task)")
    p.add_argument("--lr-gamma", type=_gamma, default=None, help="the run's train.lr_gamma (default 0.1; only with --lr-milestones)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--alpha", type=float, default=1.0, help="FedHe: weight of the logit loss (method.alpha)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="FedHe: rounds of cross-entropy only (method.warmup_rounds)")
    p.add_argument("--count-offset", type=int, default=1, choices=(0, 1),
                   help="FedHe: Eq. 8's +1, per-class logits sent as sum / (count + offset) (method.count_offset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--report", default=None, help="write a JSON report (rounds served, acks, edgefl modules imported)")
    args = p.parse_args(argv)
    if args.lr_gamma is not None and not args.lr_milestones:
        p.error("--lr-gamma scales nothing without --lr-milestones (give the run's train.lr_milestones, or drop --lr-gamma)")
    args.lr_gamma = 0.1 if args.lr_gamma is None else args.lr_gamma
    for flag, path in (("--data", args.data), ("--program", args.program), ("--program's sidecar", args.program + ".json")):
        if not Path(path).is_file():
            p.error(f"{flag} {path}: no such file")
    device = PhoneDevice(args)
    opt = device.trainer.meta["optimizer"]
    args.lr = opt["lr"] if args.lr is None else args.lr
    args.momentum = opt["momentum"] if args.momentum is None else args.momentum
    rc = device.run()
    if args.report:
        Path(args.report).write_text(json.dumps({
            "rounds_served": device.rounds_served, "acks": device.acks, "lr": device.rates,
            "edgefl_modules": sorted(m for m in sys.modules if m == "edgefl" or m.startswith("edgefl."))}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
