"""Kill one rank at random moments of checkpoint saves: the checkpoints must survive.

    python benchmarks/checkpoint_kill.py --kills 20          # ~1-2 s per kill on 2 CPU cores

Each round starts ``mpiexec -n 2 python -m mpi4py tests/ckpt_scripts/kill_saver.py DIR``,
which loads and checks the newest complete checkpoint left by the previous round,
saves again to the step that round was writing (a leftover ``step-N.tmp`` or a
replaced ``step-N``), prints "ready" and then saves in a loop (a 2-block ZeRO-3 GPT,
AdamW state, keep_last=2). After a random 0-0.3 s, one rank chosen at random gets
SIGKILL; the launcher ends the job. From outside, every complete checkpoint in DIR
must then verify (manifest seal and schema, coverage, headers, SHA-256). A final
round checks the last kill's leftovers and exits 0. Prints the figures and exits 1
on any failure.
"""
from __future__ import annotations

import argparse
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from ckpt_scripts.common import clean_env, mpiexec_command, reap_shared_memory  # noqa: E402
from mpishard.checkpoint import latest_checkpoint, verify_checkpoint  # noqa: E402
from mpishard.checkpoint.locate import complete_steps  # noqa: E402


def _lines(proc) -> queue.Queue:
    out: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            out.put(line.rstrip("\n"))
        out.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return out


def _round(directory: Path, rng: random.Random, final: bool, timeout: float = 60) -> dict:
    """One launch: wait for "ready", kill a rank after a random delay (unless final)."""
    pid_dir = Path(tempfile.mkdtemp(prefix="mpishard-pids-"))
    cmd = mpiexec_command("kill_saver.py", directory, pid_dir, *(["--final"] if final else []))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, log, deadline = _lines(proc), [], time.monotonic() + timeout
    try:
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                break
            log.append(line)
            if line == "ready":
                break
        if "ready" not in log:
            raise RuntimeError("the saver never got ready:\n" + "\n".join(log[-30:]))
        victim = None
        pids = {int(p.name): int(p.read_text()) for p in pid_dir.iterdir()}
        if not final:
            time.sleep(rng.uniform(0.0, 0.3))
            victim = rng.choice(sorted(pids))
            os.kill(pids[victim], signal.SIGKILL)
        rc = proc.wait(timeout=timeout)
        while (line := lines.get(timeout=5)) is not None:
            log.append(line)
    except (queue.Empty, subprocess.TimeoutExpired):
        proc.kill()
        raise RuntimeError("a round hung:\n" + "\n".join(log[-30:])) from None
    finally:
        shutil.rmtree(pid_dir, ignore_errors=True)
    if final and rc != 0:
        raise RuntimeError(f"the final round failed (rc {rc}):\n" + "\n".join(log[-30:]))
    if not final and rc == 0:
        raise RuntimeError("the killed job exited 0:\n" + "\n".join(log[-30:]))
    loaded = [line for line in log if line.startswith("loaded ")]
    return {"saves": sum(line.startswith("saved ") for line in log), "victim": victim,
            "loaded": loaded[0] if loaded else "nothing (first round)"}


def _state(directory: Path) -> dict:
    """What a kill left: leftovers, and whether `latest` lags the newest complete step."""
    names = {p.name for p in directory.iterdir()}
    steps = complete_steps(directory)
    latest = latest_checkpoint(directory)
    return {"tmp": any(n.endswith(".tmp") for n in names),
            "old": any(n.endswith(".old") for n in names),
            "lagging": bool(steps) and latest is not None and latest != steps[max(steps)]}


def run(kills: int, seed: int, directory: Path) -> dict:
    rng = random.Random(seed)
    totals = {"kills": 0, "saves": 0, "verified": 0, "tmp_left": 0, "old_left": 0,
              "latest_lagging": 0}
    start = time.monotonic()
    for i in range(kills):
        with reap_shared_memory():     # what the killed job's MPI leaves in /dev/shm
            result = _round(directory, rng, final=False)
        state = _state(directory)
        for step, path in complete_steps(directory).items():
            verify_checkpoint(path)          # raises CheckpointError if anything is torn
            totals["verified"] += 1
        totals["kills"] += 1
        totals["saves"] += result["saves"]
        totals["tmp_left"] += state["tmp"]
        totals["old_left"] += state["old"]
        totals["latest_lagging"] += state["lagging"]
        print(f"kill {i + 1:3d}: rank {result['victim']} after {result['saves']:3d} saves; "
              f"started from {result['loaded']}; leftovers: "
              f"{', '.join(k for k, v in state.items() if v) or 'none'}", flush=True)
    final = _round(directory, rng, final=True)
    totals["seconds"] = round(time.monotonic() - start, 1)
    totals["final"] = final["loaded"]
    return totals


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", help="checkpoint directory (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    directory = Path(args.dir or tempfile.mkdtemp(prefix="mpishard-kill-"))
    try:
        totals = run(args.kills, args.seed, directory)
    except Exception as err:  # noqa: BLE001 -- report and fail
        print(f"FAILED: {type(err).__name__}: {err}", flush=True)
        return 1
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    print("checkpoint_kill: " + ", ".join(f"{k} {v}" for k, v in totals.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
