"""Memory of the server's chunk reassembler under the slow-drip attack of issue 33: hostile devices
open as many partial uploads as they may and feed each all but its last chunk, or one chunk now and
then so that it never goes stale; and finished upload ids pile up.

    ./dev.sh bench partial_budget                    # 16 MiB messages (scaled down from 256 MiB), 3 devices

Each case runs in a fresh process and prints its resident memory growth (psutil RSS after minus
before feeding) with the bytes the reassembler holds, "unbounded" (the reassembler as it was:
budgets so large they never apply, no age limit, every finished id remembered) against the
defaults (per device 2 x max_message_bytes, in all network.max_partial_bytes_total, here scaled to
4 x max_message_bytes as 1 GiB is to 256 MiB; partial_max_age_s = 4 x stale_upload_s; 4,096
finished ids).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types

import psutil

from common import save

MIB = 1 << 20


def rss() -> int:
    return psutil.Process().memory_info().rss


def reassembler(bounded: bool, max_message: int):
    from edgefl.transport.chunks import STALE_STRIKES, Reassembler

    if bounded:
        return Reassembler(max_message, 120.0, max_partial_bytes=4 * max_message, max_age_s=(STALE_STRIKES + 1) * 120.0)
    return Reassembler(max_message, 120.0, max_sender_bytes=1 << 62, max_partial_bytes=1 << 62, max_age_s=None, max_completed=1 << 62)


def chunk(sender: str, upload_id: str, seq: int, count: int, size: int):
    from edgefl.transport.envelope import Envelope

    return Envelope("chunk", "bench", 1, sender, b"x" * size, codec="none",  # a new bytes object per chunk, as off the wire
                    extra={"chunk": {"upload_id": upload_id, "seq": seq, "count": count, "total_length": count * size,
                                     "total_sha256": "0" * 64}})


def fill(bounded: bool, devices: int, max_message: int) -> dict:
    """Every device opens 4 uploads of the largest size and sends all chunks but the last."""
    from edgefl.errors import PayloadError

    r = reassembler(bounded, max_message)
    count = max_message // MIB
    refused = 0
    before = rss()
    for d in range(devices):
        for u in range(4):
            for seq in range(count - 1):
                try:
                    r.add(chunk(f"client-{d}", f"upload-{u}", seq, count, MIB))
                except PayloadError:
                    refused += 1
    return {"rss_growth_mib": (rss() - before) / MIB, "held_mib": r.held_bytes / MIB, "refused_chunks": refused,
            "partials": len(r.partial)}


def drip(bounded: bool, max_message: int) -> dict:
    """One partial fed one 1 MiB chunk every 100 s (stale_upload_s = 120 s) for an hour, on a fake clock."""
    import edgefl.transport.chunks as chunks
    from edgefl.errors import PayloadError

    clock = [0.0]
    chunks.time = types.SimpleNamespace(monotonic=lambda: clock[0])  # the reassembler's clock only
    r = reassembler(bounded, max_message)
    count = max_message // MIB
    drops: list[float] = []
    refused, peak = 0, 0
    for step in range(36):
        clock[0] = step * 100.0
        try:
            r.add(chunk("client-0", "drip", step % (count - 1), count, MIB))
        except PayloadError:
            refused += 1
        peak = max(peak, r.held_bytes)
        drops += [clock[0] for _, _, _, dropped in r.collect_stale() if dropped]
    return {"first_drop_s": drops[0] if drops else None, "drops": len(drops), "peak_held_mib": peak / MIB, "refused_chunks": refused}


def completed(bounded: bool, uploads: int) -> dict:
    """``uploads`` finished one-chunk uploads from 100 devices: the ids remembered and their memory."""
    from edgefl.transport.chunks import split
    from edgefl.transport.envelope import Envelope, unpack

    r = reassembler(bounded, 16 * MIB)
    pieces = []
    for i in range(uploads):
        env = Envelope("upload", "bench", 1, f"client-{i % 100}", b"w" * 64, codec="none")
        pieces.append(unpack(split(env, threshold=0)[0], 1 << 20))
    before = rss()
    for piece in pieces:
        r.add(piece)
    return {"rss_growth_mib": (rss() - before) / MIB, "ids_remembered": len(r.completed)}


def one(case: str, bounded: bool, args: argparse.Namespace) -> dict:
    if case == "fill":
        return fill(bounded, args.devices, args.max_message_mib * MIB)
    if case == "drip":
        return drip(bounded, args.max_message_mib * MIB)
    return completed(bounded, args.uploads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-message-mib", type=int, default=16)
    ap.add_argument("--devices", type=int, default=3)
    ap.add_argument("--uploads", type=int, default=20_000)
    ap.add_argument("--one", nargs=2, metavar=("CASE", "BOUNDED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1] == "1", args)))
        return
    results: dict[str, dict] = {}
    for case in ("fill", "drip", "completed"):
        for bounded in (False, True):
            cmd = [sys.executable, __file__, "--one", case, "1" if bounded else "0", "--max-message-mib", str(args.max_message_mib),
                   "--devices", str(args.devices), "--uploads", str(args.uploads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results[f"{case}/{'bounded' if bounded else 'unbounded'}"] = json.loads(out.strip().splitlines()[-1])
    m = args.max_message_mib
    print(f"max_message_bytes = {m} MiB, {args.devices} hostile devices x 4 uploads x all but the last 1 MiB chunk")
    print("| case | reassembler | RSS growth | held by the reassembler | refused chunks |")
    print("|---|---|---|---|---|")
    for bounded in ("unbounded", "bounded"):
        r = results[f"fill/{bounded}"]
        print(f"| fill | {bounded} | {r['rss_growth_mib']:.0f} MiB | {r['held_mib']:.0f} MiB in {r['partials']} partials | "
              f"{r['refused_chunks']} |")
    for bounded in ("unbounded", "bounded"):
        r = results[f"drip/{bounded}"]
        when = (f"first dropped at {r['first_drop_s']:.0f} s ({r['drops']} drops)" if r["first_drop_s"] is not None
                else "never dropped")
        print(f"| drip (1 chunk / 100 s, 1 h) | {bounded} | - | at most {r['peak_held_mib']:.0f} MiB, {when} | {r['refused_chunks']} |")
    for bounded in ("unbounded", "bounded"):
        r = results[f"completed/{bounded}"]
        print(f"| {args.uploads:,} finished uploads | {bounded} | {r['rss_growth_mib']:.1f} MiB | {r['ids_remembered']:,} ids | - |")
    save("partial_budget", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
