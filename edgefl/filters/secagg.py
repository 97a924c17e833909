"""Secure aggregation (SecAgg+, Bell et al. CCS 2020; Bonawitz et al. CCS 2017 with every device
a neighbour): the server and the broker learn only the sum of the devices' uploads.

Per round, with the devices of each summing group (docs/secure-aggregation.md):

1. stage ``secagg-keys`` (before training): each device makes two X25519 key pairs (one to
   encrypt shares, one to agree masks) and a self-mask seed b, and sends the two public keys;
2. stage ``secagg-shares``: the server tells each device its neighbours in a random graph of
   about log2(n) neighbours (drawn from the run seed, the round and the group, so anyone can
   check it) and their public keys; the device splits its mask private key and b into t-of-k
   Shamir shares and sends each neighbour's share encrypted to that neighbour (AES-GCM under a
   key agreed with it); the server keeps them;
3. training: each device's download carries the encrypted shares addressed to it; its upload is
   its sum form (:mod:`edgefl.secagg.forms`) in fixed point, plus PRG(b), plus for every
   neighbour v that sent shares +PRG(s_uv) (u < v) or -PRG(s_uv), all modulo 2^m; the server
   keeps these masked uploads instead of giving them to the method;
4. stage ``secagg-unmask`` (after training): each device that uploaded is told which of its
   neighbours uploaded and which dropped after sharing, and returns its shares of the
   survivors' b and of the dropped devices' mask keys (never both for one device); with t of
   them the server removes the self masks and the masks left by the dropped devices, decodes the
   sum and hands the method's server half one message per group: what a device holding the
   whole sum would send.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import Field

from edgefl.errors import PayloadError
from edgefl.filters.base import Filter, FilterOptions
from edgefl.messages import Message
from edgefl.secagg import fixedpoint, graph, keys, prg, shamir
from edgefl.secagg.forms import KINDS, Layout, from_sum, to_sum_form
from edgefl.seeding import derive_seed
from edgefl.stages import Stage, StageFailed

log = logging.getLogger("edgefl.secagg")
MASKED = ".secagg/masked"  # the upload's one tensor: the masked sum form, ceil(m / 8) little-endian bytes a value (U8)
INBOX = ".secagg/shares"  # a download's encrypted shares addressed to its device (U8 [k, L])
META = "filter.secagg"
KEY_BYTES = 32
MAX_NEIGHBOURS = 1024
MAX_VECTOR = 1 << 27  # values in one secured upload (a ResNet-50 has 2.6e7)
#: what a masked upload keeps in the clear besides its layout (a restart from scratch tells the server nothing of the model)
KEEP_META = ("train_loss", "eval_accuracy", "started_from", "state_lost")


class SecAggOptions(FilterOptions):
    neighbours: int | None = Field(None, ge=2, le=MAX_NEIGHBOURS, description="neighbours per device in a group's graph "
                                   "(None: about log2(n), at least 2, as SecAgg+; n - 1 or more: every device, as SecAgg)")
    threshold: int | None = Field(None, ge=2, le=MAX_NEIGHBOURS, description="shares needed to remove a device's masks "
                                  "(None: more than half its neighbours)")
    clip: float = Field(float(1 << 20), gt=0, le=1e15, description="largest magnitude of a summed value (a weight times the "
                        "device's sample count): larger values are clipped")
    bits: int = Field(32, ge=8, le=fixedpoint.MAX_VALUE_BITS, description="fixed-point resolution: values in [-clip, clip] become "
                      "integers in [0, 2^bits); the sum's error per value is at most one step 2 clip / (2^bits - 1) per device")
    stage_deadline_s: float | None = Field(None, gt=0, description="seconds each secure-aggregation stage waits for devices "
                                           "(None: the round's deadline)")


# --- what both sides agree on -----------------------------------------------------------------------
def _context(federation: str) -> bytes:
    """What every key derivation and sealed share is bound to besides the round and the pair:
    the federation (keys of one federation never open another's shares)."""
    return f"edgefl-secagg|{federation}".encode()


def _plan(options: SecAggOptions, members: list[str]) -> tuple[int, int]:
    """(neighbours, threshold) for a group of ``members`` devices."""
    n = len(members)
    k = min(n - 1, options.neighbours if options.neighbours is not None else graph.default_neighbours(n))
    if k < n - 1 and k % 2:
        k = min(k + 1, n - 1)  # a Harary graph joins k/2 devices on each side
    t = options.threshold if options.threshold is not None else graph.default_threshold(k)
    return k, min(t, k)


# --- the device side ------------------------------------------------------------------------------
@dataclass
class _DeviceRound:
    round: int
    c_key: keys.KeyPair  # encrypts shares
    s_key: keys.KeyPair  # agrees masks
    b_seed: bytes
    neighbours: dict[str, int] = field(default_factory=dict)  # id -> Shamir x
    s_pks: dict[str, bytes] = field(default_factory=dict)
    c_pks: dict[str, bytes] = field(default_factory=dict)
    inbox: dict[str, bytes] = field(default_factory=dict)  # sender -> encrypted share bundle
    threshold: int = 0
    x: int = 0  # this device's Shamir point
    modulus_bits: int = 0
    federation: str = ""


class SecAgg(Filter):
    name = "secagg"
    Options = SecAggOptions
    summary = "secure aggregation (SecAgg+): the server and the broker learn only the sum of the uploads; devices may drop out"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mine: _DeviceRound | None = None
        self._server = _ServerSide(self) if self.side == "server" else None

    @classmethod
    def refusal(cls, options: FilterOptions, spec: Any, **run: Any) -> str | None:
        options = run.get("method_options") or {}
        sums_anyway = spec.sums_with_option is not None and options.get(spec.sums_with_option[0]) == spec.sums_with_option[1]
        if spec.needs_individual_uploads and not sums_anyway:
            return f"{spec.name} cannot be secured by summing: {spec.needs_individual_uploads}"
        if not set(spec.uploads) <= set(KINDS):
            return f"{spec.name} uploads {', '.join(spec.uploads)}; secure aggregation sums {', '.join(KINDS)}"
        if run.get("mode") == "async":
            return 'secure aggregation runs within rounds: use mode = "sync" (buffered asynchronous secure aggregation is not built)'
        if (run.get("method_options") or {}).get("weighted") is False:
            return "CHFL's weighted = false averages heads unweighted; the secure sum weights each head by its sample count: " \
                   "keep the default weighted = true"
        weighting = (run.get("method_options") or {}).get("server_weighting")
        if weighting == "count":
            return "FedHe's server_weighting = \"count\" weights each device's logits by its class counts, which the sum does not " \
                   "carry: use the default uniform weighting (the paper's Eq. 10)"
        return None

    # device: stages -----------------------------------------------------------------------------
    def answer_stage(self, stage: str, request: Message) -> Message | None:
        if stage == "secagg-keys":
            self._mine = _DeviceRound(request.round, keys.KeyPair.generate(), keys.KeyPair.generate(), prg.new_seed(),
                                      federation=str(request.meta.get("federation", ""))[:64])
            return Message("stage", request.round, self.device or "?", {
                "c_pk": _u8(self._mine.c_key.public_bytes()), "s_pk": _u8(self._mine.s_key.public_bytes())}, {})
        if stage == "secagg-shares":
            return self._share(request)
        if stage == "secagg-unmask":
            return self._unmask(request)
        return None

    def _round_state(self, round_no: int) -> _DeviceRound:
        mine = self._mine
        if mine is None or mine.round != round_no:
            raise PayloadError(f"secagg: no keys of round {round_no} on this device (it missed the key stage)")
        return mine

    def _share(self, request: Message) -> Message:
        mine = self._round_state(request.round)
        ids = request.meta.get("neighbours")
        xs = request.meta.get("x")
        t = request.meta.get("threshold")
        m = request.meta.get("modulus_bits")
        c_pk, s_pk = request.tensors.get("c_pk"), request.tensors.get("s_pk")
        if (not isinstance(ids, list) or not 1 <= len(ids) <= MAX_NEIGHBOURS or not all(isinstance(i, str) and 0 < len(i) <= 64 for i in ids)
                or len(set(ids)) != len(ids) or self.device in ids or not isinstance(xs, dict)
                or not all(isinstance(xs.get(i), int) and 0 < xs[i] < 1 << 31 for i in [*ids, self.device])
                or not isinstance(t, int) or not 1 <= t <= len(ids) or not isinstance(m, int) or not 8 <= m <= 63
                or c_pk is None or s_pk is None or tuple(c_pk.shape) != (len(ids), KEY_BYTES) or tuple(s_pk.shape) != (len(ids), KEY_BYTES)
                or c_pk.dtype != torch.uint8 or s_pk.dtype != torch.uint8):
            raise PayloadError("secagg: a share request names distinct neighbours, their x, a threshold 2..k and their keys (U8 [k, 32])")
        mine.neighbours = {i: int(xs[i]) for i in ids}
        mine.x = int(xs[self.device])
        mine.threshold = t
        mine.modulus_bits = m
        mine.c_pks = {i: bytes(c_pk[j].tolist()) for j, i in enumerate(ids)}
        mine.s_pks = {i: bytes(s_pk[j].tolist()) for j, i in enumerate(ids)}
        points = [mine.neighbours[i] for i in ids]
        s_shares = shamir.split(mine.s_key.private_bytes(), t, points)
        b_shares = shamir.split(mine.b_seed, t, points)
        sealed = []
        context = _context(mine.federation)
        for i in ids:
            key = keys.share_encryption_key(mine.c_key.agree(mine.c_pks[i]), request.round, context)
            bundle = s_shares[mine.neighbours[i]] + b_shares[mine.neighbours[i]]
            sealed.append(keys.seal_bundle(key, bundle, round_no=request.round, sender=mine.x, recipient=mine.neighbours[i],
                                           context=context))
        width = max(len(b) for b in sealed)
        return Message("stage", request.round, self.device or "?", {"sealed": torch.tensor([list(b) for b in sealed], dtype=torch.uint8)},
                       {"to": ids, "width": width})

    def _unmask(self, request: Message) -> Message:
        mine = self._round_state(request.round)
        survivors, dropped = request.meta.get("survivors"), request.meta.get("dropped")
        if not isinstance(survivors, list) or not isinstance(dropped, list) or set(survivors) & set(dropped) \
                or not set(survivors) | set(dropped) <= set(mine.inbox):
            raise PayloadError("secagg: an unmask request names survivors and dropped devices, disjoint, among those that sent "
                               "this device shares (never both shares of one device)")
        b_out, s_out = [], []
        context = _context(mine.federation)
        for sender in [*survivors, *dropped]:
            key = keys.share_encryption_key(mine.c_key.agree(mine.c_pks[sender]), request.round, context)
            try:
                bundle = keys.open_bundle(key, mine.inbox[sender], round_no=request.round, sender=mine.neighbours[sender],
                                          recipient=mine.x, context=context)
            except ValueError as exc:
                raise PayloadError(f"secagg: {exc}") from None
            half = len(bundle) // 2
            (b_out if sender in survivors else s_out).append(list(bundle[half:] if sender in survivors else bundle[:half]))
        return Message("stage", request.round, self.device or "?", {
            "b_shares": torch.tensor(b_out, dtype=torch.uint8).reshape(len(b_out), shamir.SHARE_BYTES),
            "s_shares": torch.tensor(s_out, dtype=torch.uint8).reshape(len(s_out), shamir.SHARE_BYTES)},
            {"survivors": survivors, "dropped": dropped})

    # device: the download and the upload ---------------------------------------------------------
    def download_in(self, message: Message) -> Message:
        info = message.meta.get(META)
        if INBOX not in message.tensors and info is None:
            return message
        mine = self._round_state(message.round)
        sealed = message.tensors.get(INBOX)
        senders = info.get("from") if isinstance(info, dict) else None
        if sealed is None or sealed.dtype != torch.uint8 or sealed.dim() != 2 or not isinstance(senders, list) \
                or len(senders) != sealed.shape[0] or not set(senders) <= set(mine.neighbours):
            raise PayloadError("secagg: a download's shares are U8 [k, L] from this device's neighbours")
        width = info.get("widths")
        widths = width if isinstance(width, list) and len(width) == len(senders) else [sealed.shape[1]] * len(senders)
        mine.inbox = {s: bytes(sealed[j, : int(widths[j])].tolist()) for j, s in enumerate(senders)}
        tensors = {k: v for k, v in message.tensors.items() if k != INBOX}
        meta = {k: v for k, v in message.meta.items() if k != META}
        return Message(message.kind, message.round, message.sender, tensors, meta, message.message_id)

    def upload_out(self, message: Message) -> Message:
        if message.kind not in KINDS:
            return message
        mine = self._round_state(message.round)
        vector, layout = to_sum_form(message)
        o = self.options
        clipped = int((vector.abs() > o.clip).sum())
        if clipped:
            log.warning("%s: secagg clipped %d values beyond +-%g (raise [[filters]] clip)", self.device, clipped, o.clip)
        m = mine.modulus_bits
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "secagg-round", self.device or "", message.round))
        codes = fixedpoint.encode(vector, clip=o.clip, value_bits=o.bits, modulus_bits=m, generator=generator)
        masked = _add(codes, prg.mask(mine.b_seed, len(codes), m), m)
        for v in sorted(mine.inbox):  # neighbours that shared: pairwise masks cancel in the sum
            seed = keys.pairwise_mask_seed(mine.s_key.agree(mine.s_pks[v]), message.round, _context(mine.federation))
            pair = prg.mask(seed, len(codes), m)
            masked = _add(masked, pair, m) if (self.device or "") < v else _sub(masked, pair, m)
        meta = {k: message.meta[k] for k in KEEP_META if k in message.meta}
        meta.update({"num_samples": 1, META: {"layout": layout.to_meta(), "modulus_bits": m}})
        return Message(message.kind, message.round, message.sender, {MASKED: torch.from_numpy(pack_values(masked, m))}, meta,
                       message.message_id)

    # server side ----------------------------------------------------------------------------------
    def prepare(self, run: dict[str, Any]) -> None:
        assert self._server is not None
        self._server.prepare(run)

    def server_stages(self) -> list[Any]:
        assert self._server is not None
        return self._server.stages()

    def download_out(self, device: str, message: Message) -> Message:
        return self._server.download_out(device, message) if self._server is not None else message

    def upload_in(self, message: Message) -> Message:
        return self._server.upload_in(message) if self._server is not None else message

    def collect(self, message: Message) -> Any | None:
        return self._server.collect(message) if self._server is not None else None

    def release(self, round_no: int) -> list[Message]:
        return self._server.release(round_no) if self._server is not None else []

    def round_facts(self, round_no: int) -> dict[str, Any]:
        return self._server.facts(round_no) if self._server is not None else {}


def value_bytes(modulus_bits: int) -> int:
    """Bytes a masked value takes on the wire: ceil(m / 8)."""
    return (modulus_bits + 7) // 8


def pack_values(values: np.ndarray, modulus_bits: int) -> np.ndarray:
    """Values below 2^m as ceil(m / 8) little-endian bytes each (U8, flat): a 40-bit modulus sends
    5 bytes a value, not 8."""
    width = value_bytes(modulus_bits)
    return np.ascontiguousarray(values.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :width]).reshape(-1)


def unpack_values(data: np.ndarray, width: int) -> np.ndarray:
    """The inverse of :func:`pack_values` (uint64)."""
    padded = np.zeros((data.size // width, 8), dtype=np.uint8)
    padded[:, :width] = data.reshape(-1, width)
    return padded.view("<u8").reshape(-1).astype(np.uint64)


def _u8(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def _add(a: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    return (a.astype(np.uint64) + b.astype(np.uint64)) & np.uint64((1 << m) - 1)


def _sub(a: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    return (a.astype(np.uint64) - b.astype(np.uint64)) & np.uint64((1 << m) - 1)



# --- the server side ------------------------------------------------------------------------------
@dataclass
class Taken:
    """A collected upload's receipt (what the round policy answers the device)."""

    status: str
    reason: str = ""


@dataclass
class _Group:
    members: list[str]
    k: int = 0
    t: int = 0
    m: int = 0
    c_pks: dict[str, bytes] = field(default_factory=dict)
    s_pks: dict[str, bytes] = field(default_factory=dict)
    graph: dict[str, list[str]] = field(default_factory=dict)
    xs: dict[str, int] = field(default_factory=dict)
    sealed: dict[tuple[str, str], bytes] = field(default_factory=dict)  # (sender, recipient) -> encrypted share bundle
    shared: set[str] = field(default_factory=set)  # devices that sent shares (U2)
    masked: dict[str, np.ndarray] = field(default_factory=dict)  # device -> masked upload (U3)
    ids: dict[str, str] = field(default_factory=dict)  # device -> the accepted upload's message id
    layout: Layout | None = None
    kept_meta: dict[str, Any] = field(default_factory=dict)


class _ServerSide:
    def __init__(self, owner: SecAgg) -> None:
        self.owner = owner
        self.options: SecAggOptions = owner.options  # type: ignore[assignment]
        self.groups: dict[str, str] = {}
        self.seed = owner.seed
        self.federation = ""
        self.round = -1
        self.state: dict[str, _Group] = {}
        self.released: list[Message] = []

    def prepare(self, run: dict[str, Any]) -> None:
        self.groups = dict(run.get("groups") or {})
        self.seed = int(run.get("seed", self.seed))
        self.federation = str(run.get("federation", ""))
        for name, n in sorted((run.get("expected_per_group") or {}).items()):
            if n > 1:  # said at the start: a small group's round fails at the first device lost after sharing keys
                k, t = _plan(self.options, [str(i) for i in range(n)])
                if k - t < 1:
                    log.warning("secagg: group %s of %d devices a round: each device's masks need %d of its %d neighbours' shares, so "
                                "a round survives no device that drops out after sharing keys (more devices a round tolerate some; "
                                "docs/secure-aggregation.md)", name, n, t, k)

    def stages(self) -> list[Stage]:
        return [_KeysStage(self), _SharesStage(self), _UnmaskStage(self)]

    def group_of(self, device: str) -> _Group:
        return self.state[self.groups.get(device, "all")]

    # stage 1: keys
    def begin(self, round_no: int, participants: list[str]) -> None:
        if self.round == round_no:
            return
        self.round, self.state, self.released = round_no, {}, []
        for device in participants:
            self.state.setdefault(self.groups.get(device, "all"), _Group([])).members.append(device)

    # stage 2: the graph of the devices that sent keys
    def plan(self, round_no: int) -> None:
        for name, g in self.state.items():
            if g.graph:
                continue
            ids = sorted(g.c_pks)
            g.k, g.t = _plan(self.options, ids) if len(ids) > 1 else (0, 0)
            g.m = fixedpoint.modulus_bits_for(max(len(ids), 1), self.options.bits)
            g.graph = graph.neighbours(ids, g.k, seed=derive_seed(self.seed, "secagg-graph", name), round_no=round_no) if len(ids) > 1 else {}
            g.xs = {d: i + 1 for i, d in enumerate(ids)}

    # training
    def download_out(self, device: str, message: Message) -> Message:
        if message.round != self.round or self.groups.get(device, "all") not in self.state:
            return message
        g = self.group_of(device)
        if device not in g.shared:
            return message
        senders = [u for u in g.graph.get(device, []) if (u, device) in g.sealed]
        bundles = [g.sealed[(u, device)] for u in senders]
        width = max((len(b) for b in bundles), default=0)
        sealed = torch.zeros(len(bundles), width, dtype=torch.uint8)
        for j, b in enumerate(bundles):
            sealed[j, : len(b)] = torch.tensor(list(b), dtype=torch.uint8)
        return Message(message.kind, message.round, message.sender, {**message.tensors, INBOX: sealed},
                       {**message.meta, META: {"from": senders, "widths": [len(b) for b in bundles]}}, message.message_id)

    def upload_in(self, message: Message) -> Message:
        if message.kind not in KINDS:
            return message
        info = message.meta.get(META)
        masked = message.tensors.get(MASKED)
        if masked is None or not isinstance(info, dict) or set(message.tensors) != {MASKED}:
            raise PayloadError("this run uses secure aggregation: an upload is one masked vector (.secagg/masked) with its layout "
                               "(is the device running the run's [[filters]]?)")
        if self.groups.get(message.sender, "all") not in self.state or message.round != self.round:
            raise PayloadError(f"secagg: no secure aggregation of round {message.round} is open for {message.sender}")
        g = self.group_of(message.sender)
        try:
            layout = Layout.from_meta(info.get("layout"), MAX_VECTOR)
        except ValueError as exc:
            raise PayloadError(f"secagg: {exc}") from None
        width = value_bytes(g.m)
        if masked.dtype != torch.uint8 or masked.dim() != 1 or masked.numel() != layout.length * width or info.get("modulus_bits") != g.m:
            raise PayloadError(f"secagg: the masked vector is U8 [{layout.length} x {width}] (its layout's values, {width} "
                               f"little-endian bytes each for modulus 2^{g.m})")
        values = unpack_values(masked.numpy(), width)
        if values.size and int(values.max()) >= 1 << g.m:
            raise PayloadError(f"secagg: masked values lie in [0, 2^{g.m})")
        if g.layout is not None and layout != g.layout:
            raise PayloadError("secagg: this upload's layout differs from its group's")
        # the server works on the values (I64: what the upload checks take) from here on
        return Message(message.kind, message.round, message.sender, {MASKED: torch.from_numpy(values.astype(np.int64))},
                       message.meta, message.message_id)

    def collect(self, message: Message) -> Taken | None:
        if MASKED not in message.tensors:
            return None
        g = self.group_of(message.sender)
        if message.sender in g.ids:
            same = g.ids[message.sender] == message.message_id
            return Taken("duplicate") if same else Taken("rejected", "one masked upload per device per round")
        if message.sender not in g.shared:
            return Taken("rejected", f"{message.sender} sent no shares in round {message.round}: its masks could not be removed")
        g.layout = g.layout or Layout.from_meta(message.meta[META]["layout"], MAX_VECTOR)
        g.masked[message.sender] = message.tensors[MASKED].numpy().astype(np.uint64)
        g.ids[message.sender] = message.message_id
        return Taken("accepted")

    def release(self, round_no: int) -> list[Message]:
        out, self.released = self.released, []
        return out

    def facts(self, round_no: int) -> dict[str, Any]:
        """The round's secure aggregation, per group: devices with keys, that shared, whose masked
        upload is in the sum, and those that dropped after sharing (their masks removed)."""
        if round_no != self.round:
            return {}
        return {"secured": True, "groups": {name: {"keys": len(g.c_pks), "shared": len(g.shared), "summed": len(g.masked),
                                                   "dropped_after_sharing": sorted(g.shared - set(g.masked)),
                                                   "neighbours": g.k, "threshold": g.t, "modulus_bits": g.m}
                                            for name, g in sorted(self.state.items())}}




def _check_u8(tensor: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    return tensor is not None and tensor.dtype == torch.uint8 and tuple(tensor.shape) == shape


class _SecAggStage(Stage):
    def __init__(self, side: _ServerSide) -> None:
        self.side = side
        self.deadline_s = side.options.stage_deadline_s
        self.quorum = 0.0  # one answer; the stage's own checks (a threshold of shares per secret, per group) decide the rest


class _KeysStage(_SecAggStage):
    name = "secagg-keys"
    when = "before"

    def request(self, round_no: int, device: str, participants: list[str]) -> Message | None:
        self.side.begin(round_no, participants)
        return Message("stage", round_no, "server", {}, {"federation": self.side.federation})

    def check(self, round_no: int, device: str, reply: Message) -> str | None:
        if set(reply.tensors) != {"c_pk", "s_pk"} or not all(_check_u8(reply.tensors[k], (KEY_BYTES,)) for k in ("c_pk", "s_pk")):
            return "secagg-keys: a reply holds c_pk and s_pk, U8 [32] each"
        return None

    def close(self, round_no: int, replies: dict[str, Message], dropped: list[str]) -> None:
        for device, reply in replies.items():
            g = self.side.group_of(device)
            g.c_pks[device] = bytes(reply.tensors["c_pk"].tolist())
            g.s_pks[device] = bytes(reply.tensors["s_pk"].tolist())
        for name, g in self.side.state.items():
            if len(g.c_pks) == 1:
                raise StageFailed(f"secagg: group {name} has one device with keys: its upload would be its sum")


class _SharesStage(_SecAggStage):
    name = "secagg-shares"
    when = "before"

    def request(self, round_no: int, device: str, participants: list[str]) -> Message | None:
        self.side.plan(round_no)
        g = self.side.group_of(device)
        ids = g.graph.get(device, [])
        return Message("stage", round_no, "server", {
            "c_pk": torch.tensor([list(g.c_pks[i]) for i in ids], dtype=torch.uint8).reshape(len(ids), KEY_BYTES),
            "s_pk": torch.tensor([list(g.s_pks[i]) for i in ids], dtype=torch.uint8).reshape(len(ids), KEY_BYTES)},
            {"neighbours": ids, "x": {i: g.xs[i] for i in [*ids, device]}, "threshold": g.t, "modulus_bits": g.m})

    def check(self, round_no: int, device: str, reply: Message) -> str | None:
        ids = self.side.group_of(device).graph.get(device, [])
        sealed, width = reply.tensors.get("sealed"), reply.meta.get("width")
        if reply.meta.get("to") != ids or sealed is None or sealed.dtype != torch.uint8 or sealed.dim() != 2 \
                or sealed.shape[0] != len(ids) or not isinstance(width, int) or not 0 < width <= sealed.shape[1] <= 4096:
            return "secagg-shares: a reply holds one sealed share bundle (U8 row) per neighbour, in the request's order"
        return None

    def close(self, round_no: int, replies: dict[str, Message], dropped: list[str]) -> None:
        for device, reply in replies.items():
            g = self.side.group_of(device)
            width = int(reply.meta["width"])
            for j, v in enumerate(reply.meta["to"]):
                g.sealed[(device, v)] = bytes(reply.tensors["sealed"][j, :width].tolist())
            g.shared.add(device)


class _UnmaskStage(_SecAggStage):
    name = "secagg-unmask"
    when = "after"

    def __init__(self, side: _ServerSide) -> None:
        super().__init__(side)
        self.asked: dict[str, tuple[list[str], list[str]]] = {}

    def request(self, round_no: int, device: str, participants: list[str]) -> Message | None:
        g = self.side.group_of(device)
        mine = [u for u in g.graph.get(device, []) if (u, device) in g.sealed]
        survivors = [u for u in mine if u in g.masked]
        dropped = [u for u in mine if u in g.shared and u not in g.masked]
        self.asked[device] = (survivors, dropped)
        return Message("stage", round_no, "server", {}, {"survivors": survivors, "dropped": dropped})

    def check(self, round_no: int, device: str, reply: Message) -> str | None:
        survivors, dropped = self.asked.get(device, ([], []))
        b, s = reply.tensors.get("b_shares"), reply.tensors.get("s_shares")
        if reply.meta.get("survivors") != survivors or reply.meta.get("dropped") != dropped or b is None or s is None \
                or b.dtype != torch.uint8 or s.dtype != torch.uint8 or b.dim() != 2 or s.dim() != 2 \
                or tuple(b.shape) != (len(survivors), shamir.SHARE_BYTES) or tuple(s.shape) != (len(dropped), shamir.SHARE_BYTES):
            return "secagg-unmask: a reply holds one share per device it was asked about, in the request's order"
        return None

    def close(self, round_no: int, replies: dict[str, Message], dropped_now: list[str]) -> None:
        side = self.side
        b_parts: dict[str, dict[int, bytes]] = {}
        s_parts: dict[str, dict[int, bytes]] = {}
        for device, reply in replies.items():
            x = side.group_of(device).xs[device]
            survivors, dropped = self.asked[device]
            for j, u in enumerate(survivors):
                b_parts.setdefault(u, {})[x] = bytes(reply.tensors["b_shares"][j].tolist())
            for j, u in enumerate(dropped):
                s_parts.setdefault(u, {})[x] = bytes(reply.tensors["s_shares"][j].tolist())
        self.asked = {}
        for name, g in side.state.items():
            if not g.masked:
                continue
            if len(g.masked) < 2:
                raise StageFailed(f"secagg: only one device of group {name} uploaded: its sum would be its upload")
            side.released.append(_unmasked_sum(side, name, g, b_parts, s_parts, round_no))


def _reconstruct(parts: dict[int, bytes], t: int, what: str) -> bytes:
    if len(parts) < t:
        raise StageFailed(f"secagg: {what} needs {t} shares, {len(parts)} arrived (fewer than the threshold survived)")
    try:
        return shamir.combine(parts, t)
    except ValueError as exc:
        raise StageFailed(f"secagg: {what}: {exc}") from None


def _unmasked_sum(side: _ServerSide, name: str, g: _Group, b_parts: dict[str, dict[int, bytes]],
                  s_parts: dict[str, dict[int, bytes]], round_no: int) -> Message:
    """The group's sum: the masked uploads minus every survivor's self mask and minus the pair
    masks survivors added for neighbours that dropped after sharing; decoded and turned into the
    message the server half receives."""
    assert g.layout is not None
    m = g.m
    length = g.layout.length
    total = np.zeros(length, dtype=np.uint64)
    for u in sorted(g.masked):
        total = _add(total, g.masked[u], m)
        b_seed = _reconstruct(b_parts.get(u, {}), g.t, f"the self mask of {u}")
        total = _sub(total, prg.mask(b_seed, length, m), m)
    for w in sorted(g.shared - set(g.masked)):
        if not any((w, v) in g.sealed for v in g.masked):
            continue
        s_key = keys.KeyPair.from_private_bytes(_reconstruct(s_parts.get(w, {}), g.t, f"the mask key of {w} (dropped)"))
        for v in sorted(g.masked):
            if (w, v) not in g.sealed:
                continue  # v never added a mask for w
            pair = prg.mask(keys.pairwise_mask_seed(s_key.agree(g.s_pks[v]), round_no, _context(side.federation)), length, m)
            total = _sub(total, pair, m) if v < w else _add(total, pair, m)
    try:
        values = fixedpoint.decode_sum(total, count=len(g.masked), clip=side.options.clip, value_bits=side.options.bits, modulus_bits=m)
    except ValueError as exc:  # masks that did not cancel: a device or the server broke the protocol
        raise StageFailed(f"secagg: group {name}'s sum could not be decoded: {exc}") from None
    stand_in = min(d for d, grp in side.groups.items() if grp == name) if side.groups else sorted(g.masked)[0]
    message = from_sum(values.to(torch.float64), g.layout, round_no, stand_in, len(g.masked))
    log.info("secagg: group %s round %d: the sum of %d uploads (%d dropped after sharing)", name, round_no, len(g.masked),
             len(g.shared) - len(g.masked))
    return message
