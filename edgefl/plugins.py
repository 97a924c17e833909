"""Methods and filters from outside edgefl: plug-ins (docs/adding-a-method.md, docs/filters.md).

A plug-in is a Python module that calls :func:`edgefl.methods.register_method`,
:func:`edgefl.filters.register_filter` or :func:`edgefl.transport.registry.register_transport`
when it is imported. edgefl imports:

* every entry point of the group ``edgefl.plugins`` of the installed packages (a package's
  ``pyproject.toml``: ``[project.entry-points."edgefl.plugins"] fedprox = "mypkg.fedprox"``);
* the modules and ``.py`` files named in the environment variable ``EDGEFL_PLUGINS``, separated by
  commas (``EDGEFL_PLUGINS=./fedprox.py`` or ``EDGEFL_PLUGINS=mypkg.fedprox``): a quick way while
  writing one, and what the processes ``edgefl fleet`` starts inherit.

Nothing that arrives over the network names a module to import: a device runs a plug-in's method
only when the plug-in is installed (or named in ``EDGEFL_PLUGINS``) on the device itself, and
declines the task with the method's name otherwise. A plug-in that fails to import is reported,
with its error, where its method or filter would have been looked up; the rest of edgefl works.
Each run records the plug-ins it loaded (``run.json``: ``plugins``, with each module's file and its
SHA-256, so that a run's numbers can be traced to the code that made them).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

GROUP = "edgefl.plugins"
ENV = "EDGEFL_PLUGINS"

_loaded: list[dict[str, Any]] = []  # what each plug-in was and where it came from (run.json)
_failed: list[str] = []  # "<plug-in>: <error>" for each that could not be imported
_done = False


def load_plugins() -> list[dict[str, Any]]:
    """Import every plug-in once (entry points, then ``EDGEFL_PLUGINS`` in order); returns what was
    loaded. Failures are kept (:func:`plugin_failures`), not raised: one broken package must not stop
    commands that do not need it."""
    global _done
    if _done:
        return list(_loaded)
    _done = True
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        source = {"entry_point": ep.name, "module": ep.value,
                  "package": getattr(dist, "name", None), "version": getattr(dist, "version", None)}
        _import(f"entry point {ep.name} ({ep.value})", source, ep.load)
    for item in (part.strip() for part in os.environ.get(ENV, "").split(",")):
        if item:
            _import(f"{ENV} item {item!r}", {"env": item}, lambda item=item: _import_item(item))
    return list(_loaded)


def _import(label: str, source: dict[str, Any], load) -> None:
    try:
        module = load()
    except Exception as exc:  # any error of someone else's module: said where its names are looked up
        reason = f"{label}: {type(exc).__name__}: {exc}"[:500]
        if isinstance(exc, ModuleNotFoundError) and source.get("env") and Path(f"{source['env']}.py").is_file():
            reason += f" (a file here: name it as ./{source['env']}.py, or add its folder to PYTHONPATH)"
        _failed.append(reason)
        return
    where = getattr(module, "__file__", None)
    if isinstance(where, str) and Path(where).is_file():  # which code made a run's numbers, not only its name
        source["file"] = str(Path(where).resolve())
        source["sha256"] = hashlib.sha256(Path(where).read_bytes()).hexdigest()
    _loaded.append(source)


def _import_item(item: str) -> ModuleType:
    """A module name, or the path of a ``.py`` file (imported under its file name, so that a
    method's halves can be named ``fedprox:FedProxClient``)."""
    if not item.endswith(".py") and os.sep not in item and "/" not in item:
        return importlib.import_module(item)
    path = Path(item).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    name = path.stem
    if not name.isidentifier():
        raise ImportError(f"{path.name} is not a module name (letters, digits and _): rename the file")
    existing = sys.modules.get(name)
    if existing is not None:
        if Path(getattr(existing, "__file__", "") or "").resolve() == path:
            return existing
        raise ImportError(f"a module named {name!r} is already imported from elsewhere: rename {path.name}")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def loaded_plugins() -> list[dict[str, Any]]:
    """The plug-ins imported so far, and where each came from (what a run records)."""
    return list(_loaded)


def plugin_failures() -> list[str]:
    """The plug-ins that could not be imported, each with its error."""
    return list(_failed)


def unknown_hint(kind: str, name: str) -> str:
    """What to add to "unknown method/filter NAME" when plug-ins are involved."""
    if _failed:
        return f"; a plug-in failed to import and may have provided {kind} {name!r}: " + "; ".join(_failed)
    return f"; a {kind} from outside edgefl comes from a plug-in: install its package, or name its module in {ENV}"
