"""Helpers shared by every TOML schema (run configs, device profiles): reading a file with a clear
error, formatting pydantic's errors with the key's path, and "did you mean" suggestions.

A leaf module: the schemas import it, it imports none of them."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from edgefl.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _loc(parts: tuple) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The valid field names of the model that sits at ``loc`` (for 'did you mean')."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return []
        ann = current.model_fields[part].annotation
        for arg in (*getattr(ann, "__args__", ()), ann):
            inner = getattr(arg, "__args__", (arg,))
            for a in inner:
                if isinstance(a, type) and issubclass(a, BaseModel):
                    current = a
                    break
            else:
                continue
            break
    return list(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def format_validation_error(exc: ValidationError, root: type[BaseModel], prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        loc = err["loc"]
        where = (prefix + "." if prefix and loc else prefix) + _loc(loc)
        if err["type"] == "extra_forbidden":
            key = str(loc[-1])
            lines.append(f"{where}: unknown key{suggest(key, _fields_at(root, loc[:-1]))}")
        else:
            lines.append(f"{where or '(top level)'}: {err['msg'].removeprefix('Value error, ')}")  # pydantic's prefix for our own checks
    return "\n".join(lines)


BOM = b"\xef\xbb\xbf"


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file: UTF-8 (whatever the locale says), no byte order mark; every problem is a
    ConfigError naming the file and, for bad bytes, where they are."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    if data.startswith(BOM):  # tomllib reports only "Invalid statement (at line 1, column 1)"
        raise ConfigError(f"{path} starts with a UTF-8 byte order mark (BOM, bytes EF BB BF), which TOML does not allow",
                          hint="save the file as UTF-8 without BOM (most editors: encoding 'UTF-8', not 'UTF-8 with BOM')")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(f"{path} is not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line}, column {column} (offset "
                          f"{exc.start}) is {exc.reason}", hint="TOML files are UTF-8: re-save the file as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def config_differences(a: Any, b: Any, *, into_lists: bool = False, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, a's value, b's value) wherever two JSON-like configs differ; a key one side lacks
    has None there (a table one side lacks, each of its leaves; so an empty table and a missing one
    do not differ: the configs compared are resolved ones, where both mean the defaults). ``into_lists``: lists of one length
    are compared item by item, so a difference is named ``fleet.groups.1.count``, not ``fleet.groups``."""
    if isinstance(a, dict) and isinstance(b, dict) or (a is None and isinstance(b, dict)) or (b is None and isinstance(a, dict)):
        a, b = a or {}, b or {}  # a table one side lacks: name its leaves, as a key one side lacks is
        return [d for key in sorted(set(a) | set(b), key=str)
                for d in config_differences(a.get(key), b.get(key), into_lists=into_lists,
                                            prefix=f"{prefix}.{key}" if prefix else str(key))]
    if into_lists and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b))
                for d in config_differences(x, y, into_lists=True, prefix=f"{prefix}.{i}")]
    return [] if a == b else [(prefix or "(config)", a, b)]
