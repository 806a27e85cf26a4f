"""Where a step's time goes, op by op.

    with op_profile(sync=device_synchronize) as prof:
        loss = model(x, y)[1]
        loss.backward()
    prof.seconds            # {(op, "forward" | "backward"): seconds}
    prof.by_class({"linear": "matrix products", "causal_self_attention": "attention"})

An op's forward is the time from the previous op's result to its own (the graph
marks each result, see ``make_result`` in graph.py): its own work and the
model code between. Each backward is timed around its closure. ``sync`` runs
before every reading (a GPU's ``synchronize``: kernels are asynchronous, and
without it their time lands on whichever op reads a value later), so a profiled
step is slower than a plain one; the shares are what it is for.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

__all__ = ["OpProfile", "op_profile", "active"]

#: the profile being recorded, or None (read by the graph at every op)
active = None


class OpProfile:
    """Seconds per ``(op, phase)`` (see the module docstring)."""

    def __init__(self, sync=None):
        self.sync = sync or (lambda: None)
        self.seconds: dict = defaultdict(float)
        self.calls: dict = defaultdict(int)
        self._last = None

    def _now(self) -> float:
        self.sync()
        return time.perf_counter()

    def start(self) -> None:
        """Start the forward clock (after code that is not the model's)."""
        self._last = self._now()

    def forward_done(self, op: str) -> None:
        now = self._now()
        if self._last is not None:
            self.seconds[(op, "forward")] += now - self._last
            self.calls[(op, "forward")] += 1
        self._last = now

    def backward(self, op: str, fn, grad):
        start = self._now()
        try:
            return fn(grad)
        finally:
            end = self._now()
            self.seconds[(op, "backward")] += end - start
            self.calls[(op, "backward")] += 1
            self._last = end

    def by_class(self, classes: dict, default: str = "other") -> dict:
        """Seconds grouped by ``classes[op]`` (ops not named go to ``default``)."""
        out: dict = defaultdict(float)
        for (op, _), seconds in self.seconds.items():
            out[classes.get(op, default)] += seconds
        return dict(out)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@contextlib.contextmanager
def op_profile(sync=None):
    """Record an :class:`OpProfile` of the ops run inside (one at a time)."""
    global active
    if active is not None:
        raise RuntimeError("op_profile: a profile is already being recorded")
    active = OpProfile(sync)
    active.start()
    try:
        yield active
    finally:
        active = None
