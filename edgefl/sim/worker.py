"""A simulation worker process (``python -m edgefl.sim.worker``, started by :class:`ProcessHost`):
serves host frames on stdin/stdout. Kept apart from :mod:`edgefl.sim.hosts`, which the package
imports, so ``-m`` runs a module not yet loaded."""

import os
import sys

from edgefl.sim.hosts import serve

if __name__ == "__main__":
    # frames own the real stdout; anything else printed goes to stderr (a stray print would corrupt a frame)
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, frames)
