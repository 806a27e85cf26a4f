"""Nothing on a checkpoint path can run code from a file: no pickle, checked by reading the source.

The checkpoint package may not use ``pickle`` (or ``marshal``, ``shelve``,
``dill``), ``np.load``/``numpy.load`` (whose ``allow_pickle`` is one keyword away),
``torch.load``, ``eval``/``exec``, mpi4py's lower-case (pickling) methods, or the
``*_obj`` forms of Communicator that wrap them. Comments and strings are ignored
(the docs may say "pickle"); code is read token by token.
"""
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mpishard" / "checkpoint"
FORBIDDEN_NAMES = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle",
                   "allow_pickle", "eval", "exec", "__import__"}
# mpi4py's pickling methods, and Communicator's *_obj forms that call them
FORBIDDEN_ATTRIBUTES = {"bcast", "allgather", "gather", "scatter", "alltoall", "allreduce",
                        "reduce", "send", "recv", "isend", "irecv", "sendrecv", "ssend",
                        "mprobe", "all_gather_obj", "broadcast_obj", "gather_obj",
                        "all_reduce_obj", "load", "loads"}
ALLOWED_CALLS = {("json", "loads")}   # JSON carries data only


def violations(source: str, filename: str) -> list:
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type in (tokenize.NAME, tokenize.OP)]
    found = []
    for i, tok in enumerate(tokens):
        where = f"{filename}:{tok.start[0]}"
        if tok.type != tokenize.NAME:
            continue
        after_dot = i > 0 and tokens[i - 1].string == "."
        owner = tokens[i - 2].string if after_dot and i > 1 else None
        if tok.string in FORBIDDEN_NAMES and not (after_dot and tok.string == "exec"):
            found.append(f"{where}: {tok.string}")
        elif after_dot and tok.string in FORBIDDEN_ATTRIBUTES \
                and (owner, tok.string) not in ALLOWED_CALLS:
            found.append(f"{where}: .{tok.string}")
    return found


def test_no_pickle_on_any_checkpoint_path():
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 8
    bad = [v for path in files for v in violations(path.read_text(), path.name)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("line", [
    "import pickle", "data = np.load(path, allow_pickle=True)", "comm.mpi.bcast(obj)",
    "x = world.all_gather_obj(names)", "torch.load(f)", "eval(text)", "np.load(path)"])
def test_the_checker_can_fail(line):
    assert violations(line + "\n", "probe.py")


def test_the_checker_ignores_words_in_strings_and_comments():
    assert violations('"no pickle here"  # nor pickle\njson.loads(s)\n', "probe.py") == []


def test_importing_the_package_does_not_start_mpi():
    code = "import sys, mpishard.checkpoint; assert 'mpi4py' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=PACKAGE.parent.parent)
    assert proc.returncode == 0, proc.stderr
