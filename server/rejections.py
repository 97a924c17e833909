"""A bounded account of refused messages: what the metrics and the log keep of hostile traffic.

A flood of 8,000 bad messages must not grow metrics.jsonl by 8,000 entries nor fill the log: a
round keeps counts by reason (numbers in a reason folded, so "chunk 17 of 20000" and "chunk 3 of
5" count together) and by sender, each capped, and only the first :data:`LOGGED_PER_ROUND`
refusals of a round (then every :data:`LOG_EVERY`-th) are logged in full. Each folded reason keeps
the first refusal it came from, word for word (a path or a size an operator needs is not lost to
the folding).
"""

from __future__ import annotations

import re
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

MAX_KEYS = 200  # distinct reasons or senders tracked; beyond that they count under "(other)"
TOP = 10  # shown in a record
LOGGED_PER_ROUND = 20
LOG_EVERY = 1000
OTHER = "(other)"


def reason_kind(reason: str) -> str:
    """The reason with numbers and quoted values folded, so equal causes count together."""
    folded = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", reason[:200])
    return re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "#", folded)[:120]


def _top(counter: Counter[str]) -> dict[str, int]:
    """The :data:`TOP` most common keys, and the rest summed under :data:`OTHER`."""
    top = dict(counter.most_common(TOP))
    rest = sum(counter.values()) - sum(top.values())
    if rest:
        top[OTHER] = top.get(OTHER, 0) + rest
    return top


@dataclass
class Rejections:
    """Refusals counted by reason and sender, with a cap on distinct keys (a dataclass, so a
    checkpoint of an asynchronous run keeps the refusals its open record has counted)."""

    total: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    by_sender: Counter[str] = field(default_factory=Counter)
    recent: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=50))  # (sender, reason) of the last refusals
    examples: dict[str, str] = field(default_factory=dict)  # folded reason -> the first refusal it came from

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: int) -> tuple[str, str]:
        """The recent refusals, newest last (``rejections[-1]``)."""
        return self.recent[index]

    @staticmethod
    def _bump(counter: Counter[str], key: str, n: int = 1) -> None:
        counter[key if key in counter or len(counter) < MAX_KEYS else OTHER] += n

    def keep_example(self, kind: str, reason: str) -> None:
        """The first refusal of a folded reason, kept word for word (not for a reason it does not count)."""
        if kind in self.by_reason and kind not in self.examples and kind != reason[:120]:
            self.examples[kind] = reason[:300]

    def add(self, sender: str, reason: str) -> bool:
        """Count one refusal; True when it should be logged in full."""
        self.total += 1
        self.recent.append((sender[:64], reason[:300]))
        kind = reason_kind(reason)
        self._bump(self.by_reason, kind)
        self.keep_example(kind, reason)
        self._bump(self.by_sender, sender[:64])
        return self.total <= LOGGED_PER_ROUND or self.total % LOG_EVERY == 0

    def summary(self) -> dict[str, Any]:
        """What a round record keeps: the count and the top reasons and senders, the rest counted
        together under "(other)" (so each adds up to the count)."""
        top = _top(self.by_reason)
        return {"count": self.total, "by_reason": top, "by_sender": _top(self.by_sender),
                "examples": {k: self.examples[k] for k in top if k in self.examples}}

    def saved(self) -> dict[str, Any]:
        """The counts a checkpoint keeps (the recent refusals are not: they are the log's)."""
        return {"total": self.total, "by_reason": dict(self.by_reason), "by_sender": dict(self.by_sender),
                "examples": dict(self.examples)}

    @classmethod
    def from_saved(cls, saved: Any) -> Rejections:
        """What :meth:`saved` wrote, checked as anything read from a file is: a part that is not
        counts of the right shape is dropped (the run's refusal count then starts again at zero)."""
        out = cls()
        if not isinstance(saved, dict):
            return out
        total = saved.get("total")
        if isinstance(total, int) and not isinstance(total, bool) and 0 <= total < 2**62:
            out.total = total
        for name in ("by_reason", "by_sender"):
            counts = saved.get(name)
            if isinstance(counts, dict):
                for key, n in list(counts.items())[:MAX_KEYS + 1]:
                    if isinstance(key, str) and isinstance(n, int) and not isinstance(n, bool) and 0 < n < 2**62:
                        cls._bump(getattr(out, name), key[:120 if name == "by_reason" else 64], n)
        out.total = max(out.total, sum(out.by_reason.values()), sum(out.by_sender.values()))  # a dropped total is not 0
        examples = saved.get("examples")
        if isinstance(examples, dict):
            for kind, reason in list(examples.items())[:MAX_KEYS]:
                if isinstance(kind, str) and isinstance(reason, str):
                    out.keep_example(kind, reason)
        return out

    def merge(self, other: Rejections) -> None:
        self.total += other.total
        for key, n in other.by_reason.items():
            self._bump(self.by_reason, key, n)
        for key, reason in other.examples.items():
            self.keep_example(key, reason)
        for key, n in other.by_sender.items():
            self._bump(self.by_sender, key, n)
