"""User-facing errors: each says what went wrong and what to do about it."""

from __future__ import annotations


class EdgeflError(Exception):
    """An error caused by the user's input or environment, with a hint for fixing it.

    The CLI prints these without a traceback; anything else is a bug and keeps its traceback.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


class ConfigError(EdgeflError):
    """A configuration file or override that does not validate."""


class DataError(EdgeflError):
    """A dataset that is missing, truncated or malformed."""


class PayloadError(EdgeflError):
    """A message that cannot be decoded safely (bad header, size, dtype...).

    ``message_id``: the id of the envelope whose header parsed before the problem showed (a field
    rule broken, a bad body length or SHA-256), so a refusal can still answer it; None when even
    the header failed or held no usable id. ``round_no``: that header's round, when it held a valid one."""

    def __init__(self, message: str, hint: str | None = None, message_id: str | None = None,
                 round_no: int | None = None) -> None:
        super().__init__(message, hint)
        self.message_id = message_id
        self.round_no = round_no


class BrokerUnreachable(EdgeflError):
    """The MQTT broker could not be reached or did not accept the connection (yet)."""


class SubscriptionsUnconfirmed(BrokerUnreachable):
    """The broker accepted the connection but did not acknowledge every subscription in time (an
    overloaded or misconfigured broker): retried as an unreachable broker is, with its own hint."""
