"""Sharded checkpoints: atomic, verified, loadable onto any layout, exportable.

    save_checkpoint("ckpt", step, strategy, opt, extra_state={...}, keep_last=3)
    BackgroundSaver(world).save("ckpt", step, strategy, opt, ...)  # written on a thread
    extra = load_checkpoint("ckpt", strategy, opt)         # any strategy, any world size
    consolidate("ckpt", "model.safetensors")               # one file, nanoGPT names

Saving and loading are collective; a failure on any rank is a
:class:`CheckpointError` on every rank. See docs/checkpoints.md, and
[Note: checkpoint layout], [Note: manifest], [Note: atomic commit],
[Note: loading onto any layout], [Note: reading only what is needed],
[Note: checkpoint agreement], [Note: background saves] and [Note: damaged checkpoints] in this package.
Nothing here unpickles anything.
"""
from mpishard.checkpoint.background import BackgroundSaver
from mpishard.checkpoint.consolidate import consolidate, load_consolidated
from mpishard.checkpoint.errors import CheckpointError
from mpishard.checkpoint.format import Manifest, read_manifest
from mpishard.checkpoint.locate import latest_checkpoint, resolve_checkpoint
from mpishard.checkpoint.inspect import Inspection, inspect_checkpoint
from mpishard.checkpoint.reader import ShardReader, load_checkpoint, verify_checkpoint
from mpishard.checkpoint.recover import load_newest_valid
from mpishard.checkpoint.signals import INTERRUPT_TOO, StopSignals
from mpishard.checkpoint.state import (generator_state, load_module_rng_states, module_rng_states,
                    set_generator_state)
from mpishard.checkpoint.writer import save_checkpoint

__all__ = ["save_checkpoint", "BackgroundSaver", "load_checkpoint", "load_newest_valid", "verify_checkpoint",
           "latest_checkpoint", "resolve_checkpoint", "read_manifest", "Manifest", "ShardReader", "consolidate",
           "load_consolidated", "inspect_checkpoint", "Inspection", "StopSignals", "INTERRUPT_TOO",
           "CheckpointError", "generator_state", "set_generator_state", "module_rng_states",
           "load_module_rng_states"]
