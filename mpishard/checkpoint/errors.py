"""The one exception every checkpoint problem becomes."""
from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(Exception):
    """A checkpoint could not be written, found, verified or read.

    The message starts with the file and the rule that failed, e.g.
    ``ckpt/step-40/rank-1.safetensors: sha256: the file's SHA-256 is 3f2a...,
    the manifest records 9c01...``.

    Attributes:
        path: the file or directory concerned (a string; ``""`` when none).
        rule: a short name of the rule that failed (``"sha256"``,
            ``"coverage"``, ``"header-size"``, ...; see docs/checkpoints.md).
        failures: for errors agreed over ranks (a failed collective save or
            load), ``{rank: "path: rule: detail"}`` for every rank that failed;
            ``{}`` otherwise.
    """

    def __init__(self, path, rule: str, detail: str, failures: dict | None = None):
        self.path = str(path)
        self.rule = rule
        self.detail = detail
        self.failures = dict(failures or {})
        prefix = f"{self.path}: " if self.path else ""
        super().__init__(f"{prefix}{rule}: {detail}")
