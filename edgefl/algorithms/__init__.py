"""Client halves of the federated methods, one module per method (the registry of methods, with
their server halves and traits, is :mod:`edgefl.methods`)."""

from edgefl.algorithms.base import ClientHalf, ClientSetup, MethodOptions

__all__ = ["ClientHalf", "ClientSetup", "MethodOptions"]
