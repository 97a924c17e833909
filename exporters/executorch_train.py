"""ExecuTorch training programs (issue 37): a zoo classifier as a ``.pte`` program that runs one
forward and backward pass (cross-entropy inside) in ExecuTorch's runtime, the same C++ runtime a
phone app links, plus its inference program and what a device needs to use both.

The training path is ExecuTorch's (experimental in 1.5): ``torch.export`` of a module returning
``(loss, logits)``, ``torch.export.experimental._export_forward_backward`` (the joint graph: the
program returns the user outputs, then the gradients, then the parameters), ``to_edge`` and
``to_executorch``. The optimiser is not in the program: the runtime's SGD
(``executorch.extension.training.get_sgd_optimizer``; Kotlin ``SGD``, Swift ``SGD``) steps the
program's own parameter tensors with the gradients it returned.

Imported only when a model is exported (torch, executorch); :func:`trainability` answers
``edgefl models``' question without writing anything.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from edgefl.exporters.registry import ExportError

#: the program's method the training step runs (and its metadata methods' suffix)
METHOD = "forward"
#: step parity with PyTorch (float32; the runtime's portable kernels sum in another order)
STEP_RTOL, STEP_ATOL = 1e-4, 1e-5


class TrainStep(nn.Module):
    """What the training program computes: (mean cross-entropy, logits) for a batch and its labels.
    The logits are returned detached: the device reads them (FedHe's per-class logits, accuracy)
    without gradients flowing through a second path."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(x)
        return nn.functional.cross_entropy(logits, y), logits.detach()


class DistillStep(nn.Module):
    """FedHe's loss (docs/methods.md, Eq. 13, ``logit_loss = "mse"``): cross-entropy plus ``alpha``
    times the batch mean of each sample's mean squared distance to its class's server logits,
    counted only where ``has`` is 1. ``teacher`` [B, C] (the server's logits of each sample's
    class), ``has`` [B] and ``alpha`` [1] are inputs: with ``has`` all zeros it is plain
    cross-entropy (FedHe's warm-up rounds), so one program serves every round."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor, teacher: torch.Tensor, has: torch.Tensor,
                alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(x)
        per_sample = ((logits - teacher) ** 2).mean(dim=1)
        loss = nn.functional.cross_entropy(logits, y) + alpha[0] * (per_sample * has).sum() / logits.shape[0]
        return loss, logits.detach()


@dataclass
class TrainingProgram:
    buffer: bytes
    parameters: list[dict[str, Any]]  # in the program's order: program_name, state_dict_name, shape
    frozen: list[str]  # state dict entries baked into the program as constants (buffers)
    export_seconds: float
    rewritten: list[str]  # max pools exported as reshape + amax (see MaxPoolByAmax)


def _why(exc: BaseException) -> str:
    """One line saying what ExecuTorch's training path lacked."""
    text = str(exc)
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Operator ") or "not in Core ATen" in line or "missing" in line.lower():
            return line.rstrip('."') + f" ({type(exc).__name__})"
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return f"{type(exc).__name__}: {first[:300]}"


def _reason_hint(reason: str) -> str:
    if "batch_norm" in reason:
        return ("batch norm in training mode (aten._native_batch_norm_legit_functional) is not an op ExecuTorch's training "
                "path can lower; the FedHe CNNs built with options norm = \"group\" export and train (the ResNets' "
                "norm = \"group\" builds are not measured)")
    return "an op ExecuTorch's training path lacks"


def distill_inputs(x: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Example teacher, has and alpha inputs of a FedHe program at ``x``'s batch."""
    b = x.shape[0]
    return torch.zeros(b, num_classes), torch.zeros(b), torch.ones(1)


def export_training_program(net: nn.Module, x: torch.Tensor, y: torch.Tensor, distill: bool = False,
                            num_classes: int | None = None) -> TrainingProgram:
    """The joint forward-backward program of ``TrainStep(net)`` at the fixed shapes of ``x`` and ``y``;
    an :class:`ExportError` naming the reason when ExecuTorch's training path cannot take the model."""
    from executorch.exir import to_edge
    from torch.export.experimental import _export_forward_backward

    copy_ = _copy(net)
    rewritten = _rewrite_pools(copy_)
    step = (DistillStep(copy_) if distill else TrainStep(copy_)).train()
    if distill and num_classes is None:
        with torch.no_grad():
            num_classes = int(copy_.eval()(x[:1]).shape[1])
    args = (x, y, *distill_inputs(x, num_classes)) if distill else (x, y)
    t0 = time.perf_counter()
    try:
        ep = torch.export.export(step, args, strict=False)
        ep = _export_forward_backward(ep)
        prog = to_edge(ep).to_executorch()
        buffer = prog.buffer
    except Exception as exc:
        reason = _why(exc)
        raise ExportError(f"cannot export a training program: {reason}", hint=_reason_hint(reason)) from None
    names = program_parameter_names(buffer)
    shapes = dict(net.named_parameters())
    params = []
    for pname in names:
        sd = pname.removeprefix("net.")
        if sd not in shapes:
            raise ExportError(f"the training program holds a parameter {pname!r} the model does not have")
        params.append({"program_name": pname, "state_dict_name": sd, "shape": list(shapes[sd].shape)})
    if len(params) != len(shapes):
        missing = sorted(set(shapes) - {p["state_dict_name"] for p in params})
        raise ExportError(f"the training program does not train {', '.join(missing)}")
    frozen = [k for k in net.state_dict() if k not in shapes]
    return TrainingProgram(buffer, params, frozen, time.perf_counter() - t0, rewritten)


def export_inference_program(net: nn.Module, x: torch.Tensor) -> bytes:
    from executorch.exir import to_edge

    try:
        ep = torch.export.export(_copy(net).eval(), (x,), strict=False)
        return to_edge(ep).to_executorch().buffer
    except Exception as exc:
        raise ExportError(f"cannot export an inference program: {_why(exc)}") from None


def program_parameter_names(buffer: bytes) -> list[str]:
    """The parameters' names in the order the training program returns them (its own metadata method)."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    module = _load_for_executorch_from_buffer(buffer)
    return [str(n) for n in module.run_method(f"__et_training_fqn_{METHOD}", ())]


def _copy(net: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(net)


class MaxPoolByAmax(nn.Module):
    """A non-overlapping max pool (kernel = stride, no padding) as a reshape and ``amax``.

    ExecuTorch 1.5.1's portable ``max_pool2d_with_indices_backward`` gave gradients of the order of
    1e2-1e3 where PyTorch's are 1e-2 (the conv layers before a pool got garbage; measured on lenet5):
    its output buffer looks unzeroed. ``amax``'s backward (a mask and a division) is lowered to
    other kernels and matches PyTorch; the forward is the same max. Ties share the gradient where
    max_pool2d gives it to the first: after a ReLU, tied maxima are zeros whose gradient the ReLU
    drops anyway."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        k = self.k
        x = x[:, :, : h // k * k, : w // k * k]
        return x.reshape(n, c, h // k, k, w // k, k).amax(dim=(3, 5))


class AvgPoolByConv(nn.Module):
    """An average pool (no padding, floor mode) as a depthwise convolution with constant weights
    1 / (kh kw): ExecuTorch 1.5.1's portable library has no ``avg_pool2d_backward`` kernel (the
    FedHe CNNs' stride-1 pools made their training programs fail with OperatorMissing), while the
    convolution's backward is there. The same forward; the gradient is the pool's."""

    def __init__(self, kernel: tuple[int, int], stride: tuple[int, int]) -> None:
        super().__init__()
        self.kernel, self.stride = kernel, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        kh, kw = self.kernel
        weight = torch.full((c, 1, kh, kw), 1.0 / (kh * kw), dtype=x.dtype, device=x.device)
        return nn.functional.conv2d(x, weight, stride=self.stride, groups=c)


class ZeroPadByCat(nn.Module):
    """A zero padding (left, right, top, bottom >= 0) as concatenations with zeros: the backward of
    ``constant_pad_nd`` is a pad with negative widths, which ExecuTorch 1.5.1's portable kernel
    refuses (InvalidArgument, 0x12); a concatenation's backward is slicing."""

    def __init__(self, padding: tuple[int, int, int, int]) -> None:
        super().__init__()
        self.left, self.right, self.top, self.bottom = padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        parts = [t for t in (x.new_zeros(n, c, h, self.left) if self.left else None, x,
                             x.new_zeros(n, c, h, self.right) if self.right else None) if t is not None]
        x = torch.cat(parts, dim=3) if len(parts) > 1 else x
        w = x.shape[3]
        parts = [t for t in (x.new_zeros(n, c, self.top, w) if self.top else None, x,
                             x.new_zeros(n, c, self.bottom, w) if self.bottom else None) if t is not None]
        return torch.cat(parts, dim=2) if len(parts) > 1 else x


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _rewrite_pools(net: nn.Module) -> list[str]:
    """Swap the pools and paddings :class:`MaxPoolByAmax`, :class:`AvgPoolByConv` and
    :class:`ZeroPadByCat` can stand for; returns their names."""
    done = []
    for name, mod in list(net.named_modules()):
        if isinstance(mod, nn.AvgPool2d) and _pair(mod.padding) == (0, 0) and not mod.ceil_mode and mod.divisor_override is None:
            parent = net.get_submodule(name.rpartition(".")[0]) if "." in name else net
            setattr(parent, name.rpartition(".")[2], AvgPoolByConv(_pair(mod.kernel_size), _pair(mod.stride or mod.kernel_size)))
            done.append(name)
        elif isinstance(mod, nn.ZeroPad2d) and all(p >= 0 for p in mod.padding):
            parent = net.get_submodule(name.rpartition(".")[0]) if "." in name else net
            setattr(parent, name.rpartition(".")[2], ZeroPadByCat(tuple(mod.padding)))
            done.append(name)
        elif isinstance(mod, nn.MaxPool2d):
            k, s = mod.kernel_size, mod.stride
            k = k if isinstance(k, int) else (k[0] if k[0] == k[1] else None)
            s = s if isinstance(s, int) else (s[0] if s[0] == s[1] else None)
            if k and k == s and mod.padding in (0, (0, 0)) and mod.dilation in (1, (1, 1)) and not mod.ceil_mode:
                parent = net.get_submodule(name.rpartition(".")[0]) if "." in name else net
                setattr(parent, name.rpartition(".")[2], MaxPoolByAmax(k))
                done.append(name)
    return done


# --- the runtime side (what a device does; the phone device has its own copy without edgefl) ----------


class RuntimeTrainer:
    """One training program loaded in ExecuTorch's runtime, with the runtime's SGD."""

    def __init__(self, buffer: bytes, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        from executorch.extension.training import _load_for_executorch_for_training_from_buffer

        self.buffer = buffer  # the runtime reads the program from this buffer: it must outlive the module
        self.module = _load_for_executorch_for_training_from_buffer(buffer)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.optimizer = None

    def step(self, x: np.ndarray, y: np.ndarray, *extra: torch.Tensor) -> tuple[float, np.ndarray]:
        """One pass and SGD step; ``extra`` are a FedHe program's teacher, has and alpha inputs."""
        from executorch.extension.training import get_sgd_optimizer

        loss, logits = self.module.forward_backward(METHOD, (torch.from_numpy(x), torch.from_numpy(y), *extra))
        if self.optimizer is None:  # the parameters are known after the first pass (the bindings' rule)
            self.optimizer = get_sgd_optimizer(self.module.named_parameters(), self.lr, self.momentum, 0.0, self.weight_decay, False)
        self.optimizer.step(self.module.named_gradients())
        return float(loss), logits.numpy()

    def parameters(self) -> dict[str, np.ndarray]:
        return {k: v.detach().clone().numpy() for k, v in self.module.named_parameters().items()}


def without_dropout(net: nn.Module) -> nn.Module | None:
    """A copy of ``net`` whose dropout layers drop nothing, or None when it has none: a step with
    dropout cannot match PyTorch's (the runtime draws its own masks), so the gradients are checked on
    this twin's program and the model's own program is checked to run."""
    drops = [m for m in net.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    if not drops:
        return None
    twin = _copy(net)
    for m in twin.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return twin


def step_parity(net: nn.Module, buffer: bytes, x: torch.Tensor, y: torch.Tensor, lr: float, momentum: float,
                steps: int = 2, distill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> dict[str, Any]:
    """``steps`` SGD steps on one batch in the runtime and in PyTorch from the same weights: the
    losses and the updated weights compared (max absolute and relative differences). ``distill``:
    a FedHe program's (teacher, has, alpha) inputs, the reference then being :class:`DistillStep`."""
    extra = tuple(distill) if distill is not None else ()
    ref = (DistillStep(_copy(net)) if distill is not None else TrainStep(_copy(net))).train()
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    rt = RuntimeTrainer(buffer, lr, momentum)
    losses_pt, losses_rt = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss, _ = ref(x, y, *extra)
        loss.backward()
        opt.step()
        losses_pt.append(float(loss))
        losses_rt.append(rt.step(x.numpy(), y.numpy(), *extra)[0])
    got = rt.parameters()
    ref_sd = dict(ref.named_parameters())
    w_abs = max(float(np.abs(got[k] - ref_sd[k].detach().numpy()).max()) for k in got)
    w_scale = max(float(np.abs(ref_sd[k].detach().numpy()).max()) for k in got)
    l_abs = max(abs(a - b) for a, b in zip(losses_pt, losses_rt))
    ok = l_abs <= STEP_ATOL + STEP_RTOL * max(abs(v) for v in losses_pt) and w_abs <= STEP_ATOL + STEP_RTOL * w_scale
    return {"steps": steps, "lr": lr, "momentum": momentum, "batch": int(x.shape[0]),
            "losses_pytorch": losses_pt, "losses_runtime": losses_rt, "loss_max_abs_diff": l_abs,
            "weights_max_abs_diff": w_abs, "rtol": STEP_RTOL, "atol": STEP_ATOL, "ok": bool(ok)}


def check_runs(buffer: bytes, x: torch.Tensor, y: torch.Tensor, *extra: torch.Tensor) -> None:
    """One forward-backward pass in the runtime; an :class:`ExportError` naming what failed (a
    program can export and still need a kernel the runtime's portable library lacks)."""
    from executorch.extension.training import _load_for_executorch_for_training_from_buffer

    try:
        module = _load_for_executorch_for_training_from_buffer(buffer)
        module.forward_backward(METHOD, (x, y, *extra))
    except Exception as exc:
        text = str(exc)
        if "0x14" in text:
            text += " (OperatorMissing: a kernel the runtime's portable library lacks)"
        raise ExportError(f"the runtime cannot run the training program: {text}") from None


@functools.lru_cache(maxsize=64)
def trainability(name: str, num_classes: int = 10, input_shape: tuple[int, ...] | None = None) -> tuple[bool, str]:
    """Whether zoo model ``name`` exports as an ExecuTorch training program at its defaults, and if
    not why (``edgefl models``' column)."""
    from edgefl.models import build_model, get_spec

    spec = get_spec(name)
    if spec.kind != "classifier":
        return False, "not a classifier (the training program's loss is cross-entropy over labels)"
    torch.manual_seed(0)
    net = build_model(name, num_classes=num_classes, input_shape=input_shape)
    shape = input_shape or tuple(spec.default_input_shape)
    x, y = torch.randn(2, *shape), torch.zeros(2, dtype=torch.long)
    try:
        check_runs(export_training_program(net, x, y).buffer, x, y)
    except ExportError as exc:
        return False, str(exc).removeprefix("cannot export a training program: ")
    return True, "yes"
