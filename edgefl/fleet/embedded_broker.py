"""The embedded fallback broker: amqtt (pure Python, MQTT 3.1.1 only) bound to 127.0.0.1.

Used by ``edgefl fleet`` only when no mosquitto binary is installed. It is about three times
slower than mosquitto and keeps no sessions for anonymous clients, which the protocol survives
(a device that joins late gets its download again), but it is a fallback for one machine, never
a deployment broker. It runs in its own process so its event loop does not share the server's GIL::

    python -m edgefl.fleet.embedded_broker --port 18830
"""

from __future__ import annotations

import argparse
import asyncio


def broker_config(port: int) -> dict:
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }


async def serve(port: int) -> None:
    from amqtt.broker import Broker

    broker = Broker(broker_config(port))
    await broker.start()
    try:
        await asyncio.Event().wait()
    finally:
        await broker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description="edgefl's embedded MQTT 3.1.1 broker (amqtt), loopback only")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
