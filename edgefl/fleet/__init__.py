"""Fleet runs over MQTT: the device runner, a local broker and the fleet launcher."""
