"""Fleet transport: the wire envelope, chunked transfers, MQTT topics and connections."""
