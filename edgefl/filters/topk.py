"""``topk``: an upload's weights as the k largest entries of their change, with error feedback.

Each round the server sends a device weights ``w0`` and the device uploads trained weights ``w``.
For every floating-point tensor with a reference (the same name and shape in the download of
this round, at least ``min_numel`` values, not under ``dense_prefixes``), the device keeps a
residual ``e`` (zero at first) and sends only::

    d = w - w0 + e        the change of this round plus what earlier rounds held back
    s = top_k(d)          d at its k entries of largest |d|, zero elsewhere
    e = d - s             held back on the device, added to next round's change

and the server rebuilds ``w0 + s``. This is error feedback ("memory") as in Stich, Cordonnier &
Jaggi, *Sparsified SGD with memory* (NeurIPS 2018) and Lin et al., *Deep Gradient Compression*
(ICLR 2018), applied to each round's model change as federated compression does (Sattler et
al., *Sparse Ternary Compression*, 2019): nothing is dropped, only delayed. Over rounds the sent
changes add up to the true changes minus the residual still held (``sum s_t = sum (w_t - w0_t) -
e_T``), and a coordinate whose change is small on every round is sent once it has added up.
When a tensor goes dense (no reference this round), it is sent with its residual added
(``w + e``) and the residual restarts at zero. The residual is device state: it survives a crash
(:meth:`TopKFilter.carry_state`); an upload lost after the device computed it loses its kept part.

Wire: tensor ``NAME`` becomes ``.topk.index/NAME`` (I32 flat row-major positions, strictly
increasing; I64 for a tensor of 2**31 values or more) and ``.topk.value/NAME`` (F32 ``d`` at
those positions). The shape comes from the server's own copy of the reference, never from the
message. Dense tensors travel under their own names.

Both sides must hold the same reference, or the server would silently rebuild the wrong weights.
The server clones every weight tensor it sends (the server half may change its own in place) and
tags the download with a digest of them (``meta["filter.topk"] = {"ref": <blake2b hex>}``); the
device computes the same digest of what it received and uses the reference only when they agree
(a later filter in the chain that changed the download, or a download from another round, means
dense uploads, never wrong ones), and echoes the digest in its upload; the server refuses sparse
tensors whose digest is not the one it holds for that device. Devices sent the same tensors share
one clone on the server (a device costs a dict entry, not a model copy), and references older
than the previous round are dropped.

Cost on the device: two extra model copies (the reference and the residual), a digest and a top-k
per round. Put ``topk`` before ``quantize`` in ``[[filters]]``: quantize then codes the values
(the quantisation error of the values is not fed back).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pydantic import Field, StrictInt, model_validator

from edgefl.errors import PayloadError
from edgefl.filters._common import check_unreserved, pop_meta, quoted, rebuilt
from edgefl.filters.base import Filter, FilterOptions, Side
from edgefl.messages import SAFETENSORS_DTYPES, Message

if TYPE_CHECKING:
    from edgefl.methods import MethodSpec

log = logging.getLogger("edgefl.filters")

RESERVED = ".topk"
INDEX = ".topk.index/"
VALUE = ".topk.value/"
META_KEY = "filter.topk"
RESIDUAL = "residual."  # carry_state names
#: message kinds that carry model weights (edgefl.messages.MESSAGE_KINDS)
WEIGHT_KINDS = ("weights", "class_features", "head")
#: what a method uploads instead, for the refusal
NOT_WEIGHTS = {"class_logits": "per-class logits", "decoder": "CVAE decoders trained from scratch",
               "status": "no tensors (only its status)"}
DIGEST = re.compile(r"[0-9a-f]{32}")


class TopKOptions(FilterOptions):
    fraction: float = Field(0.01, gt=0, le=1, description="share of each sparsified tensor's values sent per round (ceil, at least 1)")
    k: StrictInt | None = Field(None, ge=1, description="values sent per tensor instead of fraction (at most the tensor's size)")
    min_numel: StrictInt = Field(1024, ge=1, description="tensors with fewer values go dense (biases, norms: small, and sensitive)")
    dense_prefixes: list[str] = Field(
        ["class.", "pairs."], description="tensor names sent dense whatever their size: data, not weights "
                                           "(Felo's per-class knowledge, FedIN's feature pairs)")

    @model_validator(mode="after")
    def _one_count(self) -> TopKOptions:
        if self.k is not None and "fraction" in self.model_fields_set:
            raise ValueError("set fraction or k, not both")
        return self

    def keep(self, numel: int) -> int:
        """How many of a tensor's ``numel`` values are sent (the server expects exactly this)."""
        wanted = self.k if self.k is not None else math.ceil(self.fraction * numel - 1e-9)  # 0.07 * 100 is 7.000000000000001
        return max(1, min(wanted, numel))


def tensor_digest(t: torch.Tensor) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{SAFETENSORS_DTYPES[t.dtype]}{list(t.shape)}".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.digest()


def reference_digest(digests: dict[str, bytes]) -> str:
    """The digest of a reference (its tensors' names and digests, in name order)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        raw = name.encode("utf-8", "surrogatepass")
        h.update(len(raw).to_bytes(4, "little") + raw + digests[name])
    return h.hexdigest()


@dataclass
class _Shared:
    """One server-side clone of a sent tensor, shared by every device that got the same values."""

    tensor: torch.Tensor
    digest: bytes


@dataclass
class _Reference:
    round: int
    digest: str
    tensors: dict[str, torch.Tensor]


class TopKFilter(Filter):
    name = "topk"
    Options = TopKOptions
    summary = "uploads' weight changes as their k largest entries, the rest kept on the device and added next round"
    options: TopKOptions

    def __init__(self, options: FilterOptions, *, side: Side, seed: int, device: str | None = None) -> None:
        super().__init__(options, side=side, seed=seed, device=device)
        # device side
        self.reference: _Reference | None = None
        self.residual: dict[str, torch.Tensor] = {}
        # server side
        self.sent: dict[str, _Reference] = {}  # device -> what it was last sent
        self._shared: dict[tuple, _Shared] = {}  # (address, shape, dtype, device) -> clone, this round's sends
        self._shared_round = -1

    @classmethod
    def refusal(cls, options: FilterOptions, spec: MethodSpec, **run: object) -> str | None:
        if not set(spec.uploads) & set(WEIGHT_KINDS):
            what = ", ".join(NOT_WEIGHTS.get(kind, kind) for kind in spec.uploads)
            return f"{spec.name} uploads {what}, not weights: top-k sparsifies weight changes; use quantize"
        if not set(spec.downloads) & set(WEIGHT_KINDS):
            return f"{spec.name}'s server sends no weights to take changes against: every upload would go dense; use quantize"
        if spec.one_shot:
            return (f"{spec.name} is one-shot: what top-k holds back would never be sent (error feedback needs "
                    f"later rounds); use quantize")
        if run.get("mode") == "async":
            return ('top-k takes changes against what each device was sent in the current or previous round; an '
                    'asynchronous run numbers every download, so a device\'s reference is gone before it reports: use '
                    'mode = "sync", or quantize')
        return None

    def _referable(self, name: str, t: torch.Tensor) -> bool:
        """A tensor both sides keep as a reference (the same rule on both: the digest covers these)."""
        return t.is_floating_point() and t.numel() >= self.options.min_numel and not name.startswith(tuple(self.options.dense_prefixes))

    # --- device --------------------------------------------------------------------------------
    def download_in(self, message: Message) -> Message:
        meta, entry = pop_meta(message, META_KEY)
        if entry is None:
            return message  # not tagged by the server's topk (nothing to keep): the reference stays
        sent = entry.get("ref")
        if set(entry) != {"ref"} or not isinstance(sent, str) or not DIGEST.fullmatch(sent):
            raise PayloadError(f"meta {META_KEY!r} must be {{\"ref\": <32 hex digits>}}")
        kept = {name: t for name, t in message.tensors.items() if self._referable(name, t)}
        if reference_digest({name: tensor_digest(t) for name, t in kept.items()}) == sent:
            # a copy: the client half may load these very tensors into the model it trains
            self.reference = _Reference(message.round, sent, {n: t.detach().to("cpu", torch.float32, copy=True) for n, t in kept.items()})
        else:
            log.warning("%s: round %d download differs from what the server's topk filter sent (a filter after topk in "
                        "[[filters]] changed it?): this round's upload goes dense", self.device, message.round)
            self.reference = None
        return rebuilt(message, message.tensors, meta)

    def upload_out(self, message: Message) -> Message:
        check_unreserved(message, RESERVED, self.name)
        # only this round's reference: the server keeps a device's latest and drops older rounds
        ref = self.reference.tensors if self.reference is not None and self.reference.round == message.round else {}
        tensors: dict[str, torch.Tensor] = {}
        for name, t in message.tensors.items():
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                tensors[name] = t  # integers, masks; NaN/Inf as they are, for the server's checks to name
                continue
            residual = self.residual.pop(name, None)
            if residual is not None and residual.shape != t.shape:
                residual = None  # another model's tensor of that name: its residual means nothing here
            base = ref.get(name)
            k = self.options.keep(t.numel())
            if base is None or base.shape != t.shape or 2 * k >= t.numel():  # 2k: index + value cost 8 bytes a value, dense 4
                tensors[name] = t if residual is None else (t.detach().to(torch.float32) + residual).to(t.dtype)
                continue
            # contiguous: flat below must be a view of it (a channels-last t would give a strided result)
            change = (t.detach().to(torch.float32) - base).contiguous()
            if residual is not None:
                change += residual
            flat = change.reshape(-1)
            index = flat.abs().topk(k, sorted=False).indices.sort().values
            tensors[INDEX + name] = index.to(torch.int32 if t.numel() < 2**31 else torch.int64)
            tensors[VALUE + name] = flat[index].clone()
            flat[index] = 0.0
            self.residual[name] = change
        meta = {key: v for key, v in message.meta.items() if key != META_KEY}
        if any(name.startswith(INDEX) for name in tensors):
            meta[META_KEY] = {"ref": self.reference.digest}  # type: ignore[union-attr]  (sparse only with a reference)
        return rebuilt(message, tensors, meta)

    def carry_state(self) -> dict[str, torch.Tensor]:
        return {RESIDUAL + name: t.clone() for name, t in self.residual.items()}

    def load_carry_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.residual = {name.removeprefix(RESIDUAL): t.to(torch.float32) for name, t in tensors.items()
                         if name.startswith(RESIDUAL) and t.is_floating_point()}

    # --- server --------------------------------------------------------------------------------
    def download_out(self, device: str, message: Message) -> Message:
        if message.round > self._shared_round:
            # a new round: this round's sends share among themselves; references older than the
            # previous round can no longer be used (a device uses only its round's reference)
            self._shared, self._shared_round = {}, message.round
            self.sent = {d: ref for d, ref in self.sent.items() if ref.round >= message.round - 1}
        kept = {name: self._share(t) for name, t in message.tensors.items() if self._referable(name, t)}
        if not kept:
            return message
        digest = reference_digest({name: s.digest for name, s in kept.items()})
        self.sent[device] = _Reference(message.round, digest, {name: s.tensor for name, s in kept.items()})
        return rebuilt(message, message.tensors, {**message.meta, META_KEY: {"ref": digest}})

    def _share(self, t: torch.Tensor) -> _Shared:
        """The clone of ``t`` for the reference: the one already made this round when ``t`` is the
        same memory with the same values (checked: the server half may have changed it in place)."""
        t = t.detach()
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, str(t.device))
        held = self._shared.get(key)
        here = t.cpu()
        if held is not None and torch.equal(held.tensor, here):
            return held
        clone = here.clone()
        held = self._shared[key] = _Shared(clone, tensor_digest(clone))
        return held

    def upload_in(self, message: Message) -> Message:
        meta, entry = pop_meta(message, META_KEY)
        given = message.tensors
        sparse = [name for name in given if name.startswith(INDEX)]
        for name in given:
            if name.startswith(VALUE) and INDEX + name[len(VALUE):] not in given:
                raise PayloadError(f"{quoted(name)}: values without indices ({quoted(INDEX + name[len(VALUE):])} is missing)")
            if name.startswith(INDEX) and VALUE + name[len(INDEX):] not in given:
                raise PayloadError(f"{quoted(name)}: indices without values ({quoted(VALUE + name[len(INDEX):])} is missing)")
            if name.startswith(RESERVED) and not name.startswith((INDEX, VALUE)):
                raise PayloadError(f"{quoted(name)}: not a name the topk filter sends ({INDEX!r} or {VALUE!r} + name)")
        if not sparse:
            return rebuilt(message, dict(given), meta)
        claimed = None if entry is None else entry.get("ref")
        if entry is None or set(entry) != {"ref"} or not isinstance(claimed, str) or not DIGEST.fullmatch(claimed):
            raise PayloadError(f"sparse tensors need meta {META_KEY!r} = {{\"ref\": <the digest of the download they change>}}")
        ref = self.sent.get(message.sender)
        if ref is None:
            raise PayloadError(f"sparse tensors from {quoted(message.sender)}, which holds no weights this server sent "
                               f"(in this round or the previous one, since it started)")
        if claimed != ref.digest:
            raise PayloadError(f"sparse tensors computed against weights other than the last ones sent to "
                               f"{quoted(message.sender)} (round {ref.round})")
        tensors: dict[str, torch.Tensor] = {}
        for name, t in given.items():
            if name.startswith(VALUE):
                continue
            if not name.startswith(INDEX):
                tensors[name] = t
                continue
            base = name[len(INDEX):]
            if base in given:
                raise PayloadError(f"{quoted(base)} arrives both dense and sparse")
            if base not in ref.tensors:
                raise PayloadError(f"sparse {quoted(base)}: not a tensor of the weights sent to {quoted(message.sender)}")
            tensors[base] = self._rebuild(base, ref.tensors[base], t, given[VALUE + base])
        return rebuilt(message, tensors, meta)

    def _rebuild(self, name: str, base: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        where = f"sparse {quoted(name)}"
        numel = base.numel()
        index_dtype = torch.int32 if numel < 2**31 else torch.int64
        if index.dtype != index_dtype or index.dim() != 1:
            raise PayloadError(f"{where}: indices must be a 1-D {SAFETENSORS_DTYPES[index_dtype]} tensor, got "
                               f"{SAFETENSORS_DTYPES.get(index.dtype, index.dtype)} of shape {list(index.shape)}")
        if values.dtype != torch.float32 or values.dim() != 1:
            raise PayloadError(f"{where}: values must be a 1-D F32 tensor, got {SAFETENSORS_DTYPES.get(values.dtype, values.dtype)} "
                               f"of shape {list(values.shape)}")
        k = self.options.keep(numel)
        if index.numel() != k or values.numel() != k:
            raise PayloadError(f"{where}: {index.numel()} indices and {values.numel()} values, the options keep {k} "
                               f"of its {numel}")
        if int(index.min()) < 0 or int(index.max()) >= numel:
            raise PayloadError(f"{where}: an index outside 0..{numel - 1}")
        if k > 1 and not bool((index[1:] > index[:-1]).all()):
            raise PayloadError(f"{where}: indices must be strictly increasing (sorted, no repeats)")
        if not bool(torch.isfinite(values).all()):
            raise PayloadError(f"{where}: a value is NaN or Inf")
        out = base.to(torch.float32, copy=True).reshape(-1)  # the shared clone stays as it was sent
        out[index.long()] += values
        return out.view(base.shape)
