"""``mpishard bench comm`` and ``bench calibrate``: a bad flag or output path is one line and
exit status 2, found before anything is measured; a good path gets its missing folders."""
import json
import os

import pytest

from ckpt_scripts.common import MPIEXEC, ranks_stderr, run_mpishard as mpishard
from mpishard.bench import calibrate, comm


def _never(*args, **kwargs):
    raise AssertionError("measured although a flag or the output path was bad")


def _refusal(main, argv, capsys) -> list:
    """The stderr lines of ``main(argv)``, which must exit with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("argv,message", [
    (["--iters", "0"], "--iters 0 must be at least 1: the timed samples per cell, "
                       "e.g. --iters 40"),
    (["--iters", "-3"], "--iters -3 must be at least 1: the timed samples per cell, "
                        "e.g. --iters 40"),
    (["--warmup", "-1"], "--warmup -1 must be at least 0: the untimed calls before them, "
                         "e.g. --warmup 3"),
    (["--sizes-mib", "1", "0"], "--sizes-mib 0: each size must be above 0: MiB in a message, "
                                "e.g. --sizes-mib 0.25 1 16"),
    (["--sizes-mib", "-2"], "--sizes-mib -2: each size must be above 0: MiB in a message, "
                            "e.g. --sizes-mib 0.25 1 16"),
    (["--sizes-mib", "nan"], "--sizes-mib nan: each size must be above 0: MiB in a message, "
                             "e.g. --sizes-mib 0.25 1 16"),
    (["--iters", "x"], "argument --iters: invalid int value: 'x'"),
])
def test_comm_flags_refused_before_measuring(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(comm, "run", _never)
    assert _refusal(comm.main, argv, capsys) == [
        f"mpishard bench comm: error: {message} (see mpishard bench comm --help)"]


def test_output_paths_refused_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(comm, "run", _never)
    monkeypatch.setattr(calibrate, "calibrate", _never)
    monkeypatch.setattr(calibrate, "_merge", _never)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for main, prog, flag, example in ((comm.main, "comm", "--json", "comm.json"),
                                      (calibrate.main, "calibrate", "-o", "machine.json")):
        assert _refusal(main, [flag, str(tmp_path)], capsys) == [
            f"mpishard bench {prog}: error: {flag} {tmp_path} is a folder; pass a file name, "
            f"e.g. {tmp_path / example} (see mpishard bench {prog} --help)"]
        under = blocker / "x.json"
        assert _refusal(main, [flag, str(under)], capsys) == [
            f"mpishard bench {prog}: error: {flag} {under} lies under {blocker}, a file, so "
            f"nothing can be written there; pass another path (see mpishard bench {prog} "
            f"--help)"]
    # --merge measures nothing, but reads files: the output is checked first all the same
    lines = _refusal(calibrate.main, ["--merge", "m1.json", "m2.json", "-o", str(tmp_path)],
                     capsys)
    assert lines[0].startswith(f"mpishard bench calibrate: error: -o {tmp_path} is a folder")
    assert _refusal(calibrate.main, ["--repeats", "0"], capsys) == [
        "mpishard bench calibrate: error: --repeats 0 must be at least 1: the timed repeats "
        "per point, e.g. --repeats 7 (see mpishard bench calibrate --help)"]
    assert _refusal(calibrate.main, ["--repeats", "-2"], capsys)[0].startswith(
        "mpishard bench calibrate: error: --repeats -2 must be at least 1")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_output_folder_without_write_permission(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(comm, "run", _never)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert _refusal(comm.main, ["--json", str(locked / "sub" / "c.json")], capsys) == [
            f"mpishard bench comm: error: --json {locked / 'sub' / 'c.json'} cannot be written "
            f"(no permission to write in {locked}); pass another path (see mpishard bench "
            f"comm --help)"]
    finally:
        locked.chmod(0o700)


def test_through_the_command_line(tmp_path):
    """One line and status 2 at once (64 MiB x 100000 samples would take hours), on one
    rank and on two (rank 0 decides, both exit); a good path gets its missing folders."""
    refused = mpishard("bench", "comm", "--sizes-mib", "64", "--iters", "100000", "--json",
                       tmp_path, timeout=60)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        f"mpishard bench comm: error: --json {tmp_path} is a folder; pass a file name, e.g. "
        f"{tmp_path / 'comm.json'} (see mpishard bench comm --help)"]
    if MPIEXEC.exists():
        two = mpishard("bench", "comm", "--sizes-mib", "64", "--iters", "100000", "--json",
                       tmp_path, n=2, timeout=60)
        assert two.returncode == 2
        assert ranks_stderr(two.stderr).splitlines() == refused.stderr.splitlines()
    out = tmp_path / "new" / "sub" / "comm.json"
    ran = mpishard("bench", "comm", "--sizes-mib", "0.25", "--collectives", "all_reduce",
                   "--iters", "1", "--warmup", "0", "--json", out, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert "all_reduce        0.25MiB" in ran.stdout          # not a row of "0MiB"
    assert json.loads(out.read_text())["results"][0]["bytes"] == 2**18
