"""Coverage-guided fuzzing (atheris, libFuzzer) of everything a device's bytes pass through on the
server: the envelope, the chunk reassembler, the bounded JSON decoder, the message decoder and the
round loop's handler with a round open (a FedAvg simulation on digits as the server).

A crash is any exception other than PayloadError from a decoder, and any message the round loop
could only survive through its last-resort catch (it logs "unexpected failure"): both mean a check
is missing. The fuzzer starts from valid messages (an upload, a chunk of a larger upload, a nack)
so it explores past the magic number. Prints and saves (bench/results/fuzz_protocol.json) the
executions, the coverage reached and the crashes found.

    python bench/fuzz_protocol.py --seconds 300
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def seed_corpus(folder: Path) -> int:
    """Valid messages for the fuzzer to mutate."""
    import torch

    from edgefl.messages import Message, encode
    from edgefl.transport.chunks import split
    from edgefl.transport.envelope import Envelope, pack, tensor_manifest

    folder.mkdir(parents=True, exist_ok=True)
    small = Message("weights", 2, "client-0", {"w": torch.ones(4, 2), "n": torch.tensor([3])}, {"num_samples": 5, "train_loss": 0.5})
    env = Envelope("upload", "test-fedavg", 2, "client-0", encode(small), small.message_id, model_version=2, codec="safetensors",
                   extra={"tensors": tensor_manifest(small.tensors)})
    big = Message("weights", 2, "client-0", {"w": torch.ones(3000)}, {"num_samples": 5})
    big_env = Envelope("upload", "test-fedavg", 2, "client-0", encode(big), big.message_id, model_version=2, codec="safetensors")
    pieces = split(big_env, chunk_bytes=4096, threshold=4096)
    nack = Envelope("nack", "test-fedavg", 2, "server", reply_to="a" * 32, extra={"reason": "x", "missing": [1, 2]})
    samples = [pack(env), pieces[0], pieces[-1], pack(nack), encode(small)]
    for i, data in enumerate(samples):
        (folder / f"seed-{i}").write_bytes(data)
    return len(samples)


def child() -> None:
    """The fuzzing process (libFuzzer options follow on the command line)."""
    import atheris

    with atheris.instrument_imports(include=["edgefl.safejson", "edgefl.messages", "edgefl.transport", "edgefl.server"]):
        from edgefl.errors import PayloadError
        from edgefl.messages import decode
        from edgefl.safejson import loads
        from edgefl.server.rounds import RoundState
        from edgefl.transport.base import Delivery
        from edgefl.transport.chunks import Reassembler
        from edgefl.transport.envelope import unpack

    from edgefl.config import validate_config
    from edgefl.sim import Simulation

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.conftest import digits_config

    sim = Simulation(validate_config(digits_config("fedavg", rounds=3)), show_progress=False)
    sim.run_round(1)
    endpoint, policy = sim.session.endpoint, sim.session.policy
    logging.getLogger("edgefl.server").setLevel(logging.ERROR)  # refusals are expected: keep the output to crashes

    class Unexpected(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                raise AssertionError(f"the round loop hit its last-resort catch: {record.getMessage()}")

    logging.getLogger("edgefl.server").addHandler(Unexpected())
    reassembler = Reassembler(1 << 20)

    def one_input(data: bytes) -> None:
        for decoder in (lambda: loads(data), lambda: decode(data)):
            try:
                decoder()
            except PayloadError:
                pass
        try:
            env = unpack(data, 1 << 20)
            if env.type == "chunk":
                reassembler.add(env)
        except PayloadError:
            pass
        if len(reassembler.partial) > 64:
            reassembler.partial.clear()
        now = policy.clock.now()
        if policy.state is None:
            policy.state = RoundState(2, list(endpoint.device_ids), now, now + 100)
        endpoint.handle(Delivery("message", "client-0", data))
        for inbox in sim.network._inbox.values():
            inbox.clear()
        if len(policy.state.reported) > 2:
            policy.state = None

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=120, help="fuzzing time")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        sys.argv = [sys.argv[0], *rest]
        child()
        return
    from common import save

    work = Path(tempfile.mkdtemp(prefix="edgefl-fuzz-"))
    seeds = seed_corpus(work / "corpus")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, __file__, "--child", str(work / "corpus"), f"-max_total_time={args.seconds}",
                          "-max_len=8192", f"-artifact_prefix={work}/", "-print_final_stats=1"],
                         capture_output=True, text=True, cwd=Path(__file__).parent)
    wall = time.perf_counter() - t0
    log = res.stderr
    runs = re.search(r"Done (\d+) runs in (\d+) second", log)
    stat = {k: int(v) for k, v in re.findall(r"stat::(\w+):\s+(\d+)", log)}
    cov = re.findall(r"cov: (\d+) ft: (\d+)", log)
    crashes = sorted(p.name for p in work.glob("crash-*")) + sorted(p.name for p in work.glob("oom-*")) \
        + sorted(p.name for p in work.glob("timeout-*"))
    result = {
        "seconds": args.seconds,
        "wall_s": round(wall, 1),
        "executions": int(runs.group(1)) if runs else stat.get("number_of_executed_units"),
        "executions_per_s": stat.get("average_exec_per_sec"),
        "coverage_edges": int(cov[-1][0]) if cov else None,
        "features": int(cov[-1][1]) if cov else None,
        "corpus_seeds": seeds,
        "crashes": len(crashes),
        "crash_files": [str(work / c) for c in crashes],
        "fuzzer_exit_code": res.returncode,
    }
    if res.returncode != 0 and not crashes:
        result["log_tail"] = log[-3000:]
    print(json.dumps(result, indent=2))
    print(f"saved {save('fuzz_protocol', result)}")
    if crashes or res.returncode != 0:
        print(log[-4000:], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
