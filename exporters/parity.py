"""The parity contract: an exported file must compute what the PyTorch model computes.

Float exports are compared output by output on real inputs with ``|a - b| <= atol + rtol |b|``
(rtol 1e-4, atol 1e-5: looser than torch's own ONNX tests, tight enough to catch a wrong layout,
a missing layer or a reordered channel). A failure raises :class:`ParityError` naming the worst
output element and its difference; nothing is written as if it had passed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from edgefl.errors import EdgeflError

RTOL = 1e-4
ATOL = 1e-5


class ParityError(EdgeflError):
    """An exported model's outputs differ from PyTorch's beyond the tolerance."""


@dataclass(frozen=True)
class Parity:
    runtime: str
    samples: int
    max_abs_diff: float
    max_rel_diff: float
    rtol: float
    atol: float
    top1_agreement: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def check_parity(runtime: str, expected: np.ndarray, got: np.ndarray, *, rtol: float = RTOL, atol: float = ATOL,
                 classifier: bool = True) -> Parity:
    """Compare one output tensor; raise :class:`ParityError` when any element is out of tolerance."""
    expected = np.asarray(expected, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    if expected.shape != got.shape:
        raise ParityError(f"{runtime}: output shape {got.shape} differs from PyTorch's {expected.shape}",
                          hint="the exported graph is not the model: re-export, and report it if it persists")
    diff = np.abs(got - expected)
    excess = diff - (atol + rtol * np.abs(expected))
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(excess)), excess.shape)) if excess.size else ()
    rel = diff / np.maximum(np.abs(expected), 1e-12)
    agreement = None
    if classifier and expected.ndim == 2:
        agreement = float((expected.argmax(1) == got.argmax(1)).mean())
    if excess.size and excess[worst] > 0:
        raise ParityError(
            f"{runtime}: output{list(worst)} is {got[worst]:.8g}, PyTorch gives {expected[worst]:.8g} "
            f"(difference {diff[worst]:.3g} > atol {atol:g} + rtol {rtol:g} x |expected|)",
            hint="the file was not kept; try another opset or batch mode, or report the model and the figures",
        )
    return Parity(runtime, int(expected.shape[0]) if expected.ndim else 1, float(diff.max(initial=0.0)),
                  float(rel.max(initial=0.0)), rtol, atol, agreement)
