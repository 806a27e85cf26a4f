"""``mpishard checkpoint inspect|consolidate|export``: one process, no MPI needed.

    mpishard checkpoint inspect ckpt/                        # newest valid; or ckpt/step-40
    mpishard checkpoint consolidate ckpt/ model.safetensors  # loads into a PyTorch nanoGPT
    mpishard checkpoint export ckpt/ out/ --format hf        # a Hugging Face model folder

The top-level ``mpishard`` command registers these with
:func:`add_checkpoint_commands`. A damaged or missing checkpoint prints one
``mpishard: error: ...`` line naming the file and the rule, and exits 2.
"""
from __future__ import annotations

import argparse
import sys

from mpishard.core.parse import parse_bytes

__all__ = ["add_checkpoint_commands", "parse_size"]

def parse_size(text: str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"200MiB"`` -> 200 * 2**20, ``"1024"`` -> 1024 (bytes), as
    transformers reads ``max_shard_size``."""
    try:
        size = parse_bytes(text)
    except argparse.ArgumentTypeError:
        size = 0
    if size < 1:
        raise ValueError(f"--max-shard-size {text!r}: give a size such as 5GB, 200MB, "
                         f"500MiB or a number of bytes")
    return size


def add_checkpoint_commands(subparsers) -> None:
    """Add ``checkpoint inspect DIR``, ``checkpoint consolidate DIR OUT`` and ``checkpoint
    export DIR OUT [--format hf|safetensors]`` to an argparse subparsers object; each sets
    ``func(args) -> exit status``."""
    checkpoint = subparsers.add_parser("checkpoint", help="inspect, verify and export "
                                       "sharded checkpoints")
    commands = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    inspect = commands.add_parser("inspect", help="print step, layout, tensors and sizes; "
                                  "verify integrity (exit 1 if damaged)")
    inspect.add_argument("dir", help="a checkpoint root (its newest checkpoint that "
                         "verifies, the one --resume takes) or a step-N directory")
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
    export = commands.add_parser("export", help="write the parameters as a Hugging Face "
                                 "model folder (--format hf) or one safetensors file "
                                 "(--format safetensors), streamed")
    export.add_argument("dir", help="a checkpoint root or a step-N directory")
    export.add_argument("out", help="the folder (hf) or .safetensors file (safetensors) to "
                        "write")
    export.add_argument("--format", choices=("hf", "safetensors"), default="hf",
                        help="hf: config.json and model*.safetensors that transformers' "
                        "AutoModelForCausalLM loads (GPT and Llama); safetensors: one file "
                        "with mpishard's names, as consolidate writes (default: hf)")
    export.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="hf only: split the weights into files of at most SIZE, with "
                        "an index (e.g. 5GB, 200MB; default 5GiB)")
    export.add_argument("--no-verify", action="store_true",
                        help="skip hashing the files first")
    export.set_defaults(func=_cmd_export)


def _error(err) -> int:
    print(f"mpishard: error: {err}", file=sys.stderr, flush=True)
    return 2


def _cmd_inspect(args) -> int:
    from mpishard.checkpoint.errors import CheckpointError  # noqa: PLC0415
    from mpishard.checkpoint.inspect import inspect_checkpoint  # noqa: PLC0415

    try:
        report = inspect_checkpoint(args.dir, verify=not args.no_verify)
    except CheckpointError as err:
        return _error(err)
    print(report.text, flush=True)
    return 0 if report.ok else 1


def _cmd_consolidate(args) -> int:
    from mpishard.checkpoint.consolidate import consolidate  # noqa: PLC0415
    from mpishard.checkpoint.errors import CheckpointError  # noqa: PLC0415

    try:
        out = consolidate(args.dir, args.out, verify=not args.no_verify)
    except (CheckpointError, ValueError, OSError) as err:
        return _error(err)
    print(f"wrote {out}", flush=True)
    return 0


def _cmd_export(args) -> int:
    from mpishard.checkpoint.errors import CheckpointError  # noqa: PLC0415

    try:
        if args.format == "safetensors":
            from mpishard.checkpoint.consolidate import consolidate  # noqa: PLC0415

            if args.max_shard_size is not None:
                raise ValueError(f"--max-shard-size {args.max_shard_size} splits --format hf "
                                 f"folders; --format safetensors writes one file: leave "
                                 f"--max-shard-size out, or export with --format hf")
            out = consolidate(args.dir, args.out, verify=not args.no_verify)
        else:
            from mpishard.hf import export_checkpoint  # noqa: PLC0415

            out = export_checkpoint(args.dir, args.out,
                                    parse_size(args.max_shard_size or "5GiB"),
                                    verify=not args.no_verify)
    except (CheckpointError, ValueError, OSError) as err:
        return _error(err)
    print(f"wrote {out}", flush=True)
    return 0
