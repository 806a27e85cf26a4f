"""``mpishard plan``'s own flags: a count below 1 is refused in one line naming the flag
and its value; where no layout fits, one line says so and what would help (exit 0: the
input is fine), and --json lists no layouts."""
import json
import sys
import threading

import pytest

from mpishard.cli.main import main


@pytest.fixture
def keep_hooks(monkeypatch):
    """main() installs an abort-on-exception hook; put the test process's back after."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)


@pytest.mark.parametrize("flag, value, words", [
    ("--seq", "-5", "(tokens per sequence; left out: the model's block size)"),
    ("--seq", "0", "(tokens per sequence; left out: the model's block size)"),
    ("--global-batch", "0", "(sequences per step; left out: --batch-size x ranks)"),
    ("--ranks-per-node", "0", "(ranks on each node; left out: the machine's)"),
    ("--ranks-per-node", "-2", "(ranks on each node; left out: the machine's)"),
    ("--top", "-1", "(layouts to print; left out: 5)"),
    ("--top", "0", "(layouts to print; left out: 5)"),
])
def test_a_count_below_one_is_refused_naming_the_flag(flag, value, words, keep_hooks,
                                                      capsys):
    assert main(["plan", "--ranks", "4", flag, value]) == 2
    out = capsys.readouterr()
    assert out.err == f"mpishard: error: {flag} {value} must be >= 1 {words}\n"
    assert out.out == ""


def test_no_layout_that_fits_says_what_would_help(keep_hooks, capsys):
    flags = ["plan", "--preset", "gpt2", "--ranks", "1", "--memory-budget", "256MiB"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].endswith(" over 256.0 MiB (--memory-budget) per rank, 0 fit"), out
    n = int(lines[0].split()[0])
    assert lines[1] == (f"none of the {n} layouts fits 256.0 MiB (--memory-budget) per rank; "
                        f"what would help: more ranks, a larger --memory-budget, a shorter "
                        f"--seq, or --offload optimizer (or params)")
    assert "strategy" not in out and "---" not in out         # no empty table
    assert main([*flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layouts"] == [] and plan["candidates"] == n == plan["over_memory"]


def test_where_offload_was_tried_it_is_not_suggested(keep_hooks, capsys):
    assert main(["plan", "--preset", "gpt2", "--ranks", "1", "--machine", "h100-sxm",
                 "--memory-budget", "256MiB", "--tp", "1"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.endswith(" per rank (optimizer and parameter offload were tried); what "
                         "would help: more ranks, a larger --memory-budget, a shorter --seq, "
                         "or leaving out tp=1"), line
