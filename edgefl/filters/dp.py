"""Device-level differential privacy for weight methods: DP-FedAvg (McMahan et al., ICLR 2018).

Each device's update (its trained weights minus the weights it downloaded) is clipped to L2 norm
``clip`` over all its float tensors, and devices are averaged uniformly (each counts once: the
sensitivity of the sum to one device is then ``clip``). Gaussian noise N(0, (z clip)^2) goes on
the sum of the round's updates, z the noise multiplier:

* without secure aggregation the server adds it: this filter's server side takes the clipped
  updates instead of the method, checks each norm, and hands FedAvg's server half the noisy mean
  per architecture group (``w + (sum of updates + noise) / m``);
* with secure aggregation (``secagg`` later in the chain) the server never sees an update, so the
  noise is added on the devices: each adds N(0, (z clip)^2 / e), e the devices a round expects in
  its group, and the unmasked sum carries the intended N(0, (z clip)^2) when all e report. A sum
  of m < e uploads carries only N(0, (z clip)^2 m / e): the accountant counts that round at noise
  multiplier z sqrt(m / e) (the smallest of its groups'), the record says so, and the server log
  warns; over-select devices to keep the full noise.

The accountant (:mod:`edgefl.privacy.accounting`) composes one release per round with sampling
rate q (the share of devices a round selects) into epsilon at ``delta``; every record carries it
(``filters.dp-fedavg``). With ``adaptive`` the clip follows a quantile of the update norms (Andrew
et al., NeurIPS 2021): devices say whether their update was clipped, the server releases the
noised count and moves the clip geometrically; the updates' noise grows so the two releases
together spend what z alone would (the record's clip is the one the next round uses). With ``target_epsilon`` the noise multiplier is derived from the planned
rounds, or a given one is checked against it before the run starts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field, model_validator

from edgefl.errors import PayloadError
from edgefl.filters.base import Filter, FilterOptions
from edgefl.messages import Message
from edgefl.privacy.accounting import Gaussian, composed_epsilon, noise_for
from edgefl.seeding import derive_seed

log = logging.getLogger("edgefl.server")

META = "filter.dp-fedavg"


class DPFedAvgOptions(FilterOptions):
    clip: float = Field(1.0, gt=0, le=1e6, description="L2 norm each device's update is clipped to (over all its float tensors)")
    noise_multiplier: float | None = Field(None, ge=0, le=1e4, description="z: the noise on the sum has standard deviation "
                                           "z x clip (None: derived from target_epsilon)")
    target_epsilon: float | None = Field(None, gt=0, le=1e4, description="epsilon the whole run may spend at delta: derives "
                                         "the noise multiplier from the planned rounds, or refuses a run whose given one spends more")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the (epsilon, delta) guarantee; below 1 / devices")
    adaptive: bool = Field(False, description="adaptive clipping (Andrew et al., NeurIPS 2021): clip follows the "
                           "target_quantile of the update norms, learnt from the noised share of devices under it; clip is its start")
    target_quantile: float = Field(0.5, gt=0, lt=1, description="adaptive: the share of updates clip should leave unclipped")
    clip_learning_rate: float = Field(0.2, gt=0, le=10, description="adaptive: eta of clip <- clip x exp(-eta (share - quantile))")
    count_noise: float | None = Field(None, gt=0, description="adaptive: sd of the noise on the count of unclipped updates "
                                      "(None: the devices a round expects / 20, as Andrew et al.)")

    @model_validator(mode="after")
    def _noise_or_target(self) -> DPFedAvgOptions:
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("give noise_multiplier or target_epsilon (or both, to check one against the other)")
        return self


@dataclass
class _Collected:
    updates: dict[str, torch.Tensor] = field(default_factory=dict)  # group -> running sum of clipped updates (flat, float64)
    counts: dict[str, int] = field(default_factory=dict)
    ids: dict[str, str] = field(default_factory=dict)  # device -> message id


class DPFedAvg(Filter):
    name = "dp-fedavg"
    Options = DPFedAvgOptions
    summary = "device-level DP-FedAvg: updates clipped to an L2 norm, Gaussian noise on their sum, epsilon accounted"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.noise_multiplier = self.options.noise_multiplier  # set from target_epsilon in prepare() when None
        self._reference: dict[str, torch.Tensor] | None = None  # device: the weights it downloaded
        self._round_reference: dict[str, dict[str, torch.Tensor]] = {}  # server: group -> weights sent this round
        self._groups: dict[str, str] = {}
        self._expected: dict[str, int] = {}
        self._sample_rate = 1.0
        self._rounds = 1
        self._round = -1
        self._collected = _Collected()
        self._released = 0  # rounds whose noisy sum was released (what the accountant counts)
        # secagg: releases whose sum held fewer devices than the noise was split over -> their (lower)
        # noise multiplier, counted; the rest of the releases carry the full one
        self._short: dict[float, int] = {}
        self._short_this_round: tuple[int, float, str] | None = None  # (round, its multiplier, why)
        self.clip = self.options.clip  # the round's clip: fixed, or learnt when adaptive
        self._unclipped: dict[str, int] = {}  # server, adaptive: group -> devices whose update was under the clip

    @classmethod
    def refusal(cls, options: FilterOptions, spec: Any, **run: Any) -> str | None:
        assert isinstance(options, DPFedAvgOptions)
        if spec.uploads != ("weights",) or spec.needs_individual_uploads:
            return (f"{spec.name} uploads {', '.join(spec.uploads)}: DP-FedAvg clips and noises weight updates of methods whose "
                    "server averages them (fedavg); knowledge methods take local-dp")
        if run.get("mode") == "async":
            return 'DP-FedAvg accounts one noisy sum per round: use mode = "sync"'
        rounds, q = int(run.get("rounds", 1)), float(run.get("sample_rate", 1.0))
        if options.noise_multiplier is not None and options.target_epsilon is not None:
            spent = Gaussian(options.noise_multiplier, q, rounds).epsilon(options.delta)
            if spent > options.target_epsilon:
                return (f"noise_multiplier {options.noise_multiplier:g} spends epsilon {spent:.3g} over the planned {rounds} rounds, "
                        f"more than target_epsilon {options.target_epsilon:g}: raise the noise, lower rounds, or drop "
                        "noise_multiplier to derive it")
        chain = list(run.get("chain", []))
        if "secagg" in chain and chain.index("secagg") < chain.index(cls.name):
            return "put dp-fedavg before secagg in [[filters]]: the noise must be added before the upload is masked"
        if options.adaptive and options.noise_multiplier:
            expected = max(1.0, float(run.get("sample_rate", 1.0)) * int(run.get("devices", 1)))
            sigma_b = options.count_noise if options.count_noise is not None else expected / 20
            if 2 * sigma_b <= options.noise_multiplier:
                return (f"adaptive clipping with count_noise {sigma_b:g} leaves no noise for the updates at noise_multiplier "
                        f"{options.noise_multiplier:g} (it needs 2 x count_noise > noise_multiplier): raise count_noise")
        if options.adaptive and "secagg" in chain:
            return "adaptive clipping learns from which devices' updates were clipped, which secure aggregation hides: " \
                   "use a fixed clip with secagg"
        return None

    # --- the device side ----------------------------------------------------------------------------
    def download_in(self, message: Message) -> Message:
        info = message.meta.get(META)
        if message.kind == "weights" and message.tensors:
            self._reference = {k: v.detach().clone() for k, v in message.tensors.items() if v.is_floating_point()}
        if not isinstance(info, dict):
            return message
        z, share, clip = info.get("noise_multiplier"), info.get("share"), info.get("clip", self.options.clip)
        if not isinstance(z, (int, float)) or isinstance(z, bool) or not 0 <= z <= 1e4 \
                or not isinstance(share, int) or isinstance(share, bool) or not 1 <= share <= 1 << 24 \
                or not isinstance(clip, (int, float)) or isinstance(clip, bool) or not 0 < clip <= 1e6:
            raise PayloadError("dp-fedavg: a download's noise settings are a noise multiplier in [0, 1e4], a share count and a "
                               "clip in (0, 1e6]")
        self.noise_multiplier, self._share, self.clip = float(z), int(share), float(clip)
        return Message(message.kind, message.round, message.sender, message.tensors,
                       {k: v for k, v in message.meta.items() if k != META}, message.message_id)

    def upload_out(self, message: Message) -> Message:
        if message.kind != "weights":
            return message
        if self._reference is None:
            raise PayloadError("dp-fedavg: no downloaded weights to measure the update from")
        # sorted: the noise is drawn in one stream, so which tensor gets which draw must not depend on dict order
        update = {k: message.tensors[k].detach().double() - self._reference[k].double()
                  for k in sorted(self._reference) if k in message.tensors}
        norm = math.sqrt(sum(float((u * u).sum()) for u in update.values()))
        scale = min(1.0, self.clip / norm) if norm > 0 else 1.0
        tensors = dict(message.tensors)
        noise_sd = 0.0
        if "secagg" in self.chain and self.noise_multiplier:
            # distributed noise: the masked sum of e shares carries N(0, (z clip)^2)
            noise_sd = self.noise_multiplier * self.clip / math.sqrt(getattr(self, "_share", 1))
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "dp-fedavg-device", self.device or "", message.round))
        for k, u in update.items():
            noisy = u * scale
            if noise_sd:
                noisy = noisy + torch.randn(u.shape, generator=gen, dtype=torch.float64) * noise_sd
            tensors[k] = (self._reference[k].double() + noisy).to(message.tensors[k].dtype)
        meta = {**message.meta, "num_samples": 1}  # DP-FedAvg averages devices uniformly: one device, one vote
        meta[META] = {"clipped": norm > self.clip}
        return Message(message.kind, message.round, message.sender, tensors, meta, message.message_id)

    # --- the server side ------------------------------------------------------------------------------
    def prepare(self, run: dict[str, Any]) -> None:
        self._groups = dict(run.get("groups") or {})
        self._sample_rate = float(run.get("sample_rate", 1.0))
        self._rounds = int(run.get("rounds", 1))
        self._expected = dict(run.get("expected_per_group") or {})
        if self.noise_multiplier is None:
            assert self.options.target_epsilon is not None
            self.noise_multiplier = noise_for(self.options.target_epsilon, self.options.delta, self._sample_rate, self._rounds)
        if self.options.adaptive and self.noise_multiplier and 2 * self._count_noise() <= self.noise_multiplier:
            from edgefl.errors import ConfigError

            raise ConfigError(f"dp-fedavg: adaptive clipping's count noise {self._count_noise():g} leaves no noise for the updates "
                              f"at noise multiplier {self.noise_multiplier:.3g}", hint="raise count_noise (2 x count_noise > z)")

    def download_out(self, device: str, message: Message) -> Message:
        if message.kind != "weights" or not message.tensors:
            return message
        group = self._groups.get(device, "all")
        if message.round != self._round:
            self._round, self._round_reference, self._collected = message.round, {}, _Collected()
        if group not in self._round_reference:
            self._round_reference[group] = {k: v.detach().clone() for k, v in message.tensors.items()}
        info = {"noise_multiplier": self._update_noise(), "share": max(1, self._expected.get(group, 1)), "clip": self.clip}
        return Message(message.kind, message.round, message.sender, message.tensors, {**message.meta, META: info}, message.message_id)

    def upload_in(self, message: Message) -> Message:
        if message.kind == "weights" and isinstance(message.meta.get(META), dict):
            info = message.meta[META]
            if self.options.adaptive and (set(info) != {"clipped"} or not isinstance(info["clipped"], bool)):
                raise PayloadError("dp-fedavg: an update says whether it was clipped ({\"clipped\": true|false})")
            meta = {k: v for k, v in message.meta.items() if k != META}
            if self.options.adaptive:
                meta["dp_clipped"] = info["clipped"]
            return Message(message.kind, message.round, message.sender, message.tensors, meta, message.message_id)
        return message

    def collect(self, message: Message) -> Any | None:
        if "secagg" in self.chain or message.kind != "weights":
            return None  # under secure aggregation the sum arrives unmasked through secagg, the noise already in it
        from edgefl.filters.secagg import Taken

        group = self._groups.get(message.sender, "all")
        reference = self._round_reference.get(group)
        if message.round != self._round or reference is None:
            return Taken("late", f"dp-fedavg: round {message.round} is not being summed; not used")
        c = self._collected
        if message.sender in c.ids:
            return Taken("duplicate" if c.ids[message.sender] == message.message_id else "rejected",
                         "" if c.ids[message.sender] == message.message_id else "one update per device per round")
        if set(message.tensors) != set(reference) or any(message.tensors[k].shape != reference[k].shape for k in reference):
            return Taken("rejected", "dp-fedavg: the upload's tensors differ from the weights this device was sent")
        flat = torch.cat([(message.tensors[k].double() - reference[k].double()).reshape(-1)
                          for k in sorted(reference) if reference[k].is_floating_point()])
        norm = float(flat.norm())
        if norm > self.clip * (1 + 1e-6) + 1e-9:
            return Taken("rejected", f"dp-fedavg: the update's L2 norm {norm:.6g} exceeds clip {self.clip:g}: "
                                     "the device did not clip it (is it running the run's [[filters]]?)")
        c.updates[group] = c.updates.get(group, torch.zeros_like(flat)) + flat
        c.counts[group] = c.counts.get(group, 0) + 1
        c.ids[message.sender] = message.message_id
        if self.options.adaptive and message.meta.get("dp_clipped") is False:
            self._unclipped[group] = self._unclipped.get(group, 0) + 1
        return Taken("accepted")

    def release(self, round_no: int) -> list[Message]:
        if "secagg" in self.chain:
            self._released += 1 if round_no == self._round else 0
            return []
        out = []
        c = self._collected
        for group in sorted(c.updates):
            reference = self._round_reference[group]
            gen = torch.Generator().manual_seed(derive_seed(self.seed, "dp-fedavg", round_no, group))
            noise = torch.randn(c.updates[group].shape, generator=gen, dtype=torch.float64) * self._update_noise() * self.clip
            mean = (c.updates[group] + noise) / c.counts[group]
            tensors, at = {}, 0
            for k in sorted(reference):
                ref = reference[k]
                if ref.is_floating_point():
                    n = ref.numel()
                    tensors[k] = (ref.double() + mean[at:at + n].reshape(ref.shape)).to(ref.dtype)
                    at += n
                else:
                    tensors[k] = ref.clone()
            stand_in = min(d for d, g in self._groups.items() if g == group) if self._groups else group
            out.append(Message("weights", round_no, stand_in, tensors, {"num_samples": c.counts[group], "dp_noisy_mean": True}))
        if c.updates:
            self._released += 1
            if self.options.adaptive:
                self._adapt(round_no, sum(c.counts.values()))
        self._collected = _Collected()
        return out

    def released(self, round_no: int, messages: list[Message]) -> None:
        """Under secure aggregation: each unmasked sum says how many uploads it holds. Devices split
        the noise over the e a round expects in their group, so a sum of m < e carries noise
        multiplier z sqrt(m / e); the round is counted at its groups' lowest."""
        if "secagg" not in self.chain or round_no != self._round:
            return
        z = float(self.noise_multiplier or 0.0)
        worst: tuple[float, str] | None = None
        for message in messages:
            summed = message.meta.get("secure_aggregate")
            if not isinstance(summed, int) or isinstance(summed, bool) or summed < 1:
                continue
            group = self._groups.get(message.sender, "all")
            expected = max(1, self._expected.get(group, 1))
            if summed < expected and (worst is None or summed / expected < worst[0]):
                worst = (summed / expected, f"group {group}'s sum held {summed} of the {expected} devices the noise was split over")
        if worst is None or z == 0:
            return
        reduced = round(z * math.sqrt(worst[0]), 6)
        self._short[reduced] = self._short.get(reduced, 0) + 1
        self._short_this_round = (round_no, reduced, worst[1])
        log.warning("dp-fedavg: round %d: %s: the released sum's noise multiplier was %.3g, not %.3g (the epsilon counts it; "
                    "over-select devices, fleet.over_select, to keep the full noise)", round_no, worst[1], reduced, z)

    def _epsilon(self) -> float:
        z = float(self.noise_multiplier or 0.0)
        short = sum(self._short.values())
        parts = [Gaussian(z, self._sample_rate, max(0, self._released - short))]
        parts += [Gaussian(reduced, self._sample_rate, n) for reduced, n in sorted(self._short.items())]
        return composed_epsilon(parts, self.options.delta)

    def _count_noise(self) -> float:
        expected = sum(self._expected.values()) or 1
        return self.options.count_noise if self.options.count_noise is not None else expected / 20

    def _update_noise(self) -> float:
        """The noise multiplier of the updates. Adaptive clipping also releases a noised count, so
        the updates' noise grows to keep the pair at the configured z (Andrew et al., Thm 1):
        z_update = (z^-2 - (2 sigma_b)^-2)^-1/2."""
        z = float(self.noise_multiplier or 0.0)
        if not self.options.adaptive or z == 0:
            return z
        rest = z ** -2 - (2 * self._count_noise()) ** -2
        if rest <= 0:
            raise PayloadError(f"dp-fedavg: count_noise {self._count_noise():g} is too small for noise multiplier {z:g}: raise it")
        return rest ** -0.5

    def _adapt(self, round_no: int, m: int) -> None:
        """clip <- clip x exp(-eta (b - quantile)), b the noised share of updates under the clip."""
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "dp-fedavg-quantile", round_no))
        unclipped = sum(self._unclipped.values()) + float(torch.randn(1, generator=gen)) * self._count_noise()
        share = unclipped / max(m, 1)
        self.clip = float(min(1e6, max(1e-9, self.clip * math.exp(-self.options.clip_learning_rate * (share - self.options.target_quantile)))))
        self._unclipped = {}

    def server_state(self) -> dict[str, Any]:
        # the releases the accountant counts and the learnt clip; the noise multiplier is derived again in prepare()
        state: dict[str, Any] = {"released": self._released, "clip": self.clip}
        if self._short:
            state["short_releases"] = [[z, n] for z, n in sorted(self._short.items())]
        return state

    def load_server_state(self, state: dict[str, Any]) -> None:
        released, clip = (state.get("released"), state.get("clip")) if isinstance(state, dict) else (None, None)
        if not (isinstance(released, int) and not isinstance(released, bool) and 0 <= released <= 10_000_000):
            raise PayloadError("dp-fedavg: the saved state's release count is not a count")
        if not (isinstance(clip, (int, float)) and not isinstance(clip, bool) and 0 < clip <= 1e6):
            raise PayloadError("dp-fedavg: the saved state's clip is out of range")
        short = state.get("short_releases", [])  # absent in a state saved before they were counted
        if not isinstance(short, list) or len(short) > 100_000 or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], (int, float)) and not isinstance(p[0], bool)
                and 0 < p[0] <= 1e4 and isinstance(p[1], int) and not isinstance(p[1], bool) and 0 < p[1] <= released
                for p in short) or sum(p[1] for p in short) > released:
            raise PayloadError("dp-fedavg: the saved state's short releases are not [noise multiplier, count] pairs within its releases")
        self._released, self.clip = released, float(clip)
        self._short = {}
        for z, n in short:
            self._short[float(z)] = self._short.get(float(z), 0) + n

    def round_facts(self, round_no: int) -> dict[str, Any]:
        z = float(self.noise_multiplier or 0.0)
        epsilon = self._epsilon()
        facts = {"epsilon": round(epsilon, 6) if math.isfinite(epsilon) else None, "delta": self.options.delta,
                 "noise_multiplier": round(z, 6), "clip": round(self.clip, 9), "releases": self._released,
                 "sample_rate": round(self._sample_rate, 6)}
        if self._short:
            facts["short_releases"] = sum(self._short.values())  # releases counted at less than noise_multiplier
        if self._short_this_round is not None and self._short_this_round[0] == round_no:
            facts["released_noise_multiplier"], facts["short_because"] = self._short_this_round[1], self._short_this_round[2]
        return facts
