"""Local-only: the server sends and keeps nothing."""

from edgefl.server.methods.base import ServerHalf


class LocalServer(ServerHalf):
    pass
