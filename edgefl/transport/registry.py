"""Which transport a broker URL names: a table from URL scheme to the two factories of a transport.

``edgefl server``, ``edgefl client`` and ``edgefl fleet`` take one URL (``--broker``); its scheme
picks the transport, so nothing above this module names an implementation. Built in:

* ``mqtt://HOST:PORT``, ``mqtts://HOST:PORT`` (TLS), ``tcp://`` (paho's name for ``mqtt://``):
  :mod:`edgefl.transport.mqtt`, through a broker;
* ``memory://NAME``: :mod:`edgefl.transport.memory`, an in-process hub (the server and device
  loops as threads of one process, no broker).

A new transport implements :mod:`edgefl.transport.base` and calls :func:`register_transport`
(docs/architecture.md, "Adding a transport"). The built-ins register when
:mod:`edgefl.transport` is imported, which any import of this module does first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from edgefl.configtools import suggest
from edgefl.errors import EdgeflError
from edgefl.transport.base import DeviceTransport, ServerTransport
from edgefl.transport.topics import Topics


#: ``server(url, topics, **options)``: the server's side, connected (a callable with keyword
#: options of its own, like MQTT's ``connect``, rather than a Protocol's ``**options``)
ServerFactory = Callable[..., ServerTransport]
#: ``device(url, topics, device_id, **options)``: one device's side, connected
DeviceFactory = Callable[..., DeviceTransport]


@dataclass(frozen=True)
class TransportKind:
    """One registered scheme. The launcher hands every factory the same keyword options, MQTT's
    connection settings (``max_packet_bytes``, ``keepalive_s``, ``protocol``, ``username``,
    ``password``, ``ca_file``): a transport that needs fewer takes ``**options`` and ignores the
    rest, so the launcher never asks which transport it is talking to."""

    scheme: str
    server: ServerFactory
    device: DeviceFactory
    #: the URL's shape, for messages and help: ``mqtt://HOST:PORT``
    example: str
    #: the port when the URL names none (None: the scheme has no ports)
    default_port: int | None = None
    #: the connection is encrypted (mqtts://): what the open-broker warning asks
    tls: bool = False
    #: reachable only from this process (memory://): ``edgefl fleet`` runs its devices as
    #: threads, ``edgefl server`` and ``edgefl client`` refuse it (nothing could join)
    in_process: bool = False


_KINDS: dict[str, TransportKind] = {}


def register_transport(scheme: str, server: ServerFactory, device: DeviceFactory, *, example: str | None = None,
                       default_port: int | None = None, tls: bool = False, in_process: bool = False,
                       replace: bool = False) -> TransportKind:
    """Make ``scheme://`` URLs open this transport. A scheme is registered once (``replace``
    to swap it, e.g. a test's fake): two modules claiming one scheme is a mistake to see."""
    scheme = scheme.lower()
    if not scheme.isascii() or not scheme.replace("+", "").replace("-", "").replace(".", "").isalnum() or not scheme[0].isalpha():
        raise ValueError(f"transport scheme {scheme!r}: a URL scheme is a letter then letters, digits, '+', '-' or '.'")
    if scheme in _KINDS and not replace:
        raise ValueError(f"transport scheme {scheme!r} is already registered")
    kind = TransportKind(scheme, server, device, example or f"{scheme}://HOST", default_port, tls, in_process)
    _KINDS[scheme] = kind
    return kind


def unregister_transport(scheme: str) -> None:
    """Forget a scheme (a test's own transport, after the test)."""
    _KINDS.pop(scheme.lower(), None)


def schemes() -> list[str]:
    """The registered schemes, sorted."""
    return sorted(_KINDS)


def transport_for(url: str) -> TransportKind:
    """The transport ``url``'s scheme names; an unknown scheme is refused naming the registered
    ones (and the closest, for a typo)."""
    scheme, sep, _ = url.partition("://")
    if sep and scheme.lower() not in _KINDS:
        from edgefl.plugins import load_plugins

        load_plugins()
    kind = _KINDS.get(scheme.lower()) if sep else None
    if kind is None:
        shapes = list(dict.fromkeys(k.example for k in _KINDS.values()))  # registration order: MQTT's first
        expected = ", ".join(shapes[:-1]) + f" or {shapes[-1]}" if len(shapes) > 1 else "".join(shapes)
        unknown = f"unknown transport scheme {scheme!r}{suggest(scheme.lower(), _KINDS)}; " if sep else ""
        raise EdgeflError(f"broker {url!r}: {unknown}expected {expected}",
                          hint="a transport of your own registers its scheme with edgefl.transport.registry.register_transport, "
                               "in a plug-in (docs/adding-a-method.md, section 5)")
    return kind


def server_transport(url: str, topics: Topics, **options: Any) -> ServerTransport:
    """The server's side of ``url``'s transport, connected."""
    return transport_for(url).server(url, topics, **options)


def device_transport(url: str, topics: Topics, device: str, **options: Any) -> DeviceTransport:
    """One device's side of ``url``'s transport, connected."""
    return transport_for(url).device(url, topics, device, **options)


@dataclass(frozen=True)
class BrokerAddress:
    """A broker URL of a registered scheme, parsed: the host (a hub's name for memory://), the
    port (the scheme's default when none is given; None for a scheme without ports), whether
    it is TLS (mqtts://)."""

    host: str
    port: int | None
    tls: bool = False
    scheme: str = "mqtt"

    @classmethod
    def parse(cls, url: str) -> BrokerAddress:
        kind = transport_for(url)
        try:
            parsed = urlparse(url)
            port = parsed.port
        except ValueError as exc:  # a port that is not a number, or out of range
            raise EdgeflError(f"broker {url!r}: {exc}", hint=f"expected {kind.example}") from None
        if not parsed.hostname:
            raise EdgeflError(f"broker {url!r}: no host", hint=f"expected {kind.example}")
        return cls(parsed.hostname, port or kind.default_port, kind.tls, kind.scheme)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}" + (f":{self.port}" if self.port is not None else "")
