"""Export formats by name: a format is one module with an :class:`ExportFormat` subclass and a
:func:`register_format` call; the export job (:mod:`edgefl.exporters.export`) runs the chosen
formats in turn and owns what they share (checks against PyTorch, sidecars, the staging folder).

This module imports nothing heavy (no torch, no numpy, no export extra): the command line lists the
formats in ``edgefl export --help``, the run config checks its ``export`` names, and a device's
light install imports ``edgefl.exporters``. The built-in formats (``onnx_format.py``,
``tflite_format.py``, ``micro_format.py``) register when the ``edgefl.exporters`` package is
imported; a format of your own registers when its module is imported (docs/export.md).
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from edgefl.errors import EdgeflError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from edgefl.exporters.parity import Parity
    from edgefl.exporters.source import ModelSource

#: how the optional export dependencies are installed (pyproject.toml's ``export`` extra)
EXPORT_EXTRA = "pip install -e '.[export]' in the edgefl checkout"


class ExportError(EdgeflError):
    """A model the exporter or a runtime could not handle."""


@dataclass
class ExportedFile:
    """One written file and the outcome of its checks (what its sidecar says)."""

    path: Path
    format: str
    precision: str  # "float32" | "int8"
    batch: int | None  # None: dynamic
    parity: Parity | None = None
    accuracy: float | None = None
    agreement: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    sidecar: Path | None = None


@dataclass(frozen=True)
class ExportOptions:
    """What the user chose for every format (each format reads the options it knows)."""

    batch: int = 1  # the fixed batch of the phone files
    int8: bool = False  # also int8 variants, calibrated on real training samples
    dynamic_batch: bool = True  # ONNX: also a dynamic-batch file
    channels_last: bool | None = None  # TFLite: None = NHWC image I/O (TFLite's convention), False = NCHW
    mobile_check: bool = True  # ONNX: ONNX Runtime's mobile-usability verdict


class ExportContext(Protocol):
    """What a format gets from the export job (:class:`edgefl.exporters.export.ExportJob`).

    A protocol rather than the class itself: this module must not import the job's module (torch,
    the data sets), which imports it."""

    src: ModelSource
    options: ExportOptions
    module: torch.nn.Module  # the model in eval mode
    classifier: bool  # False: a CVAE decoder (inputs z, y_onehot; output an image)
    sample: tuple[torch.Tensor, ...]  # real inputs at the file's batch (for tracing and latency)
    parity_inputs: tuple[torch.Tensor, ...]  # real inputs the float files must match PyTorch on
    labels: list[str]
    norm: dict[str, Any] | None  # the input scaling, for classifiers
    view: dict[str, Any] | None  # the device's view of the data a per-device model takes (CHFL), for classifiers
    written: list[ExportedFile]  # files of the formats that ran before this one
    log: Callable[[str], None]

    def calibration(self) -> list[tuple[torch.Tensor, ...]]:
        """Real training batches at the file's fixed batch, for int8 calibration."""
        ...

    def judge(self, f: ExportedFile, runner: Callable[..., np.ndarray],
              layout_fn: Callable[[torch.Tensor], torch.Tensor] = ...) -> None:
        """Run ``f`` on the real inputs: parity (float), accuracy and agreement (classifiers), the
        int8 bar, latency; fills ``f`` and raises :class:`ExportError` on a failed check."""
        ...

    def describe(self, f: ExportedFile) -> str:
        """One paragraph on what goes in and out, for a file's embedded description."""
        ...


@dataclass(frozen=True)
class Requirement:
    """An optional dependency of a format: one of ``modules`` must be importable."""

    modules: tuple[str, ...]
    what: str  # the distribution as a person installs it, e.g. "litert-torch (the TFLite converter)"
    hint: str = EXPORT_EXTRA

    def met(self) -> bool:
        # find_spec locates a top-level package without importing it (the converters take seconds)
        return any(importlib.util.find_spec(m) is not None for m in self.modules)


class ExportFormat(ABC):
    """A file format a model is exported to. Subclasses set the class attributes and implement
    :meth:`export`; :func:`register_format` makes them selectable by ``name``."""

    name: ClassVar[str]
    #: one line for ``edgefl export --help``
    summary: ClassVar[str]
    #: endings of the files it writes (model NAME + suffix): a re-export replaces a model's whole
    #: set, so the staging folder removes every registered format's old files, not only the chosen ones
    suffixes: ClassVar[tuple[str, ...]] = ()
    requires: ClassVar[tuple[Requirement, ...]] = ()
    #: a format whose files this one extends (micro adds a C array to tflite's int8 file): it must be
    #: chosen too, and runs after it
    builds_on: ClassVar[str | None] = None
    #: choosing this format turns on int8 variants (micro needs the int8 .tflite)
    needs_int8: ClassVar[bool] = False

    @classmethod
    def check_available(cls) -> None:
        """Refuse before any work when an optional dependency is missing, with the install line."""
        missing = [r for r in cls.requires if not r.met()]
        if missing:
            raise ExportError(f"the {cls.name} export format needs {', '.join(r.what for r in missing)}, which is not installed",
                              hint=missing[0].hint)

    @abstractmethod
    def export(self, job: ExportContext, folder: Path) -> list[ExportedFile]:
        """Write this format's files for ``job``'s model into ``folder``, each checked with
        ``job.judge`` (a failed check raises :class:`ExportError`), and return them. The job writes
        their sidecars and moves the model's whole set into place only when every format passed."""


FORMATS: dict[str, type[ExportFormat]] = {}


def register_format(cls: type[ExportFormat]) -> type[ExportFormat]:
    """Make ``cls`` selectable by its ``name`` (usable as a class decorator)."""
    name = getattr(cls, "name", "")
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"an export format needs a name of letters, digits, '-' and '_', not {name!r}")
    if not getattr(cls, "summary", ""):
        raise ValueError(f"export format {name!r} needs a one-line summary")
    old = FORMATS.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"export format {name!r} is already registered by {old.__module__}.{old.__qualname__}")
    if cls.builds_on is not None and cls.builds_on not in FORMATS:
        raise ValueError(f"export format {name!r} builds on {cls.builds_on!r}, which is not registered (register it first)")
    FORMATS[name] = cls  # a re-imported module replaces its own class
    return cls


def format_names() -> list[str]:
    """The registered formats, in the order they were registered."""
    return list(FORMATS)


def get_format(name: str) -> type[ExportFormat]:
    """The format registered as ``name``; an unknown name is an error with the nearest known one."""
    try:
        return FORMATS[name]
    except KeyError:
        from edgefl.configtools import suggest  # pydantic: imported only to explain a mistake

        raise ExportError(f"unknown export format {name!r}{suggest(name, FORMATS)}", hint=f"formats: {', '.join(FORMATS)}") from None


def chosen_formats(names: Iterable[str]) -> list[type[ExportFormat]]:
    """The formats named, each once, checked, in the order given except that a format runs after
    the one it builds on."""
    chosen: list[type[ExportFormat]] = []
    for name in names:
        cls = get_format(name)
        if cls not in chosen:
            chosen.append(cls)
    if not chosen:
        raise ExportError("no export format given", hint=f"formats: {', '.join(FORMATS)}")
    for cls in chosen:
        if cls.builds_on is not None and FORMATS[cls.builds_on] not in chosen:
            raise ExportError(f"the {cls.name} export format builds on the {cls.builds_on} format's files",
                              hint=f"add {cls.builds_on} to the formats")

    def depth(cls: type[ExportFormat]) -> int:
        return 0 if cls.builds_on is None else 1 + depth(FORMATS[cls.builds_on])

    return sorted(chosen, key=depth)  # stable: the given order among formats of one depth


def all_suffixes() -> tuple[str, ...]:
    return tuple(s for cls in FORMATS.values() for s in cls.suffixes)


__all__ = ["EXPORT_EXTRA", "FORMATS", "ExportContext", "ExportError", "ExportFormat", "ExportOptions", "ExportedFile", "Requirement",
           "all_suffixes", "chosen_formats", "format_names", "get_format", "register_format"]
