"""``mpishard checkpoint inspect|consolidate``: one process, no MPI needed.

    mpishard checkpoint inspect ckpt/                        # latest step; or ckpt/step-40
    mpishard checkpoint consolidate ckpt/ model.safetensors  # loads into a PyTorch nanoGPT

The top-level ``mpishard`` command registers these with
:func:`add_checkpoint_commands`. A damaged or missing checkpoint prints one
``mpishard: error: ...`` line naming the file and the rule, and exits 2.
"""
from __future__ import annotations

import sys

__all__ = ["add_checkpoint_commands"]


def add_checkpoint_commands(subparsers) -> None:
    """Add ``checkpoint inspect DIR`` and ``checkpoint consolidate DIR OUT`` to an argparse
    subparsers object; each sets ``func(args) -> exit status``."""
    checkpoint = subparsers.add_parser("checkpoint", help="inspect, verify and export "
                                       "sharded checkpoints")
    commands = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    inspect = commands.add_parser("inspect", help="print step, layout, tensors and sizes; "
                                  "verify integrity (exit 1 if damaged)")
    inspect.add_argument("dir", help="a checkpoint root (its latest step) or a step-N "
                         "directory")
    inspect.add_argument("--no-verify", action="store_true",
                         help="skip hashing the files (the manifest is still checked)")
    inspect.set_defaults(func=_cmd_inspect)
    consolidate = commands.add_parser("consolidate", help="write one safetensors file with "
                                      "nanoGPT names (streamed)")
    consolidate.add_argument("dir", help="a checkpoint root or a step-N directory")
    consolidate.add_argument("out", help="the .safetensors file to write")
    consolidate.add_argument("--no-verify", action="store_true",
                             help="skip hashing the files first")
    consolidate.set_defaults(func=_cmd_consolidate)


def _error(err) -> int:
    print(f"mpishard: error: {err}", file=sys.stderr, flush=True)
    return 2


def _cmd_inspect(args) -> int:
    from .errors import CheckpointError  # noqa: PLC0415
    from .inspect import inspect_checkpoint  # noqa: PLC0415

    try:
        report = inspect_checkpoint(args.dir, verify=not args.no_verify)
    except CheckpointError as err:
        return _error(err)
    print(report.text, flush=True)
    return 0 if report.ok else 1


def _cmd_consolidate(args) -> int:
    from .consolidate import consolidate  # noqa: PLC0415
    from .errors import CheckpointError  # noqa: PLC0415

    try:
        out = consolidate(args.dir, args.out, verify=not args.no_verify)
    except CheckpointError as err:
        return _error(err)
    print(f"wrote {out}", flush=True)
    return 0
