"""The versioned MQTT topic layout of a federation (docs/PROTOCOL.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "edgefl/v1"
_SAFE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def is_safe_name(value: str) -> bool:
    return bool(_SAFE.fullmatch(value))


def check_name(value: str, what: str) -> str:
    """Federation and device names become topic levels: no wildcards, separators or spaces."""
    if not _SAFE.fullmatch(value):
        raise ValueError(f"{what} {value!r} must be 1-64 characters of letters, digits, '_', '.' or '-'")
    return value


def device_ids(count: int) -> list[str]:
    """The fleet's device ids, in group order: ``client-0`` .. (zero-padded to one width). The
    simulation, the fleet launcher and ``edgefl broker-config`` all name devices this way."""
    width = len(str(count - 1))
    return [f"client-{i:0{width}d}" for i in range(count)]


@dataclass(frozen=True)
class Topics:
    federation: str

    def __post_init__(self) -> None:
        check_name(self.federation, "federation")

    @property
    def base(self) -> str:
        return f"{ROOT}/{self.federation}"

    @property
    def rounds(self) -> str:
        """Retained round announcements, server -> every device."""
        return f"{self.base}/round"

    def up(self, device: str) -> str:
        """Device -> server: uploads and their chunks."""
        return f"{self.base}/dev/{device}/up"

    def down(self, device: str) -> str:
        """Server -> device: downloads, acks and nacks."""
        return f"{self.base}/dev/{device}/down"

    def presence(self, who: str) -> str:
        """Retained ``online``; the last will publishes ``offline``."""
        return f"{self.base}/presence/{who}"

    @property
    def all_up(self) -> str:
        return f"{self.base}/dev/+/up"

    @property
    def all_presence(self) -> str:
        return f"{self.base}/presence/+"

    def device_of(self, topic: str) -> str | None:
        """The device a ``dev/<id>/up`` or ``presence/<id>`` topic belongs to."""
        parts = topic.split("/")
        base = self.base.split("/")
        if parts[: len(base)] != base:
            return None
        rest = parts[len(base) :]
        if len(rest) == 3 and rest[0] == "dev" and rest[2] == "up":
            return rest[1]
        if len(rest) == 2 and rest[0] == "presence":
            return rest[1]
        return None
