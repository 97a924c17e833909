"""Saving and restoring a server half between rounds, without pickle.

A server half's state is whatever its attributes hold: weights, per-client stores (dataclasses,
deques, dicts keyed by tuples), a generator network. :func:`save_state` walks them into one
safetensors file: the tensors as tensors, everything else as a JSON skeleton in the metadata.
:func:`load_state` rebuilds them into a freshly built server half of the same config. Only
dataclasses defined in edgefl's own modules are rebuilt (never an arbitrary import), and
``torch.nn.Module`` / optimizer attributes are restored into the objects the fresh server already
has, through their ``load_state_dict``. The file is written to a temporary name and renamed, so a
crash while saving leaves the previous round's state intact.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections import Counter, deque
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from edgefl.errors import PayloadError

FORMAT = "edgefl-server-state/1"


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._whole_storages: set[int] = set()  # storages already saved whole: another tensor on one is copied

    def owned(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself when it is the whole of a storage not saved yet, else a copy: safetensors
        cannot save views of one storage apart, and copying every tensor would briefly hold a
        second copy of the whole state (hundreds of MB for FedMHO's full-width VGG-9s)."""
        storage = t.untyped_storage()
        whole = t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size() and t.numel() > 0
        if not whole or storage.data_ptr() in self._whole_storages:
            return t.clone()
        self._whole_storages.add(storage.data_ptr())
        return t

    def __call__(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            key = f"t{len(self.tensors)}"
            self.tensors[key] = self.owned(obj.detach().cpu().contiguous())
            return {"__tensor__": key}
        if isinstance(obj, bytes):  # an envelope kept to send again: its bytes as a uint8 tensor
            key = f"t{len(self.tensors)}"
            self.tensors[key] = torch.frombuffer(bytearray(obj), dtype=torch.uint8) if obj else torch.zeros(0, dtype=torch.uint8)
            return {"__bytes__": key}
        if isinstance(obj, nn.Module):
            return {"__module__": self(obj.state_dict())}
        if isinstance(obj, torch.optim.Optimizer):
            return {"__optimizer__": self(obj.state_dict())}
        if isinstance(obj, deque):
            return {"__deque__": [self(v) for v in obj], "maxlen": obj.maxlen}
        if isinstance(obj, tuple):
            return {"__tuple__": [self(v) for v in obj]}
        if isinstance(obj, list):
            return {"__list__": [self(v) for v in obj]}
        if isinstance(obj, set):
            return {"__set__": [self(v) for v in sorted(obj, key=repr)]}
        if isinstance(obj, Counter):  # before dict: a restored tally must count on
            return {"__counter__": [[self(k), self(v)] for k, v in obj.items()]}
        if isinstance(obj, dict):
            return {"__dict__": [[self(k), self(v)] for k, v in obj.items()]}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            cls = type(obj)
            if not cls.__module__.startswith("edgefl."):
                raise TypeError(f"cannot save a {cls.__module__}.{cls.__qualname__}: only edgefl's own dataclasses")
            return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}",
                    "fields": {f.name: self(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
        raise TypeError(f"cannot save a {type(obj).__name__} in a server state")


def _decode(node: Any, tensors: dict[str, torch.Tensor], existing: Any = None) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if not isinstance(node, dict) or len(node) == 0:
        raise PayloadError(f"server state: unexpected node {str(node)[:60]}")
    if "__tensor__" in node:
        return tensors[node["__tensor__"]]
    if "__bytes__" in node:
        return tensors[node["__bytes__"]].numpy().tobytes()
    if "__module__" in node or "__optimizer__" in node:
        if existing is None or not hasattr(existing, "load_state_dict"):
            raise PayloadError("server state holds a network the fresh server does not have")
        existing.load_state_dict(_decode(node.get("__module__", node.get("__optimizer__")), tensors))
        return existing
    if "__deque__" in node:
        return deque((_decode(v, tensors) for v in node["__deque__"]), maxlen=node["maxlen"])
    if "__tuple__" in node:
        return tuple(_decode(v, tensors) for v in node["__tuple__"])
    if "__list__" in node:
        return [_decode(v, tensors) for v in node["__list__"]]
    if "__set__" in node:
        return {_decode(v, tensors) for v in node["__set__"]}
    if "__dict__" in node:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in node["__dict__"]}
    if "__counter__" in node:
        return Counter({_decode(k, tensors): _decode(v, tensors) for k, v in node["__counter__"]})
    if "__dataclass__" in node:
        module, _, qualname = node["__dataclass__"].partition(":")
        if not module.startswith("edgefl."):
            raise PayloadError(f"server state names a class outside edgefl: {node['__dataclass__']}")
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if not dataclasses.is_dataclass(cls):
            raise PayloadError(f"server state names {node['__dataclass__']}, which is not a dataclass")
        return cls(**{k: _decode(v, tensors) for k, v in node["fields"].items()})
    raise PayloadError(f"server state: unknown node {sorted(node)[:3]}")


def savable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` ready for safetensors' ``save_file``: on the CPU, contiguous, and copied only
    where two of them share a storage (see :meth:`_Encoder.owned`)."""
    enc = _Encoder()
    return {name: enc.owned(t.detach().cpu().contiguous()) for name, t in tensors.items()}


def encode_tree(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``obj`` (what a server state may hold) as a JSON skeleton and the tensors it names."""
    enc = _Encoder()
    return enc(obj), enc.tensors


def decode_tree(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`encode_tree` (modules and optimizers are not rebuilt: none may be in it)."""
    return _decode(skeleton, tensors)


def save_state(server: Any, path: Path, extra: dict[str, Any], carried: Any = None) -> Path:
    """Write every attribute of ``server`` except the ones rebuilt from the config. ``extra``
    is plain JSON; ``carried`` (what the run's policy carries between updates: tensors, bytes,
    tuples, edgefl dataclasses) is encoded like the attributes and comes back as
    ``extra["carried"]`` from :func:`load_state`."""
    enc = _Encoder()
    skip = type(server).config_attributes  # rebuilt from the config, never restored from a file
    skeleton = {name: enc(value) for name, value in vars(server).items() if name not in skip and not name.startswith("__")}
    meta = {"format": FORMAT, "server_class": f"{type(server).__module__}:{type(server).__qualname__}", "extra": extra,
            "attributes": skeleton, **({"carried": enc(carried)} if carried is not None else {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(enc.tensors, str(tmp), metadata={"edgefl": json.dumps(meta)})
    os.replace(tmp, path)
    return path


def load_state(server: Any, path: Path) -> dict[str, Any]:
    """Restore a state written by :func:`save_state` into a fresh server half of the same method;
    returns the ``extra`` dict saved with it."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("edgefl")
    if raw is None:
        raise PayloadError(f"{path} is not an edgefl server state")
    meta = json.loads(raw)
    if meta.get("format") != FORMAT:
        raise PayloadError(f"{path}: unsupported server state format {meta.get('format')!r}")
    expected = f"{type(server).__module__}:{type(server).__qualname__}"
    if meta["server_class"] != expected:
        raise PayloadError(f"{path} holds a {meta['server_class']} state, this run's server is {expected}")
    tensors = load_file(str(path))
    for name, node in meta["attributes"].items():
        setattr(server, name, _decode(node, tensors, getattr(server, name, None)))
    if "carried" in meta:
        return {**meta["extra"], "carried": _decode(meta["carried"], tensors)}
    return meta["extra"]
