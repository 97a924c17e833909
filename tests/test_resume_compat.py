"""Checkpoints written by an older edgefl keep resuming: a setting added to the config with a
default changes the digest a checkpoint is checked against (server/session.py config_digest), so it
is either written only when set (default None) or listed in ADDED_SINCE with the value that gives
an older run's numbers."""

from __future__ import annotations

import hashlib
import typing
from typing import Any

import tomli_w
from pydantic import BaseModel

from edgefl.config import RunConfig, load_config
from edgefl.server.session import ADDED_SINCE, config_digest, legacy_digests

#: every setting RunConfig.to_dict() can write, as of the last setting added (eval.unselected);
#: a new one goes here once it is resumable (default None, or in ADDED_SINCE)
KNOWN = {
    "simulation.keep_clients", "simulation.clients_from",  # default None: written only when set
    "asynchronous.aggregation", "asynchronous.buffer_size", "asynchronous.concurrency",
    "asynchronous.device_accuracy", "asynchronous.eval_every_s", "asynchronous.mixing", "asynchronous.server_lr",
    "asynchronous.staleness_bound", "asynchronous.staleness_exponent", "asynchronous.time_budget_s",
    "clock.candidates", "clock.deadline_s", "clock.headroom", "data.alpha", "data.classes",
    "data.client_test_fraction", "data.data_dir", "data.dataset", "data.download", "data.idx_name",
    "data.label_column", "data.min_samples", "data.partition", "data.resize", "data.samples_per_client",
    "data.shards_per_client", "data.test_samples", "device", "eval.batch_size", "eval.every", "eval.unselected",
    "export", "filters", "fleet.groups[].count", "fleet.groups[].model", "fleet.groups[].options",
    "fleet.groups[].profile", "fleet.groups[].train.batch_size", "fleet.groups[].train.dp_sgd.delta",
    "fleet.groups[].train.dp_sgd.max_grad_norm", "fleet.groups[].train.dp_sgd.noise_multiplier",
    "fleet.groups[].train.dp_sgd.poisson", "fleet.groups[].train.dp_sgd.target_epsilon",
    "fleet.groups[].train.epochs", "fleet.groups[].train.lr", "fleet.groups[].train.lr_gamma",
    "fleet.groups[].train.lr_milestones", "fleet.groups[].train.max_steps",
    "fleet.groups[].train.momentum", "fleet.groups[].train.optimizer", "fleet.groups[].train.weight_decay",
    "fleet.groups[].view.count", "fleet.groups[].view.fraction", "fleet.groups[].view.kind",
    "fleet.groups[].view.size", "fleet.over_select", "fleet.per_round", "fleet.sample_ratio", "method", "mode",
    "name", "network.ack_timeout_s", "network.chunk_bytes", "network.chunk_threshold", "network.federation",
    "network.grace_s", "network.keepalive_s", "network.max_abs_value", "network.max_message_bytes",
    "network.max_partial_bytes_total", "network.offline_grace_s", "network.partial_max_age_s", "network.protocol",
    "network.quorum", "network.round_deadline_s", "network.stale_upload_s", "rounds", "seed", "simulation.backend",
    "simulation.baseline", "simulation.batch_clients", "simulation.checkpoint_every", "simulation.ray_address",
    "simulation.ray_cpus", "simulation.ray_gpus", "simulation.workers", "threads", "track", "tracking_uri",
    "train.batch_size", "train.dp_sgd.delta", "train.dp_sgd.max_grad_norm", "train.dp_sgd.noise_multiplier",
    "train.dp_sgd.poisson", "train.dp_sgd.target_epsilon", "train.epochs", "train.lr", "train.max_steps",
    # written only when a schedule is set (the empty default writes neither): older digests hold
    "train.lr_milestones", "train.lr_gamma",
    "train.momentum", "train.optimizer", "train.optimizer_state", "train.weight_decay",
}


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The settings model a field holds (itself, optional, or as list items), and whether as a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and args:
        return _model_of(args[0])[0], True
    for arg in args:
        inner, many = _model_of(arg)
        if inner is not None:
            return inner, many
    return None, False


def _settings(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every setting's dotted name (list items as ``[]``) and default; a model whose keys are free
    (a method's or filter's options, written only when set) is one setting."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        inner, many = _model_of(field.annotation)
        if inner is not None and inner.model_config.get("extra") != "allow":
            out.update(_settings(inner, f"{prefix}{name}{'[]' if many else ''}."))
        else:
            out[prefix + name] = field.get_default(call_default_factory=True)
    return out


def test_every_setting_added_since_is_resumable():
    listed = {f"{table}.{key}" for table, key in ADDED_SINCE}
    added = {name: default for name, default in _settings(RunConfig).items() if name not in KNOWN}
    unresumable = sorted(name for name, default in added.items() if default is not None and name not in listed)
    assert not unresumable, (
        f"new settings with a default: {unresumable}. Older checkpoints' digests do not hold them, so "
        "`edgefl simulate --resume` of a run begun before them would be refused. Give each the default None "
        "(written only when set), or add it to ADDED_SINCE in server/session.py with the value that gives an "
        "older run's numbers; then add it to KNOWN here.")


def test_added_since_names_real_settings_and_valid_values():
    settings = _settings(RunConfig)
    for (table, key), older in ADDED_SINCE.items():
        assert f"{table}.{key}" in settings, f"ADDED_SINCE names {table}.{key}, which RunConfig has not"
        section, _ = _model_of(RunConfig.model_fields[table].annotation)
        section.model_validate({key: older})  # the value an older run is resumed with is a valid one


def test_a_checkpoint_from_each_step_of_added_since_is_recognised():
    cfg = load_config()  # the demo
    legacy = legacy_digests(cfg)
    assert config_digest(cfg) not in legacy or not ADDED_SINCE
    added = list(ADDED_SINCE)
    for since in range(len(added)):  # a checkpoint written before added[since] (and after the ones before it)
        raw = cfg.to_dict()
        for table, key in added[since:]:
            raw[table].pop(key, None)
        digest = hashlib.sha256(tomli_w.dumps(raw).encode()).hexdigest()
        assert legacy[digest] == added[since:]
