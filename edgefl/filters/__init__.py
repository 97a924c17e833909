"""The filter registry: ``[[filters]] name = ...`` -> a :class:`~edgefl.filters.base.Filter`.

A new filter is one module with a subclass and a :func:`register_filter` call (a test file can
register one too). Built-in filters register when this package is imported.
"""

from __future__ import annotations

from typing import Any

from edgefl.filters.base import Filter, FilterOptions, Side

FILTERS: dict[str, type[Filter]] = {}


def register_filter(cls: type[Filter]) -> type[Filter]:
    """Make ``cls`` selectable by its ``name`` (usable as a class decorator)."""
    if not cls.name or not cls.name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"a filter needs a name of letters, digits, '-' and '_', not {cls.name!r}")
    FILTERS[cls.name] = cls
    return cls


def get_filter(name: str) -> type[Filter]:
    """The filter registered as ``name``; KeyError names the known ones and the nearest."""
    from edgefl.configtools import suggest
    from edgefl.plugins import load_plugins, unknown_hint

    if name not in FILTERS:
        load_plugins()
    try:
        return FILTERS[name]
    except KeyError:
        raise KeyError(f"no filter {name!r}{suggest(name, FILTERS)}; filters: {', '.join(sorted(FILTERS)) or 'none'}"
                       f"{unknown_hint('filter', name)}") from None




def build_chain(entries: list[tuple[str, dict[str, Any]]], side: Side, seed: int, device: str | None = None) -> list[Filter]:
    """The configured chain (``(name, options)`` pairs: ``RunConfig.filter_chain()``, a task's)
    as instances for one side, in order."""
    chain = []
    for name, options in entries:
        cls = get_filter(name)
        chain.append(cls(cls.Options.model_validate(options), side=side, seed=seed, device=device))
    names = tuple(f.name for f in chain)
    for f in chain:
        f.chain = names  # a filter may act differently beside another (DP noise under secure aggregation)
    return chain


# the built-in filters (registered here, not in their modules: they import only edgefl.filters.base,
# so the package and its modules import no cycle)
from edgefl.filters.dp import DPFedAvg  # noqa: E402
from edgefl.filters.local_dp import LocalDP  # noqa: E402
from edgefl.filters.quantize import QuantizeFilter  # noqa: E402
from edgefl.filters.secagg import SecAgg  # noqa: E402
from edgefl.filters.topk import TopKFilter  # noqa: E402

for _builtin in (DPFedAvg, LocalDP, QuantizeFilter, SecAgg, TopKFilter):
    register_filter(_builtin)

__all__ = ["FILTERS", "Filter", "FilterOptions", "Side", "build_chain", "get_filter", "register_filter"]
