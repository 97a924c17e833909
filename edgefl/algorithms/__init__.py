"""Client halves of the federated methods, one module per method."""

from edgefl.algorithms.base import ClientHalf, ClientSetup, MethodOptions
from edgefl.algorithms.registry import METHODS, MethodSpec, get_method

__all__ = ["METHODS", "ClientHalf", "ClientSetup", "MethodOptions", "MethodSpec", "get_method"]
