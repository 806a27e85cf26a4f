"""Consolidate a checkpoint in a fresh process and report its peak memory as JSON.

    python tests/ckpt_scripts/consolidate_rss.py STEP_DIR OUT.safetensors

The peak is this process's own high-water mark, ``VmHWM`` of /proc/self/status:
``getrusage(RUSAGE_SELF).ru_maxrss`` would not do, because Linux carries the
parent's peak over fork and exec into it (so a child of a big test process
would report the test's memory).
"""
import json
import resource
import sys
from pathlib import Path

from mpishard.checkpoint import consolidate


def high_water_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


before = high_water_kib()
consolidate(sys.argv[1], sys.argv[2])
print(json.dumps({"before_kib": before, "peak_kib": high_water_kib(),
                  "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "mpi": "mpi4py" in sys.modules}))
