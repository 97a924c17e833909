"""Server halves, one module per method."""

from edgefl.server.methods.base import ClientInfo, Receipt, ServerHalf

__all__ = ["ClientInfo", "Receipt", "ServerHalf"]
