"""Local-only: the server sends and keeps nothing; devices report that they trained."""

from __future__ import annotations

from edgefl.messages import Message
from edgefl.server.methods.base import Receipt, ServerHalf


class LocalServer(ServerHalf):
    def downlink(self, round_no: int, client_id: str) -> Message | None:
        return None

    def accept(self, message: Message) -> Receipt:
        if message.tensors:
            return Receipt("rejected", "local-only devices share nothing: a status report carries no tensors")
        return Receipt("accepted")
