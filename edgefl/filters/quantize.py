"""``quantize``: an upload's floating-point tensors as 8- or 16-bit integer codes with scales.

On the device (:meth:`QuantizeFilter.upload_out`) every non-empty, finite floating-point tensor
``NAME`` is replaced by two::

    .quantize/NAME        the codes: I8 (bits = 8) or I16 (bits = 16), NAME's shape
    .quantize.scale/NAME  F32 [n]: the scales, one per block of ``block_size`` consecutive values
                          of the flattened (row-major) tensor, n = ceil(numel / block_size); or
                          n = 1 (granularity = "tensor")

and the server (:meth:`QuantizeFilter.upload_in`) puts back ``NAME = code * scale`` (F32, or the
dtype the device recorded in ``meta["filter.quantize"]["dtypes"]`` for a tensor that was not F32;
the entry is removed before the upload checks see the meta). Integer tensors (class ids, counts),
masks, empty tensors and tensors holding NaN/Inf travel as they are: the last ones so the
server's upload checks refuse them with their real reason rather than a quantised garbage.

The codes are symmetric (no zero point: weights, deltas, logits and features centre near zero):
``scale = max|x| / q`` over the block with ``q = 2**(bits-1) - 1`` (127 or 32767) and
``code = round(x / scale)`` in [-q, q], so every value comes back within ``scale / 2``; with
``stochastic_rounding`` the code is ``floor(x / scale + u)``, ``u`` uniform in [0, 1), within
``scale`` and unbiased (its expectation is ``x``), drawn from a generator seeded by (run seed,
device, round, tensor name) so a rerun sends the same bytes.

Why 16 bits are int16 codes with a scale and not float16: one code path and one error bound
(``scale / 2``, about 1.5e-5 of the block's largest value, finer than float16's 2**-11 relative
step near that value), and nothing overflows: float16 turns any value beyond 65504 into Inf,
which the server then refuses. Float16 would keep more relative precision for values far below
the block's largest; blocks are how this filter handles a wide range.

Names: see :mod:`edgefl.filters._common`; everything under ``.quantize`` is this filter's.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field, StrictInt

from edgefl.errors import PayloadError
from edgefl.filters._common import check_unreserved, pop_meta, quoted, rebuilt
from edgefl.filters.base import Filter, FilterOptions
from edgefl.messages import SAFETENSORS_DTYPES, Message
from edgefl.seeding import generator

RESERVED = ".quantize"
CODES = ".quantize/"
SCALES = ".quantize.scale/"
META_KEY = "filter.quantize"
CODE_DTYPES = {8: torch.int8, 16: torch.int16}
#: the float dtypes the device may record for a tensor it quantised (F32 is the default, not recorded)
RECORDED_DTYPES = {SAFETENSORS_DTYPES[d]: d for d in (torch.float16, torch.bfloat16, torch.float64)}
F32_MAX = torch.finfo(torch.float32).max


class QuantizeOptions(FilterOptions):
    bits: Literal[8, 16] = Field(8, description="code width: 8 (I8 codes, about 4x fewer bytes than F32) or 16 (I16, about 2x)")
    granularity: Literal["tensor", "block"] = Field(
        "block", description='one scale per tensor, or one per block_size consecutive values (finer where a tensor has outliers)')
    block_size: StrictInt = Field(256, ge=16, le=65536, description='granularity = "block": values per scale (each scale costs 4 bytes)')
    stochastic_rounding: bool = Field(False, description="round up or down at random, unbiased (seeded: reruns send the same bytes)")


def quantize_tensor(x: torch.Tensor, bits: int, block_size: int | None,
                    gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes of ``x``'s shape, F32 scales [ceil(numel / block_size)]); ``block_size`` None: one scale.
    ``gen``: stochastic rounding from it; None: round to nearest."""
    q = 2 ** (bits - 1) - 1
    flat = x.detach().reshape(-1).to(torch.float32)  # F64 too: its extra bits are far below the codes' step
    n = flat.numel()
    size = n if block_size is None else block_size
    blocks = -(-n // size)
    rows = torch.nn.functional.pad(flat, (0, blocks * size - n)).view(blocks, size)  # zero padding: no effect on max|x|
    scale = rows.abs().amax(dim=1) / q
    y = rows / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)  # an all-zero block: codes 0, scale 0
    codes = torch.round(y) if gen is None else torch.floor(y + torch.rand(y.shape, generator=gen))
    # the clamp only catches float rounding of max|x| / scale a hair above q
    return codes.clamp_(-q, q).reshape(-1)[:n].to(CODE_DTYPES[bits]).view(x.shape), scale


def dequantize_tensor(codes: torch.Tensor, scale: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """F32 ``code * scale`` of ``codes``' shape (the checks on what came over the wire are the caller's)."""
    n = codes.numel()
    per = scale.repeat_interleave(n if block_size is None else block_size)[:n]
    return (codes.reshape(-1).to(torch.float32) * per).view(codes.shape)


def expected_scales(numel: int, block_size: int | None) -> int:
    return 1 if block_size is None else math.ceil(numel / block_size)


class QuantizeFilter(Filter):
    name = "quantize"
    Options = QuantizeOptions
    summary = "uploads' float tensors as 8- or 16-bit integer codes with per-tensor or per-block scales"
    options: QuantizeOptions

    @property
    def _block(self) -> int | None:
        return self.options.block_size if self.options.granularity == "block" else None

    # --- device --------------------------------------------------------------------------------
    def upload_out(self, message: Message) -> Message:
        check_unreserved(message, RESERVED, self.name)
        tensors: dict[str, torch.Tensor] = {}
        dtypes: dict[str, str] = {}
        for name, t in message.tensors.items():
            if not t.is_floating_point() or t.numel() == 0 or not bool(torch.isfinite(t).all()):
                tensors[name] = t
                continue
            gen = generator(self.seed, "quantize", self.device, message.round, name) if self.options.stochastic_rounding else None
            tensors[CODES + name], tensors[SCALES + name] = quantize_tensor(t, self.options.bits, self._block, gen)
            if t.dtype != torch.float32:
                dtypes[name] = SAFETENSORS_DTYPES[t.dtype]
        meta = {k: v for k, v in message.meta.items() if k != META_KEY}
        if dtypes:
            meta[META_KEY] = {"dtypes": dtypes}
        return rebuilt(message, tensors, meta)

    # --- server --------------------------------------------------------------------------------
    def upload_in(self, message: Message) -> Message:
        meta, entry = pop_meta(message, META_KEY)
        dtypes = self._recorded_dtypes(entry)
        given = message.tensors
        tensors: dict[str, torch.Tensor] = {}
        for name, t in given.items():
            if name.startswith(CODES):
                base = name[len(CODES):]
                if not base or base.startswith(RESERVED):
                    raise PayloadError(f"{quoted(name)}: quantised codes must name a tensor outside {RESERVED!r}")
                if base in given:
                    raise PayloadError(f"{quoted(base)} arrives both as it is and quantised")
                values = self._restore(base, t, given.get(SCALES + base))
                tensors[base] = values.to(dtypes.pop(base, torch.float32))
            elif name.startswith(SCALES):
                if CODES + name[len(SCALES):] not in given:
                    raise PayloadError(f"{quoted(name)}: scales without codes ({quoted(CODES + name[len(SCALES):])} is missing)")
            elif name.startswith(RESERVED):
                raise PayloadError(f"{quoted(name)}: not a name the quantize filter sends "
                                   f"({CODES!r} + name for codes, {SCALES!r} + name for scales)")
            else:
                tensors[name] = t
        if dtypes:
            raise PayloadError(f"meta {META_KEY!r} records dtypes for tensors that were not quantised: "
                               f"{', '.join(quoted(n) for n in sorted(dtypes)[:3])}")
        return rebuilt(message, tensors, meta)

    def _recorded_dtypes(self, entry: dict[str, Any] | None) -> dict[str, torch.dtype]:
        if entry is None:
            return {}
        raw = entry.get("dtypes")
        if set(entry) != {"dtypes"} or not isinstance(raw, dict):
            raise PayloadError(f"meta {META_KEY!r} must be {{\"dtypes\": {{name: dtype}}}}")
        out = {}
        for name, dtype in raw.items():
            if dtype not in RECORDED_DTYPES:
                raise PayloadError(f"meta {META_KEY!r}: {quoted(name)} records dtype {str(dtype)[:16]!r}, "
                                   f"not one of {', '.join(RECORDED_DTYPES)}")
            out[name] = RECORDED_DTYPES[dtype]
        return out

    def _restore(self, name: str, codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        bits, block = self.options.bits, self._block
        q = 2 ** (bits - 1) - 1
        where = f"quantised {quoted(name)}"
        if codes.dtype != CODE_DTYPES[bits]:
            raise PayloadError(f"{where}: codes are {SAFETENSORS_DTYPES.get(codes.dtype, codes.dtype)}, "
                               f"bits = {bits} sends {SAFETENSORS_DTYPES[CODE_DTYPES[bits]]}")
        if codes.numel() == 0:
            raise PayloadError(f"{where}: codes are empty (empty tensors travel as they are)")
        if scale is None:
            raise PayloadError(f"{where}: no scales ({quoted(SCALES + name)} is missing)")
        if scale.dtype != torch.float32 or scale.dim() != 1:
            raise PayloadError(f"{where}: scales must be a 1-D F32 tensor, got {SAFETENSORS_DTYPES.get(scale.dtype, scale.dtype)} "
                               f"of shape {list(scale.shape)}")
        want = expected_scales(codes.numel(), block)
        if scale.numel() != want:
            how = "one per tensor" if block is None else f"one per {block} values"
            raise PayloadError(f"{where}: {scale.numel()} scales for {codes.numel()} values, {how} makes {want}")
        if not bool(torch.isfinite(scale).all()):
            raise PayloadError(f"{where}: a scale is NaN or Inf")
        if bool((scale < 0).any()):
            raise PayloadError(f"{where}: a scale is negative")
        if float(scale.max()) * q > F32_MAX:  # exact in float64: 24-bit mantissa times a 15-bit code
            raise PayloadError(f"{where}: a scale of {float(scale.max()):.3g} overflows F32 when multiplied by a code")
        if int(codes.min()) < -q or int(codes.max()) > q:
            raise PayloadError(f"{where}: codes outside [-{q}, {q}]")
        return dequantize_tensor(codes, scale, block)
