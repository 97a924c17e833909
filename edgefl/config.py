"""Run configuration: TOML -> validated, typed objects.

Unknown keys, wrong types and unknown model or method names are errors that name the key and
suggest the nearest valid one. ``apply_overrides`` implements ``--set key=value``.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli_w
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from edgefl.configtools import format_validation_error, read_toml, suggest
from edgefl.data.views import ViewSettings
from edgefl.errors import ConfigError
from edgefl.methods import get_method

log = logging.getLogger("edgefl.config")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _no_float(value: Any) -> Any:
    if isinstance(value, float):  # lax pydantic would take 3.0 and 1e9 (a billion rounds) as integers
        raise ValueError(f"must be a whole number written without a decimal point or exponent (got {value!r}: TOML reads "
                         "3.0 and 1e9 as floats)")
    return value


#: counts and sizes: an integer in the file, never a float that happens to be whole, a bool or a string
Whole = Annotated[StrictInt, BeforeValidator(_no_float)]
MAX_ROUNDS = 1_000_000


class DPSGDSettings(Strict):
    """Sample-level differential privacy of local training: DP-SGD through Opacus (per-sample
    gradients clipped to ``max_grad_norm``, Gaussian noise of ``noise_multiplier`` x ``max_grad_norm``
    added to their sum, batches drawn by Poisson sampling at rate batch_size / samples). Each upload
    carries the device's epsilon so far (meta ``dp_sgd_epsilon``); docs/privacy.md."""

    noise_multiplier: float | None = Field(
        None, ge=0, le=1000, description="noise std / max_grad_norm (0: clipping only, no privacy); unset: derived from target_epsilon")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="each sample's gradient is clipped to this L2 norm")
    target_epsilon: float | None = Field(
        None, gt=0, le=1e6, description="derive each device's noise multiplier so that rounds x its local steps stay within this "
                                        "epsilon (instead of noise_multiplier; sync runs only)")
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta of the (epsilon, delta) guarantee (keep it below 1 / samples)")
    poisson: bool = Field(True, description="draw each batch by Poisson sampling, which the accountant assumes (false: shuffled "
                                            "fixed-size batches as plain training; the epsilon is then the usual approximation)")

    @model_validator(mode="after")
    def _one_noise(self) -> DPSGDSettings:
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("DP-SGD needs noise_multiplier or target_epsilon (e.g. noise_multiplier = 1.0)")
        if self.noise_multiplier is not None and self.target_epsilon is not None:
            raise ValueError("give noise_multiplier or target_epsilon, not both (target_epsilon derives the noise multiplier)")
        return self


#: at most this many learning-rate drops (train.lr_milestones)
MAX_LR_MILESTONES = 16


def _check_milestones(milestones: list[float] | None) -> list[float] | None:
    if milestones is None:
        return None
    for m in milestones:
        if not (isinstance(m, (int, float)) and math.isfinite(m) and 0 < m < 1):
            raise ValueError(f"lr_milestones holds {m!r}: each is a fraction of the run, above 0 and below 1 "
                             "(0.5 drops the learning rate at half the run)")
    if any(b <= a for a, b in zip(milestones, milestones[1:])):
        raise ValueError(f"lr_milestones = {milestones}: list them in increasing order, each once")
    return [float(m) for m in milestones]


class TrainSettings(Strict):
    """Local training of one client per round."""

    epochs: Whole = Field(1, ge=1, description="local epochs per round")
    batch_size: Whole = Field(50, ge=1, description="local mini-batch size")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="the local optimizer")
    optimizer_state: Literal["per_round", "kept"] = Field(
        "per_round", description="per_round: a new optimizer every round (its moments start from zero); kept: each device keeps one "
                                 "optimizer, moments and step count, for the whole run, as the FedHe authors' code does (saved "
                                 "with the device's state)")
    lr: float = Field(1e-3, gt=0, description="learning rate")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd only")
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty of the optimizer")
    lr_milestones: list[float] = Field(
        [], max_length=MAX_LR_MILESTONES,
        description="fractions of the run (rounds; server updates with mode = \"async\") after which the learning rate is multiplied by lr_gamma, as torch's "
                    "MultiStepLR over rounds: [0.5] drops it at half the run, as the Felo/Velo authors' code does on "
                    "Fashion-MNIST ([0.4, 0.7] on CIFAR-10); each above 0 and below 1, in increasing order, and each "
                    "after a round of its own (round r trains at lr x lr_gamma ^ the milestones m with r > floor(m x "
                    "rounds)); each round's record and progress line say the rate (lr); empty: one learning rate for "
                    "the whole run")
    lr_gamma: float = Field(0.1, gt=0, le=1, description="the learning rate's factor at each of lr_milestones (set only with them)")
    max_steps: Whole | None = Field(None, ge=1, description="cap on batches per round (None: full epochs)")
    dp_sgd: DPSGDSettings | None = Field(None, description="train with DP-SGD ([train.dp_sgd]; unset: plain training)")

    @field_validator("lr_milestones")
    @classmethod
    def _milestones_in_order(cls, v: list[float]) -> list[float]:
        return _check_milestones(v)

    def lr_at(self, round_no: int, total_rounds: int) -> float:
        """The learning rate round ``round_no`` (from 1) of ``total_rounds`` trains with: ``lr``
        times ``lr_gamma`` for each milestone the run has passed (round r trains with the rate
        MultiStepLR gives after r - 1 steps, with milestones at int(fraction x total_rounds))."""
        passed = sum(1 for m in self.lr_milestones if round_no > int(m * max(total_rounds, 1)))
        return self.lr * self.lr_gamma ** passed

    def for_round(self, round_no: int, total_rounds: int) -> TrainSettings:
        """These settings with the learning rate of ``round_no`` (themselves when it is ``lr``)."""
        lr = self.lr_at(round_no, total_rounds)
        return self if lr == self.lr else self.model_copy(update={"lr": lr})

    @model_serializer(mode="wrap")
    def _without_plain_dp_sgd(self, handler) -> dict[str, Any]:
        # plain training writes no dp_sgd key (a new optimizer each round no optimizer_state key, one learning rate
        # no schedule keys): run.json, tasks, the protocol's examples and saved runs' config digests stay as they
        # were, and a device whose edgefl predates them still takes the task
        out = handler(self)
        if isinstance(out, dict) and out.get("dp_sgd", 0) is None:
            del out["dp_sgd"]
        if isinstance(out, dict) and out.get("optimizer_state") == "per_round":
            del out["optimizer_state"]
        if isinstance(out, dict) and not out.get("lr_milestones", True):
            out.pop("lr_milestones")
            out.pop("lr_gamma", None)
        return out


class TrainOverride(Strict):
    """Per-group overrides of :class:`TrainSettings` (unset fields keep the run's value)."""

    epochs: Whole | None = Field(None, ge=1)
    batch_size: Whole | None = Field(None, ge=1)
    optimizer: Literal["adam", "sgd"] | None = None
    lr: float | None = Field(None, gt=0)
    momentum: float | None = Field(None, ge=0, lt=1)
    weight_decay: float | None = Field(None, ge=0)
    lr_milestones: list[float] | None = Field(None, max_length=MAX_LR_MILESTONES,
                                              description="this group's schedule in place of the run's ([] : none)")
    lr_gamma: float | None = Field(None, gt=0, le=1)
    max_steps: Whole | None = Field(None, ge=1)
    dp_sgd: DPSGDSettings | None = Field(None, description="the group's whole DP-SGD table, in place of the run's train.dp_sgd")

    @field_validator("lr_milestones")
    @classmethod
    def _milestones_in_order(cls, v: list[float] | None) -> list[float] | None:
        return _check_milestones(v)


class DataSettings(Strict):
    dataset: str = Field("fashion-mnist", description='fashion-mnist, mnist, digits, breast-cancer, or "idx" (your own IDX files)')
    data_dir: str | None = Field(None, description="the folder holding the IDX files (--data-dir); when set, the only place looked in")
    download: bool = Field(True, description="fetch fashion-mnist/mnist into the user cache when no folder has them")
    idx_name: str | None = Field(None, description='dataset = "idx": the name reports give your data set')
    classes: Whole | list[str] | None = Field(None, description='dataset = "idx": the number of classes, or their names in label order')
    partition: Literal["iid", "dirichlet", "shards", "contiguous", "devices"] = Field(
        "dirichlet", description='how training samples are split across simulated devices ("contiguous": the training set cut in file '
                                 'order into equal parts, the FedHe authors\' split); "devices": real devices train on data only '
                                 "they hold (edgefl client --data), the server splits nothing and its data set names the task "
                                 "(classes, input shape, normalisation) and is its own test set (docs/your-data.md)")
    alpha: float = Field(0.5, gt=0, description="dirichlet: concentration (smaller = more skewed labels per device)")
    shards_per_client: Whole = Field(2, ge=1, description="shards: label-sorted shards per device")
    min_samples: Whole = Field(10, ge=1, description="dirichlet: redraw until every device holds at least this many")
    samples_per_client: Whole | None = Field(None, ge=1, description="keep at most this many samples per client")
    test_samples: Whole | None = Field(None, ge=1, description="evaluate on a fixed random subset of the test set")
    client_test_fraction: float | None = Field(
        None, gt=0, lt=1, description="pool train+test, partition, and hold out this share of each device's data as its own test set; "
                                      'with partition = "devices": the share of its own data each device holds out to report accuracy on '
                                      "(default 0.1)"
    )
    resize: bool = Field(True, description='partition = "devices": a device\'s images of another size are resized (true) or refused (false)')
    label_column: str = Field("label", min_length=1, max_length=200,
                              description='partition = "devices": the label column of devices\' CSV or Parquet tables')

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, v: str) -> str:
        from edgefl.data.datasets import DATASET_NAMES

        if v not in DATASET_NAMES:
            raise ValueError(f"unknown dataset {v!r}{suggest(v, DATASET_NAMES)}")
        return v

    @property
    def device_held(self) -> bool:
        """Real devices bring their own data (partition = "devices"): nothing is split here."""
        return self.partition == "devices"

    @property
    def validation_fraction(self) -> float:
        """The share of its own data a device holds out (partition = "devices")."""
        return self.client_test_fraction or 0.1

    @model_validator(mode="after")
    def _reads_files(self) -> DataSettings:
        from edgefl.data.datasets import SKLEARN_SETS

        # partition = "devices": data_dir may be a device's own data (edgefl client --data), not this data set's files
        if self.data_dir is not None and self.dataset in SKLEARN_SETS and self.partition != "devices":
            raise ValueError(f"data_dir = {self.data_dir!r}, but {self.dataset} comes with scikit-learn and reads no files: drop "
                             'data_dir (--data-dir), or name a data set that reads a folder (fashion-mnist, mnist, "idx")')
        return self

    @model_validator(mode="after")
    def _own_idx(self) -> DataSettings:
        if self.dataset == "idx":
            if not self.data_dir or self.classes is None:
                raise ValueError('dataset = "idx" (your own IDX files) needs data_dir and classes (a count or the class names)')
            if isinstance(self.classes, int) and not 2 <= self.classes <= 100_000:
                raise ValueError("classes must be between 2 and 100000")
        elif self.idx_name is not None or self.classes is not None:
            raise ValueError(f'idx_name and classes describe your own data set (dataset = "idx"), not {self.dataset}')
        return self


class GroupSettings(Strict):
    """``count`` devices that train the same architecture (or, with a profile and
    ``model = "auto"``, devices of one class that get the largest model their budgets allow)."""

    model: str = Field(description='a zoo model (edgefl models), or "auto": the largest the group\'s profile can train (needs profile)')
    count: Whole = Field(1, ge=1, description="devices in this group")
    profile: str | None = Field(None, description="device class (catalog id or profile file): virtual clock and assignment")
    options: dict[str, Any] = Field(default_factory=dict, description="builder options, e.g. width")
    train: TrainOverride | None = None
    view: ViewSettings | None = Field(None, description="per-device feature space (CHFL's heterogeneous inputs)")

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        from edgefl.models import model_names

        names = model_names()
        if v != "auto" and v not in names:
            raise ValueError(f"unknown model {v!r}{suggest(v, names)}")
        return v

    @model_validator(mode="after")
    def _known_options(self) -> GroupSettings:
        from edgefl.models import get_spec

        if self.profile is not None:
            from edgefl.profile import load_profile

            load_profile(self.profile)  # a ConfigError naming the profile and the nearest id
        if self.model == "auto":
            if self.profile is None:
                raise ValueError('model = "auto" needs a profile to assign from (e.g. profile = "pi4-4gb")')
            if self.options:
                raise ValueError('model = "auto" takes no options: the assignment chooses them')
            return self

        params = inspect.signature(get_spec(self.model).builder).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            # thin wrappers forward **kw to the family builder: inspect that instead
            params = _family_params(self.model)
        internal = ("num_classes", "input_shape", "return_reference", "index", "depth_name")
        allowed = [p for p in params if p not in internal]
        for key in self.options:
            if key not in allowed:
                raise ValueError(f"model {self.model!r} has no option {key!r}{suggest(key, allowed)}; options: {', '.join(allowed)}")
        return self



def _family_params(model: str) -> dict[str, inspect.Parameter]:
    from edgefl.models import cnn, resnet

    if model.startswith("resnet"):
        return dict(inspect.signature(resnet.build_resnet).parameters)
    if model.startswith("fedhe-cnn"):
        return dict(inspect.signature(cnn.build_fedhe_cnn).parameters)
    return {}


class FleetSettings(Strict):
    groups: list[GroupSettings] = Field(min_length=1)
    sample_ratio: float = Field(1.0, gt=0, le=1, description="share of the devices selected each round")
    per_round: Whole | None = Field(
        None, ge=1, description="target updates per round (cross-device FL): devices are drawn from those online, the round closes as "
                                "soon as this many are accepted, and later uploads are answered late; replaces sample_ratio")
    over_select: float = Field(
        0.0, ge=0, le=10, description="with per_round: select this share more devices than the target, to cover drop-outs "
                                      "(production systems use about 0.3)")

    @model_validator(mode="after")
    def _one_way_to_select(self) -> FleetSettings:
        if self.per_round is not None and self.sample_ratio != 1.0:
            raise ValueError("set either sample_ratio (a share of all devices) or per_round (a target count from those online), not both")
        if self.per_round is None and self.over_select:
            raise ValueError("over_select adds devices beyond per_round's target: set per_round too")
        if self.per_round is not None and self.per_round > self.num_clients:
            raise ValueError(f"per_round = {self.per_round}, but the fleet has only {self.num_clients} devices")
        return self

    @property
    def num_clients(self) -> int:
        return sum(g.count for g in self.groups)

    def selection_size(self, pool: int) -> int:
        """How many of ``pool`` devices a round selects."""
        if self.per_round is None:
            k = math.ceil(self.sample_ratio * pool - 1e-9)
        else:
            k = math.ceil(self.per_round * (1 + self.over_select) - 1e-9)
        return max(1, min(k, pool))

    def target(self, selected: int) -> int:
        """Accepted updates that close a round early: per_round when set, else every selected device."""
        return selected if self.per_round is None else min(self.per_round, selected)


class EvalSettings(Strict):
    every: Whole = Field(1, ge=1, description="evaluate every k rounds (the last round always)")
    batch_size: Whole = Field(1000, ge=1)
    unselected: Literal["ask", "last_reported"] = Field(
        "ask", description="methods judged by their devices (FedHe, Local-only, CHFL), synchronous rounds: at an evaluation round the "
                           "devices not selected for it are asked for their model's accuracy (the record is the mean over "
                           "every device; one still training keeps its last value), or keep the accuracy they last "
                           "reported (none until one trains in an evaluation round)")


class ClockSettings(Strict):
    """The virtual clock of fleets whose groups name device profiles."""

    deadline_s: float = Field(60.0, gt=0, description="round deadline: slower devices are dropped as stragglers")
    headroom: float = Field(0.8, gt=0, le=1, description="share of a device's training budget a round may use")
    candidates: list[str] | None = Field(None, description='models "auto" groups choose from, e.g. ["vgg9", "cvae-small"]')


class NetworkSettings(Strict):
    """How the round loop talks to devices (docs/PROTOCOL.md): deadlines, quorum, chunking and
    limits; a simulation plays the same rules over its in-memory network, in virtual seconds."""

    federation: str | None = Field(None, description="topic prefix of this federation (default: the run name)")
    round_deadline_s: float = Field(120.0, gt=0, description="a round closes at this deadline when not every device reported")
    quorum: float = Field(0.5, gt=0, description="reports needed at the deadline: a fraction (<= 1) of the selected devices or a count (> 1)")
    grace_s: float = Field(0.0, ge=0, description="extend a round that misses its quorum once by this much (0: fail it at once)")
    chunk_bytes: Whole = Field(1 << 20, ge=4096, description="bodies above chunk_threshold travel in chunks of this size")
    chunk_threshold: Whole = Field(512 << 10, ge=1024)
    max_message_bytes: Whole = Field(256 << 20, ge=1 << 16, description="the largest message (whole upload, before chunking) either side accepts")
    ack_timeout_s: float = Field(10.0, gt=0, description="a device resends an upload not acknowledged within this")
    stale_upload_s: float = Field(120.0, gt=0, description="a partial chunked upload idle this long is nacked with its missing chunks "
                                  "(dropped after 3 such nacks without progress)")
    max_partial_bytes_total: Whole = Field(
        1 << 30, ge=1 << 16, description="bytes the server holds for unfinished chunked uploads of all devices together (each device "
                                         "may hold twice max_message_bytes); a chunk that would pass either budget is nacked with the reason")
    partial_max_age_s: float | None = Field(
        None, gt=0, description="a partial chunked upload not complete this long after its first chunk is dropped however its chunks "
                                "trickle in (the device is told to resend every chunk). None: the round deadline (at least stale_upload_s), "
                                "since a partial upload not complete by then cannot count in its round; in an asynchronous run 4 x "
                                "stale_upload_s, as long as the stale nacks keep an abandoned one")
    offline_grace_s: float = Field(10.0, ge=0, description="a round closes early once every selected device that has not reported has been offline this "
                                                                "long, counted from when each went offline (an evaluate request or a "
                                                                "stage stops waiting for them too); a device restarted within it gets "
                                                                "its round again")
    protocol: Literal["5", "3.1.1"] = "5"
    max_abs_value: float = Field(1e6, gt=0, description="uploads holding a larger magnitude are refused (weights, logits, features)")
    keepalive_s: Whole = Field(30, ge=1, description="MQTT keep-alive: a silent device is declared offline (last will) after 1.5x this")

    @field_validator("quorum")
    @classmethod
    def _whole_count(cls, value: float) -> float:
        if value > 1 and value != int(value):
            raise ValueError(f"a quorum above 1 is a number of devices, so a whole number (got {value}); a fraction of the selected devices is <= 1")
        return value

    @model_validator(mode="after")
    def _partials_fit(self) -> NetworkSettings:
        if self.max_partial_bytes_total < self.max_message_bytes:
            raise ValueError(f"network.max_partial_bytes_total = {self.max_partial_bytes_total} is below network.max_message_bytes = "
                             f"{self.max_message_bytes}: a chunked upload of the largest size could never be reassembled; raise it")
        return self

    def partial_age_limit_s(self) -> float:
        """How long a partial chunked upload may live from its first chunk (``partial_max_age_s``
        or its default: as long as an abandoned one survives the stale nacks)."""
        from edgefl.transport.chunks import STALE_STRIKES

        return self.partial_max_age_s if self.partial_max_age_s is not None else (STALE_STRIKES + 1) * self.stale_upload_s

    def quorum_count(self, selected: int) -> int:
        if self.quorum <= 1:
            return max(1, math.ceil(self.quorum * selected - 1e-9))
        return min(selected, int(self.quorum))


class SimulationSettings(Strict):
    """How ``edgefl simulate`` runs the devices' client halves (a fleet's devices run their own;
    docs/benchmarks.md section 15 measures the choice)."""

    batch_clients: Literal["auto", "on", "off"] = Field(
        "auto", description="train the selected clients of one architecture together as one batched computation "
                            "(torch.func.vmap); auto = on CUDA only (on a CPU it measured slower)")
    workers: Whole | Literal["auto"] = Field(
        1, description="processes the client halves are spread over (auto: one per core); 1 = all in this process. "
                       "Every worker trains with the run's threads, so the numbers are those of one process (threads = cores / workers for speed)")
    backend: Literal["local", "ray"] = Field(
        "local", description="local worker processes, or Ray actors (pip install -e '.[ray]' in the edgefl checkout; workers = actors)")
    ray_address: str | None = Field(None, description='backend = "ray": the cluster to join, e.g. "ray://head:10001" (None: start one here)')
    ray_cpus: float = Field(1.0, gt=0, le=1024, description='backend = "ray": CPUs each actor asks for')
    ray_gpus: float = Field(0.0, ge=0, le=64, description='backend = "ray": GPUs (a fraction shares one) each actor asks for')
    checkpoint_every: Whole = Field(
        10, ge=0, le=MAX_ROUNDS, description="save the server's state and every device's (their models and what their method and "
                                             "filters carry) into the run directory every N rounds (asynchronous: every N records, "
                                             "with the work and messages under way) and when the run is stopped, so "
                                             "`edgefl simulate --resume --out RUN_DIR` goes on with the numbers an uninterrupted run "
                                             "gives; 0: never (runs with every device in this process)")
    keep_clients: bool | None = Field(
        None, description="true: one-shot methods save each device's upload and trained state into RUN_DIR/clients, so that other "
                           "server halves (FedMHO, -MD, -SD) can fuse the same clients without training them again "
                           "(simulation.clients_from); a classifier client's files are about twice its weights")
    clients_from: str | None = Field(
        None,
        description="one-shot methods: take every device's upload and trained state from a run that kept them "
                    "(its run directory) instead of training; refused unless its seed, rounds, data, train, fleet and the "
                    "method's client half are this run's (docs/simulation.md, \"Fusing the same clients again\")")
    baseline: Literal["none", "local"] = Field(
        "none", description='"local": after the run, train the Local-only baseline (method local: the same devices, data, seed and '
                            "training, nothing shared) into RUN_DIR/baseline and put it beside the method in the tables, "
                            "summary.json and plots (edgefl simulate only; it doubles the training time)")

    @field_validator("clients_from")
    @classmethod
    def _a_folder(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip() or "\x00" in value or len(value) > 4096:
            raise ValueError("clients_from names the run directory of a run that kept its clients (leave it out to train them)")
        # absolute, so that the run's config.toml means the same folder from wherever it is resumed
        return os.path.abspath(os.path.expanduser(value))

    @model_validator(mode="after")
    def _keep_or_take(self) -> SimulationSettings:
        if self.keep_clients and self.clients_from:
            raise ValueError("keep_clients with clients_from would keep a copy of clients kept already, under this "
                             "run's name: fuse from the folder that trained them and drop keep_clients")
        return self

    @field_validator("workers")
    @classmethod
    def _some_workers(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 1024:
            raise ValueError(f"workers must be between 1 and 1024 (or \"auto\"), got {value}")
        return value

    def worker_count(self, devices: int) -> int:
        """How many hosts the devices are spread over (never more than there are devices)."""
        wanted = (os.cpu_count() or 1) if self.workers == "auto" else self.workers
        return max(1, min(wanted, devices))


class AsyncSettings(Strict):
    """``mode = "async"``: devices train whenever they are free and the server updates on their
    reports (docs/methods.md, "Asynchronous runs"). ``rounds`` counts server updates."""

    concurrency: Whole | None = Field(
        None, ge=1, description="devices training at once (None: every online device); a free device is drawn with the seed")
    aggregation: Literal["fedbuff", "fedasync"] = Field(
        "fedbuff", description="weights: buffered (FedBuff: one update per buffer_size reports, staleness-discounted deltas) "
                               "or FedAsync (each report mixed into the model at a staleness-discounted rate)")
    buffer_size: Whole | None = Field(
        None, ge=1, le=100_000, description="fedbuff: reports per server update (None: 1 for knowledge methods, which merge every "
                                            "report, and min(10, devices // 2) for weight methods)")
    server_lr: float = Field(1.0, gt=0, le=10, description="fedbuff: server learning rate on the mean discounted delta")
    mixing: float = Field(0.6, gt=0, le=1, description="fedasync: the rate a fresh report is mixed in at (alpha)")
    staleness_exponent: float = Field(
        0.5, ge=0, le=10, description="a report s server updates old counts (1 + s) ** -exponent (0: no discount)")
    staleness_bound: Whole | None = Field(
        None, ge=0, description="reports started more than this many server updates ago are refused with the reason (None: no bound)")
    time_budget_s: float | None = Field(
        None, gt=0, description="stop after this many seconds (virtual in a simulation), or after rounds updates, whichever is first")
    eval_every_s: float | None = Field(
        None, gt=0, description="evaluate every this many (virtual) seconds instead of every eval.every server updates")
    device_accuracy: Literal["every_report", "at_records"] = Field(
        "every_report", description="methods judged by their devices: every report carries the device's accuracy (exact, one "
                                    "evaluation per report), or idle devices are asked at each record and busy ones keep their "
                                    "last value (cheaper when few train at once, e.g. concurrency = 1)")


class MethodSettings(BaseModel):
    """``name`` picks the method; the other keys are that method's options, validated by it."""

    model_config = ConfigDict(extra="allow")
    name: str

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class FilterSettings(BaseModel):
    """One ``[[filters]]`` entry: ``name`` picks the filter; the other keys are its options, validated by it."""

    model_config = ConfigDict(extra="allow")
    name: str

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RunConfig(Strict):
    name: str = Field("run", description="names the run directory (runs/<time>-<name>-s<seed>) and, unless network.federation is set, the fleet's topics")
    seed: Whole = Field(0, description="every random draw (partition, initial weights, batch order, selection) derives from it")
    rounds: Whole = Field(10, ge=1, le=MAX_ROUNDS, description="federated rounds (one-shot methods: exactly 1); with mode = \"async\", server updates")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: rounds with a selection and a deadline; async: devices train when free, the server updates on reports "
                            "([asynchronous])")
    threads: Whole | None = Field(None, ge=1, description="torch intra-op threads of every device's training, on every backend "
                                                              "(None: the default of the process that starts the run; run.json records it)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where client halves train (simulated devices and `edgefl client`) and server halves fuse: "
                            "auto = CUDA when torch sees a GPU, else the CPU")
    method: MethodSettings
    data: DataSettings = Field(default_factory=DataSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    fleet: FleetSettings
    eval: EvalSettings = Field(default_factory=EvalSettings)
    clock: ClockSettings = Field(default_factory=ClockSettings)
    network: NetworkSettings = Field(default_factory=NetworkSettings)
    simulation: SimulationSettings = Field(default_factory=SimulationSettings)
    asynchronous: AsyncSettings = Field(default_factory=AsyncSettings)
    filters: list[FilterSettings] = Field(
        default_factory=list, description="the chain every upload and download passes through, in order ([[filters]] name = ... "
                                          "plus the filter's options; docs/filters.md): compression (quantize, topk), privacy")
    export: list[str] = Field(
        default_factory=list, description="formats the run ends with (edgefl export --help lists them: onnx, tflite, micro and any "
                                          "registered); 'int8' adds int8 variants"
    )
    track: list[Literal["tensorboard", "mlflow"]] = Field(
        default_factory=list, description="experiment trackers fed every round (--track): TensorBoard event files in RUN_DIR/tensorboard, "
                                          "MLflow runs (pip install -e '.[track]' in the edgefl checkout)")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI (default: a file store in RUN_DIR/mlruns)")

    @field_validator("export")
    @classmethod
    def _registered_export_formats(cls, names: list[str]) -> list[str]:
        from edgefl.exporters.registry import format_names  # light: no torch, no converter

        known = [*format_names(), "int8"]
        for name in names:
            if name not in known:
                raise ValueError(f"unknown export format {name!r}{suggest(name, known)}; formats: {', '.join(known)}")
        return names

    @model_validator(mode="after")
    def _quorum_reachable(self) -> RunConfig:
        q = self.network.quorum
        selected = self.fleet.target(self.fleet.selection_size(self.fleet.num_clients))
        if q > 1 and q > selected:
            how = (f"per_round = {self.fleet.per_round}" if self.fleet.per_round is not None
                   else f"{self.fleet.num_clients} devices x sample_ratio {self.fleet.sample_ratio:g}")
            verb = "needs" if self.fleet.per_round is not None else "selects"
            raise ValueError(f"network.quorum = {int(q)} devices, but a round {verb} only {selected} ({how}): no round could close")
        return self

    @model_validator(mode="after")
    def _lr_schedule_fits(self) -> RunConfig:
        # each milestone must fall after a round of this run, and no two after the same one: a drop before
        # round 1 or two drops at once are what a too-short run silently makes of a schedule
        unit = "server updates" if self.mode == "async" else "rounds"
        trains = [("train", self.train)] + [(f"fleet.groups[{i}].train", self.train_for(g))
                                            for i, g in enumerate(self.fleet.groups) if g.train is not None]
        scheduled = any(train.lr_milestones for _, train in trains)
        own_gamma = {f"fleet.groups[{i}].train" for i, g in enumerate(self.fleet.groups)
                     if g.train is not None and "lr_gamma" in g.train.model_fields_set}
        for where, train in trains:
            if not train.lr_milestones:
                # the run's gamma may serve groups with milestones of their own; a group's own gamma serves only that group
                if (not scheduled or where in own_gamma) and train.lr_gamma != TrainSettings.model_fields["lr_gamma"].default:
                    raise ValueError(f"{where}.lr_gamma = {train.lr_gamma:g} scales nothing without lr_milestones: add "
                                     "lr_milestones (e.g. [0.5]) or drop lr_gamma")
                continue
            if self.rounds < 2:
                raise ValueError(f"{where}.lr_milestones: a run of {self.rounds} {unit[:-1]} has no later one to drop the learning "
                                 "rate in; drop lr_milestones")
            after = [int(m * self.rounds) for m in train.lr_milestones]
            for m, r in zip(train.lr_milestones, after):
                if r < 1:
                    raise ValueError(f"{where}.lr_milestones: {m:g} of {self.rounds} {unit} falls before the first one, so the "
                                     f"whole run would train at the dropped rate; give milestones of at least 1/{self.rounds} "
                                     f"(= {1 / self.rounds:.3g}), or more {unit}")
            for (m1, r1), (m2, r2) in zip(zip(train.lr_milestones, after), zip(train.lr_milestones[1:], after[1:])):
                if r1 == r2:
                    raise ValueError(f"{where}.lr_milestones: {m1:g} and {m2:g} of {self.rounds} {unit} both fall after "
                                     f"{unit[:-1]} {r1}, so the rate would fall by lr_gamma squared at once; space them at least "
                                     f"1/{self.rounds} apart, or run more {unit}")
        return self

    @model_validator(mode="after")
    def _device_held_fits(self) -> RunConfig:
        if self.data.device_held and any(g.view is not None for g in self.fleet.groups):
            raise ValueError('fleet.groups[].view simulates per-device feature spaces; with partition = "devices" each device\'s own '
                             "columns are its feature space: drop view")
        if self.data.device_held and self.data.samples_per_client is not None:
            raise ValueError('data.samples_per_client caps a simulated share; with partition = "devices" devices use all they hold: drop it')
        return self

    @model_validator(mode="after")
    def _kept_clients_fit(self) -> RunConfig:
        sim = self.simulation
        if not (sim.keep_clients or sim.clients_from):
            return self
        key = "keep_clients" if sim.keep_clients else "clients_from"
        if not get_method(self.method.name).one_shot:
            raise ValueError(f"simulation.{key} is for one-shot methods (fedmho, fedmho-md, fedmho-sd, fedcvae), whose clients "
                             f"train once whatever the server does; {self.method.name} trains every round on what the server sent")
        if sim.worker_count(10**6) > 1 or sim.backend != "local":
            raise ValueError(f"simulation.{key} needs every device in this process (simulation.workers = 1, backend = \"local\")")
        return self

    @model_validator(mode="after")
    def _async_fits(self) -> RunConfig:
        if self.mode != "async":
            if self.asynchronous != AsyncSettings():
                raise ValueError('[asynchronous] settings apply to mode = "async"; set mode = "async" or drop them')
            return self
        if get_method(self.method.name).one_shot:
            raise ValueError(f"{self.method.name} is one-shot (a single round): it has no asynchronous mode; drop mode = \"async\"")
        if self.fleet.per_round is not None or self.fleet.sample_ratio != 1.0:
            raise ValueError('mode = "async" selects no rounds: use asynchronous.concurrency instead of fleet.per_round / sample_ratio')
        return self

    def max_epochs(self) -> int:
        """The most local epochs any group trains per round."""
        return max(self.train_for(g).epochs for g in self.fleet.groups)

    def train_for(self, group: GroupSettings) -> TrainSettings:
        if group.train is None:
            return self.train
        # the values themselves (not a dump): a dp_sgd table stays a DPSGDSettings
        return self.train.model_copy(update={k: v for k in TrainOverride.model_fields if (v := getattr(group.train, k)) is not None})

    def filter_chain(self) -> list[tuple[str, dict[str, Any]]]:
        """The ``[[filters]]`` as (name, options) pairs, in order (edgefl.filters.build_chain), with
        what a filter derives from the run filled in (local-dp's noise from its target epsilon)."""
        if not self.filters:
            return []
        from edgefl.filters import get_filter

        return [(f.name, get_filter(f.name).resolve_options(f.options(), {"rounds": self.rounds})) for f in self.filters]

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump(mode="json", exclude_none=True)
        out["method"] = {"name": self.method.name, **self.method.options()}
        if self.filters:
            out["filters"] = [{"name": f.name, **f.options()} for f in self.filters]
        return out

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


def validate_config(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a parsed TOML document into a :class:`RunConfig` (method options included)."""
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source} is invalid:\n{format_validation_error(exc, RunConfig)}") from None
    method = get_method(cfg.method.name)
    try:
        method.options_model.model_validate(cfg.method.options())
    except ValidationError as exc:
        accepted = ", ".join(method.options_model.model_fields) or "none"
        raise ConfigError(
            f"{source} is invalid:\n{format_validation_error(exc, method.options_model, 'method')}",
            hint=f"method {method.name!r} takes these options: {accepted}",
        ) from None
    names = [f.name for f in cfg.filters]
    n = cfg.fleet.num_clients
    run = {"method_options": cfg.method.options(), "mode": cfg.mode, "rounds": cfg.rounds, "chain": names, "devices": n,
           "sample_rate": cfg.fleet.selection_size(n) / n if n else 1.0}
    for i, entry in enumerate(cfg.filters):
        _check_filter(entry, i, method, source, run)
    if cfg.train.dp_sgd is not None or any(g.train is not None and g.train.dp_sgd is not None for g in cfg.fleet.groups):
        from edgefl.privacy.dp_sgd import run_refusal

        refusal = run_refusal(cfg)
        if refusal:
            raise ConfigError(f"{source}: DP-SGD cannot train this run: {refusal[0]}", hint=refusal[1])
    return cfg


def _check_filter(entry: FilterSettings, index: int, method, source: str, run: dict[str, Any]) -> None:
    """A ``[[filters]]`` entry: a known name, options its filter accepts, and a method it can serve."""
    from edgefl.filters import FILTERS, get_filter

    try:
        cls = get_filter(entry.name)
    except KeyError as exc:
        raise ConfigError(f"{source} is invalid:\n  filters.{index}.name: {exc.args[0]}",
                          hint="edgefl filters lists them with their options") from None
    try:
        options = cls.Options.model_validate(entry.options())
    except ValidationError as exc:
        accepted = ", ".join(cls.Options.model_fields) or "none"
        raise ConfigError(f"{source} is invalid:\n{format_validation_error(exc, cls.Options, f'filters.{index}')}",
                          hint=f"filter {entry.name!r} takes these options: {accepted}") from None
    refusal = cls.refusal(options, method, **run)
    if refusal:
        others = [name for name in sorted(FILTERS) if name != entry.name and _serves(name, method, run)]
        raise ConfigError(f"{source}: filter {entry.name!r} cannot serve this run: {refusal}",
                          hint="drop it from [[filters]]" + (f" or choose one that serves it ({', '.join(others)})" if others else ""))


def _serves(name: str, method, run: dict[str, Any]) -> bool:
    """Whether filter ``name`` at its default options would serve this run (the refusal's hint
    names only those); a filter whose options have no defaults is not offered."""
    from edgefl.filters import get_filter

    cls = get_filter(name)
    try:
        return cls.refusal(cls.Options(), method, **run) is None
    except (ValidationError, TypeError, ValueError):
        return False


def parse_value(text: str) -> Any:
    """A ``--set`` value: TOML syntax when it parses (numbers, booleans, lists), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (list items by index: ``fleet.groups.0.count=2``)."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set rounds=3")
        key, value = item.split("=", 1)
        if "[" in key:  # filters[0].clip: the TOML/Python habit; list items are numbered path parts here
            dotted = key.strip().replace("[", ".").replace("]", "")
            raise ConfigError(f"--set {key}: list items are numbered as parts of the path", hint=f"--set {dotted}={value}")
        parts = key.strip().split(".")
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"--set {key}: {'.'.join(parts[:i])} has no item {part}")
                node = node[int(part)]
            else:
                node = node.setdefault(part, {})
        last = parts[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigError(f"--set {key}: no item {last}")
            node[int(last)] = parse_value(value)
        elif isinstance(node, dict):
            node[last] = parse_value(value)
        else:
            raise ConfigError(f"--set {key}: {'.'.join(parts[:-1])} is not a table")
    return out


PRESETS = {"demo": "fedhe-fashion-mnist.toml", "paper": "fedhe-fashion-mnist-paper.toml",
           "fedhe-paper": "fedhe-fashion-mnist-paper-async.toml"}


def preset_text(name: str) -> str:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{suggest(name, PRESETS)}", hint=f"presets: {', '.join(PRESETS)}")
    return resources.files("edgefl.defaults").joinpath(PRESETS[name]).read_text()


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, preset: str = "demo") -> RunConfig:
    """Read a TOML file (or the embedded preset when ``path`` is None), apply overrides, validate.
    An error that only the overrides cause is blamed on them (``--set ...``), not on the file."""
    if path is None:
        raw, source = tomllib.loads(preset_text(preset)), f"preset {preset!r}"
    else:
        raw, source = read_toml(path), str(path)
    merged = _switch_method(raw, apply_overrides(raw, overrides or []), overrides or [])
    try:
        return validate_config(merged, source)
    except ConfigError as exc:
        if overrides and _valid(raw, source):
            sets = " ".join(f"--set {o}" for o in overrides)
            raise ConfigError(exc.message.replace(f"{source} is invalid", f"{sets} makes the config invalid", 1),
                              hint=exc.hint or f"{source} alone is valid: fix or drop the override") from None
        raise


def _valid(raw: dict[str, Any], source: str) -> bool:
    try:
        validate_config(raw, source)
    except ConfigError:
        return False
    return True


def _switch_method(raw: dict[str, Any], merged: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``--set method.name=other``: the file's options of its own method do not apply to another;
    drop the ones the new method does not take, and say so."""
    before = (raw.get("method") or {}).get("name") if isinstance(raw.get("method"), dict) else None
    method = merged.get("method") if isinstance(merged.get("method"), dict) else None
    if method is None or before is None or method.get("name") == before:
        return merged
    try:
        accepted = set(get_method(str(method.get("name"))).options_model.model_fields)
    except ConfigError:
        return merged  # an unknown name: validation reports it
    explicit = {o.split("=", 1)[0].strip().removeprefix("method.") for o in overrides if o.strip().startswith("method.")}
    dropped = sorted(k for k in method if k != "name" and k not in accepted and k in raw["method"] and k not in explicit)
    if dropped:
        log.warning("method %s takes none of %s's options %s: dropped", method["name"], before, ", ".join(dropped))
        merged = {**merged, "method": {k: v for k, v in method.items() if k not in dropped}}
    return merged
