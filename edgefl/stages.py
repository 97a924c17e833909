"""Stages: request/reply exchanges a round runs with its participants besides the training one.

A round is a sequence of exchanges with the devices still taking part::

    before-stages (in order)  ->  training (download -> upload)  ->  after-stages (in order)

Each stage has its own deadline and quorum: the devices that do not answer in time drop out of
the round (they get no download, or what they uploaded is left to the stage owner to treat), and
a stage that keeps fewer than its quorum fails the round with the reason. Secure aggregation
(key advertisement, share exchange, then unmasking after the masked uploads) is the case it was
made for; a method's server half or a filter's server side lists its stages, the device's client
half or filter answers them (:meth:`edgefl.filters.Filter.answer_stage`,
:meth:`edgefl.algorithms.ClientHalf.answer_stage`).

On the wire a stage request is an envelope of type ``stage`` whose ``info.stage`` names it
(its body a message of kind ``stage``, or empty); the reply is an ``upload`` of a message of kind
``stage`` with ``meta.stage`` (docs/PROTOCOL.md section 6.10). A round with no stage sends
neither, so a device that knows nothing of stages still takes part.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Literal

from edgefl.messages import Message


class StageFailed(Exception):
    """A stage could not go on (too few answers, a reply that breaks the protocol): the round fails."""


class Stage(ABC):
    """One exchange of a round. Subclasses set ``name`` and ``when`` and build requests,
    check replies and close the stage."""

    #: names the stage on the wire (letters, digits, '-', '_')
    name: str = ""
    #: before the training exchange (the devices that drop out get no download) or after it
    when: Literal["before", "after"] = "before"
    #: seconds the stage waits for replies (None: the round's deadline)
    deadline_s: float | None = None
    #: answers needed, as a share of the devices asked (1.0: all) or a count (> 1)
    quorum: float = 1.0

    def needed(self, asked: int) -> int:
        """Replies this stage needs from ``asked`` devices."""
        return min(asked, int(self.quorum) if self.quorum > 1 else max(1, math.ceil(self.quorum * asked)))

    @abstractmethod
    def request(self, round_no: int, device: str, participants: list[str]) -> Message | None:
        """What ``device`` is sent (None: an empty request)."""

    def check(self, round_no: int, device: str, reply: Message) -> str | None:
        """Why ``reply`` cannot be used (it came over the network), or None."""
        return None

    @abstractmethod
    def close(self, round_no: int, replies: dict[str, Message], dropped: list[str]) -> None:
        """The stage is over: ``replies`` by device, ``dropped`` the devices that did not answer.
        Raise :class:`StageFailed` to fail the round."""
