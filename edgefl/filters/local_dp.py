"""Local differential privacy for knowledge uploads: clipped and noised on the device, before they
leave it, so neither the server nor the broker ever holds the exact values.

The unit protected is a device's whole upload in a round (its data may change arbitrarily): any
two uploads the clipping allows differ by at most the L2 sensitivity below, and Gaussian noise of
z x sensitivity makes each round's release (epsilon, delta)-DP; the accountant composes the
rounds a device takes part in (:mod:`edgefl.privacy.accounting`, sampling rate 1).

* FedHe (``class_logits``): each reported class's mean logits row is clipped to L2 norm ``clip``;
  the device reports at most C rows, so two uploads differ by at most 2 x clip x sqrt(C).
* CHFL (``head``): the change of the head since its download, clipped to ``clip`` over weight
  and bias: sensitivity 2 x clip.
* Felo and Velo (``class_features``): each reported class's row, its mean feature followed by its
  mean logits, clipped to ``clip``: sensitivity 2 x clip x sqrt(C). The weights the same upload
  carries (averaged within architecture groups) are not noised: local-dp protects the knowledge,
  not the weights.

Counts: FedHe's server weights each device's row of a class the same (Eq. 10, uniform
weighting), so the counts do not enter the released values; which classes a device reports and
its counts still travel in the clear (``classes``, ``counts``, ``num_samples``). Add
secure aggregation (``secagg`` after this filter) to hide them from the server: FedHe's secure sum
sends every class from every device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field, model_validator

from edgefl.errors import PayloadError
from edgefl.filters.base import Filter, FilterOptions
from edgefl.messages import Message
from edgefl.privacy.accounting import Gaussian, noise_for
from edgefl.seeding import derive_seed

META = "filter.local-dp"
KNOWLEDGE = "class."  # Felo's and Velo's per-class tensors (edgefl.algorithms.felo.KNOWLEDGE)


class LocalDPOptions(FilterOptions):
    clip: float = Field(10.0, gt=0, le=1e6, description="L2 norm each logits row (FedHe) or the head's change (CHFL) is clipped to")
    noise_multiplier: float | None = Field(None, ge=0, le=1e4, description="z: the noise's standard deviation is z x the upload's "
                                           "sensitivity (2 clip sqrt(C) for FedHe's C classes, 2 clip for CHFL's head); "
                                           "None: derived from target_epsilon")
    target_epsilon: float | None = Field(None, gt=0, le=1e4, description="epsilon each device may spend at delta over the run: "
                                         "derives the noise multiplier from the planned rounds (a device releasing in every round), "
                                         "or refuses a run whose given one spends more")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of each device's (epsilon, delta) guarantee")

    @model_validator(mode="after")
    def _noise_or_target(self) -> LocalDPOptions:
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("give noise_multiplier or target_epsilon (or both, to check one against the other)")
        return self


#: upload ids kept per device to tell a resend from a new release (a device resends its last uploads only)
RECENT_IDS = 4


class LocalDP(Filter):
    name = "local-dp"
    Options = LocalDPOptions
    summary = "local DP of knowledge uploads: FedHe's logits rows or CHFL's head clipped and noised on the device"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head: dict[str, torch.Tensor] | None = None  # CHFL: the head the device downloaded
        self._releases: dict[str, int] = {}  # server: device -> the noised uploads it released
        self._recent: dict[str, list[str]] = {}  # server: device -> its last upload ids (a resend is no new release)
        if self.options.noise_multiplier is None:  # filled in from target_epsilon by RunConfig.filter_chain()
            raise ValueError("local-dp: target_epsilon without noise_multiplier needs the run's rounds: build the chain from "
                             "RunConfig.filter_chain()")

    @classmethod
    def resolve_options(cls, options: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
        """``target_epsilon`` without ``noise_multiplier``: the z at which a device that releases in
        every one of the planned rounds spends exactly the target (Opacus' RDP accountant, sampling
        rate 1), written into the options both sides build from."""
        if options.get("noise_multiplier") is None and isinstance(options.get("target_epsilon"), (int, float)):
            delta = options.get("delta", LocalDPOptions.model_fields["delta"].default)
            z = noise_for(float(options["target_epsilon"]), float(delta), 1.0, int(run.get("rounds", 1)))
            return {**options, "noise_multiplier": round(float(z), 6) + 1e-6}  # rounded up: never spends more than the target
        return options

    @classmethod
    def refusal(cls, options: FilterOptions, spec: Any, **run: Any) -> str | None:
        assert isinstance(options, LocalDPOptions)
        if options.noise_multiplier is not None and options.target_epsilon is not None:
            rounds = int(run.get("rounds", 1))
            spent = Gaussian(options.noise_multiplier, 1.0, rounds).epsilon(options.delta)
            if spent > options.target_epsilon:
                return (f"noise_multiplier {options.noise_multiplier:g} spends epsilon {spent:.3g} per device over the planned "
                        f"{rounds} rounds, more than target_epsilon {options.target_epsilon:g}: raise the noise, lower rounds, "
                        "or drop noise_multiplier to derive it")
        if spec.uploads not in (("class_logits",), ("head",), ("class_features",)):
            return (f"{spec.name} uploads {', '.join(spec.uploads)}: local-dp noises knowledge uploads (FedHe's per-class logits, "
                    "Felo's and Velo's per-class features and logits, CHFL's head); weight methods take dp-fedavg")
        chain = list(run.get("chain", []))
        if "secagg" in chain and chain.index("secagg") < chain.index(cls.name):
            return "put local-dp before secagg in [[filters]]: the noise must be added before the upload is masked"
        return None

    def _noise(self, shape: torch.Size, sd: float, round_no: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "local-dp", self.device or "", round_no))
        return torch.randn(shape, generator=gen, dtype=torch.float64) * sd

    # --- the device side ----------------------------------------------------------------------------
    def download_in(self, message: Message) -> Message:
        if message.kind == "head" and message.tensors:
            self._head = {k: v.detach().double().clone() for k, v in message.tensors.items() if v.is_floating_point()}
        return message

    def upload_out(self, message: Message) -> Message:
        o = self.options
        if message.kind == "class_logits":
            logits = message.tensors["logits"].detach().double()
            c = logits.shape[1]
            norms = logits.norm(dim=1, keepdim=True).clamp_min(1e-12)
            clipped = logits * torch.clamp(o.clip / norms, max=1.0)
            sd = o.noise_multiplier * 2 * o.clip * math.sqrt(c)
            noisy = clipped + self._noise(clipped.shape, sd, message.round)
            tensors = {**message.tensors, "logits": noisy.to(message.tensors["logits"].dtype)}
        elif message.kind == "class_features":
            # each class's row [mean feature | mean logits] clipped to clip: two uploads differ by at most
            # 2 clip sqrt(C) over C classes; the weights in the same upload are not touched (see the docstring)
            feats, logits = message.tensors[KNOWLEDGE + "features"].detach().double(), message.tensors[KNOWLEDGE + "logits"].detach().double()
            rows = torch.cat([feats, logits], dim=1)
            norms = rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
            rows = rows * torch.clamp(o.clip / norms, max=1.0)
            sd = o.noise_multiplier * 2 * o.clip * math.sqrt(logits.shape[1])
            rows = rows + self._noise(rows.shape, sd, message.round)
            f = feats.shape[1]
            tensors = {**message.tensors, KNOWLEDGE + "features": rows[:, :f].to(message.tensors[KNOWLEDGE + "features"].dtype),
                       KNOWLEDGE + "logits": rows[:, f:].to(message.tensors[KNOWLEDGE + "logits"].dtype)}
        elif message.kind == "head":
            base = self._head or {k: torch.zeros_like(v, dtype=torch.float64) for k, v in message.tensors.items()}
            # sorted: the noise is drawn in one stream, so its assignment must not depend on dict order
            change = {k: message.tensors[k].detach().double() - base[k] for k in sorted(base) if k in message.tensors}
            norm = math.sqrt(sum(float((d * d).sum()) for d in change.values()))
            scale = min(1.0, o.clip / norm) if norm > 0 else 1.0
            sd = o.noise_multiplier * 2 * o.clip
            flat = torch.cat([d.reshape(-1) for d in change.values()]) * scale
            flat = flat + self._noise(flat.shape, sd, message.round)
            tensors, at = dict(message.tensors), 0
            for k, d in change.items():
                tensors[k] = (base[k] + flat[at:at + d.numel()].reshape(d.shape)).to(message.tensors[k].dtype)
                at += d.numel()
        else:
            return message
        return Message(message.kind, message.round, message.sender, tensors, {**message.meta, META: {"noised": True}},
                       message.message_id)

    # --- the server side ------------------------------------------------------------------------------
    def upload_in(self, message: Message) -> Message:
        if message.kind not in ("class_logits", "head", "class_features"):
            return message
        info = message.meta.get(META)
        if info != {"noised": True} and ".secagg/masked" not in message.tensors:
            raise PayloadError("local-dp: this run's knowledge uploads are noised on the device (is it running the run's [[filters]]?)")
        # one release per upload: a resend is the same upload (its id), while an asynchronous device may
        # send two uploads of one model version (the buffer not yet full), each noised and each counted
        recent = self._recent.setdefault(message.sender, [])
        if message.message_id not in recent:
            self._releases[message.sender] = self._releases.get(message.sender, 0) + 1
            recent[:] = [*recent[-(RECENT_IDS - 1):], message.message_id]
        return Message(message.kind, message.round, message.sender, message.tensors,
                       {k: v for k, v in message.meta.items() if k != META}, message.message_id)

    def server_state(self) -> dict[str, Any]:
        return {"releases": dict(sorted(self._releases.items())), "recent": {d: list(r) for d, r in sorted(self._recent.items())}}

    def load_server_state(self, state: dict[str, Any]) -> None:
        releases = state.get("releases") if isinstance(state, dict) else None
        if not isinstance(releases, dict):
            raise PayloadError("local-dp: the saved state holds no releases")
        # counts; a checkpoint of an older version holds each device's rounds, one release each
        self._releases = {str(d): (n if isinstance(n, int) else len(n)) for d, n in releases.items()
                          if (isinstance(n, int) and not isinstance(n, bool) and n >= 0) or isinstance(n, list)}
        recent = state.get("recent") if isinstance(state.get("recent"), dict) else {}
        self._recent = {str(d): [str(i)[:64] for i in ids][-RECENT_IDS:] for d, ids in recent.items() if isinstance(ids, list)}

    def round_facts(self, round_no: int) -> dict[str, Any]:
        """Each device's epsilon so far (the rounds it released noised knowledge), and the largest."""
        o = self.options
        per_device = {d: Gaussian(o.noise_multiplier, 1.0, n).epsilon(o.delta) for d, n in sorted(self._releases.items())}
        finite = [e for e in per_device.values() if math.isfinite(e)]
        return {"epsilon_max": round(max(finite), 6) if finite else None, "delta": o.delta, "noise_multiplier": o.noise_multiplier,
                "clip": o.clip, "epsilon_per_device": {d: (round(e, 6) if math.isfinite(e) else None) for d, e in per_device.items()}}
