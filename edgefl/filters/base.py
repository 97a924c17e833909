"""Filters: an ordered chain every upload and download passes through, on the device and on the
server, chosen in the config (``[[filters]]``) and identical in a simulation and a fleet.

A chain ``[f1, f2]`` works like this::

    device:  client half -> f1.upload_out -> f2.upload_out -> encode -> wire
    server:  wire -> decode -> f2.upload_in -> f1.upload_in -> upload checks -> server half
    server:  server half -> f1.download_out -> f2.download_out -> encode -> wire
    device:  wire -> decode -> f2.download_in -> f1.download_in -> download checks -> client half

One instance per side: on the device, one per device (its state, e.g. a top-k residual, is the
device's and is saved with the device's state); on the server, one per run, told which device
each message is for or from. Everything a filter reads on the receiving side came over a
network: it checks names, dtypes, shapes and ranges and raises :class:`PayloadError` with the
reason (the message is refused with a nack, nothing else stops).

A filter may also bring *stages* (request/reply exchanges within a round, before or after the
training exchange; :mod:`edgefl.stages`): the server side lists them in
:meth:`Filter.server_stages`, the device side answers them in :meth:`Filter.answer_stage`.
"""

from __future__ import annotations

from abc import ABC
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict

from edgefl.messages import Message
from edgefl.stages import Stage

if TYPE_CHECKING:  # type hints only: filters stay importable on a device without the server
    from edgefl.methods import MethodSpec

Side = Literal["device", "server"]


class FilterOptions(BaseModel):
    """A filter's options (its ``[[filters]]`` table without ``name``); unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")


class Filter(ABC):  # noqa: B024  (every hook has a pass-through default: a filter overrides what it changes)
    """One link of the chain. Subclasses set :attr:`name` and :attr:`Options` and override the
    hooks they need; every default passes the message through unchanged."""

    #: the name ``[[filters]] name = ...`` selects it by
    name: ClassVar[str] = ""
    #: the pydantic model of its options
    Options: ClassVar[type[FilterOptions]] = FilterOptions
    #: one line for ``edgefl filters`` and the config reference
    summary: ClassVar[str] = ""

    def __init__(self, options: FilterOptions, *, side: Side, seed: int, device: str | None = None) -> None:
        self.options = options
        self.side = side
        self.seed = seed
        self.device = device  # the device this instance runs on (device side); None on the server
        self.chain: tuple[str, ...] = ()  # the names of the whole chain, in order (set by build_chain)

    # --- before the run ---------------------------------------------------------------------
    @classmethod
    def refusal(cls, options: FilterOptions, spec: MethodSpec, **run: Any) -> str | None:
        """Why this filter cannot serve a run of ``spec``'s method (checked before the run
        directory exists), or None. ``run`` tells more of the run: ``method_options`` (the
        method's options as configured), ``mode`` ("sync" or "async"), ``rounds``,
        ``sample_rate`` (the share of devices a round selects), ``devices`` and ``chain`` (the filters'
        names, in order)."""
        return None

    @classmethod
    def resolve_options(cls, options: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
        """The options both sides build the filter from, with whatever the run decides filled in
        (``run``: ``rounds``). Called by ``RunConfig.filter_chain()``, so a device (through its
        config or its task) and the server see the same values; the default changes nothing."""
        return options

    # --- the device side ----------------------------------------------------------------------
    def download_in(self, message: Message) -> Message:
        """A download or evaluate request the device received (after decoding, before checks)."""
        return message

    def upload_out(self, message: Message) -> Message:
        """What the client half made, on its way out (before encoding)."""
        return message

    def carry_state(self) -> dict[str, torch.Tensor]:
        """The device-side state that must survive a crash (saved with the device's state)."""
        return {}

    def load_carry_state(self, tensors: dict[str, torch.Tensor]) -> None:  # noqa: B027  (optional hook)
        """Restore :meth:`carry_state` (only this filter's tensors, names as it gave them)."""

    def answer_stage(self, stage: str, request: Message) -> Message | None:
        """The device's reply to a stage request this filter owns; None: not this filter's stage."""
        return None

    # --- the server side ----------------------------------------------------------------------
    def download_out(self, device: str, message: Message) -> Message:
        """What the server half sends ``device``, on its way out (before encoding)."""
        return message

    def upload_in(self, message: Message) -> Message:
        """An upload from ``message.sender`` (decoded, before the upload checks and the server
        half). Raise :class:`~edgefl.errors.PayloadError` to refuse it."""
        return message

    def server_stages(self) -> list[Stage]:
        """The stages this filter adds to every round (:class:`edgefl.stages.Stage`)."""
        return []

    def prepare(self, run: dict[str, Any]) -> None:  # noqa: B027  (optional hook)
        """Server side, before round 1: what the run knows that a filter may need (``groups``:
        device -> the group whose uploads are summed together, ``seed``, ``federation``,
        ``num_classes``, ``rounds``, ``sample_rate``: the share of devices a round selects,
        ``expected_per_group``: the devices a round expects from each group)."""

    def collect(self, message: Message) -> Any | None:
        """Server side: take an upload instead of the method's server half (secure aggregation
        keeps masked uploads until it can unmask their sum). Returns the receipt
        (:class:`edgefl.server.methods.Receipt`), or None: not taken, the server half receives it."""
        return None

    def round_facts(self, round_no: int) -> dict[str, Any]:
        """Server side: what the round's metrics record says of this filter (``filters.<name>``);
        empty: nothing."""
        return {}

    def release(self, round_no: int) -> list[Message]:
        """Server side, after the round's stages: what the server half receives in place of the
        uploads this filter collected (the unmasked sums)."""
        return []

    def released(self, round_no: int, messages: list[Message]) -> None:  # noqa: B027  (optional hook)
        """Server side, after every filter released: all the server half got in place of the round's
        uploads. A filter earlier in the chain learns here what a later one summed (secure
        aggregation's sums say how many uploads each holds: ``meta["secure_aggregate"]``)."""

    def server_state(self) -> dict[str, Any]:
        """Server side: what must survive a server restart (``edgefl server --resume``), as JSON
        values: a privacy filter's releases, say, without which its epsilon would restart at 0."""
        return {}

    def load_server_state(self, state: dict[str, Any]) -> None:  # noqa: B027  (optional hook)
        """Restore :meth:`server_state` (read from the run's saved state: check what it holds)."""

    def describe(self) -> dict[str, Any]:
        """What run.json records of it."""
        return {"name": self.name, **self.options.model_dump(mode="json")}
