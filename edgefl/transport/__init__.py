"""Fleet transport: the wire envelope, chunked transfers, MQTT topics and connections.

The built-in transports register their URL schemes here, on the package's import, so that
:mod:`edgefl.transport.registry` (imported only after this) knows them without importing them
itself (they import the registry to register).
"""

# MQTT first: its URL shapes lead the list an unknown scheme is answered with
from edgefl.transport import mqtt, memory  # noqa: F401  (registers mqtt://, mqtts://, tcp://, memory://)
