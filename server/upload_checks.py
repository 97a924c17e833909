"""Method-independent checks of a decoded upload: its meta numbers and its tensors' values.

A device's numbers reach the headline accuracy, the metrics and the weighting of averages, so
every one is range-checked here before a method sees the upload (docs/PROTOCOL.md sections 4.3 and 7):

* ``num_samples``: an integer in 1..:data:`MAX_SAMPLES`;
* ``eval_accuracy``: a number in [0, 1] (``1`` as well as ``1.0``); ``train_loss``: finite;
  ``temperature``: finite and positive, or null; ``latent``: an integer in 1..4096;
* class counts: ``meta.class_counts`` (the device's labels) non-negative integers, one per class
  at most, summing to no more than ``num_samples``; a ``counts`` tensor (samples seen in
  training, every epoch) to no more than ``num_samples`` x ``epochs``;
* any other number anywhere in the meta: finite; strings at most :data:`MAX_STRING` characters;
* tensors: floating ones F32 (the wire's only float type), finite and within ``max_abs``;
  integer ones I64; masks BOOL.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from edgefl.messages import Message

MAX_SAMPLES = 10**9
MAX_STRING = 256
MAX_META_KEYS = 64
TENSOR_DTYPES = {torch.float32, torch.int64, torch.bool}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _free_form_problem(value: Any, where: str) -> str | None:
    """Numbers finite and strings short anywhere in a meta value (the JSON decoder bounds depth)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return None if math.isfinite(value) and abs(value) <= 1e300 else f"meta {where} must be a finite number"
    if isinstance(value, str):
        return None if len(value) <= MAX_STRING else f"meta {where} is longer than {MAX_STRING} characters"
    if isinstance(value, list):
        for i, item in enumerate(value[:100_000]):
            problem = _free_form_problem(item, f"{where}[{i}]")
            if problem:
                return problem
        return None if len(value) <= 100_000 else f"meta {where} has more than 100000 items"
    if isinstance(value, dict):
        for key, item in value.items():
            problem = _free_form_problem(item, f"{where}.{str(key)[:32]}")
            if problem:
                return problem
        return None
    return f"meta {where} has an unsupported type"


def meta_problem(meta: dict[str, Any], num_classes: int | None) -> str | None:
    if len(meta) > MAX_META_KEYS:
        return f"meta has {len(meta)} keys (at most {MAX_META_KEYS})"
    n = meta.get("num_samples")
    if not _count(n) or not 0 < n <= MAX_SAMPLES:
        return f"num_samples must be an integer in 1..{MAX_SAMPLES}, got {str(n)[:40]}"
    accuracy = meta.get("eval_accuracy")
    if accuracy is not None and (not _number(accuracy) or not 0.0 <= float(accuracy) <= 1.0):
        return f"eval_accuracy must be a number in [0, 1], got {str(accuracy)[:40]}"
    loss = meta.get("train_loss")
    if loss is not None and (not _number(loss) or not math.isfinite(float(loss))):
        return f"train_loss must be a finite number, got {str(loss)[:40]}"
    spent = meta.get("dp_sgd_epsilon")  # DP-SGD: the device's epsilon so far (null: no noise, infinite)
    if spent is not None and (not _number(spent) or not 0.0 <= float(spent) <= 1e6):
        return f"dp_sgd_epsilon must be null or a number in [0, 1e6], got {str(spent)[:40]}"
    temperature = meta.get("temperature")
    if temperature is not None and (not _number(temperature) or not 0 < float(temperature) < 1e6):
        return f"temperature must be a positive number, got {str(temperature)[:40]}"
    latent = meta.get("latent")
    if latent is not None and (not _count(latent) or not 1 <= latent <= 4096):
        return f"latent must be an integer in 1..4096, got {str(latent)[:40]}"
    arch = meta.get("arch")
    if arch is not None and (not isinstance(arch, str) or len(arch) > 64):
        return "arch must be a name of at most 64 characters"
    counts = meta.get("class_counts")
    if counts is not None:
        if not isinstance(counts, list) or not all(_count(c) for c in counts):
            return "class_counts must be a list of non-negative integers"
        problem = _counts_problem(counts, n, num_classes)
        if problem:
            return problem
    for key, value in meta.items():
        if not isinstance(key, str) or len(key) > 64:
            return "meta keys are names of at most 64 characters"
        problem = _free_form_problem(value, key)
        if problem:
            return problem
    return None


def _counts_problem(counts: list[int], num_samples: int, num_classes: int | None, epochs: int = 1) -> str | None:
    if num_classes is not None and len(counts) > num_classes:
        return f"{len(counts)} class counts for {num_classes} classes"
    if sum(counts) > num_samples * epochs:
        return (f"class counts sum to {sum(counts)}, more than num_samples = {num_samples}"
                + (f" x {epochs} epochs" if epochs > 1 else ""))
    return None


def tensor_problem(message: Message, num_classes: int | None, max_abs: float, epochs: int = 1) -> str | None:
    for name, t in message.tensors.items():
        if t.dtype not in TENSOR_DTYPES:
            return f"{name} is {str(t.dtype).removeprefix('torch.')}: uploads carry F32, I64 or BOOL tensors"
        if t.is_floating_point() and t.numel():
            if not bool(torch.isfinite(t).all()):
                return f"{name} holds NaN or Inf"
            if float(t.abs().max()) > max_abs:
                return f"{name} holds values beyond +-{max_abs:g}"
        if (name == "counts" or name.endswith(".counts")) and t.numel():
            if t.dtype != torch.int64 or t.dim() != 1 or bool((t < 0).any()):
                return f"{name} must be non-negative I64 counts"
            problem = _counts_problem(t.tolist(), message.meta["num_samples"], num_classes, epochs)
            if problem:
                return problem
    return None


def upload_problem(message: Message, num_classes: int | None, max_abs: float, epochs: int = 1) -> str | None:
    """Why ``message`` cannot be used, whatever its method; None when it passes."""
    return meta_problem(message.meta, num_classes) or tensor_problem(message, num_classes, max_abs, epochs)
