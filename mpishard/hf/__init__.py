"""Hugging Face interop: start from published GPT-2 and Llama weights, hand results back.

    model = from_pretrained("path/to/gpt2", dtype="float64")      # whole, one process
    load_pretrained(run.strategy, "path/to/llama")                # any layout, streamed
    save_pretrained(run.strategy, "out/")                         # collective, streamed
    export_checkpoint("ckpt/", "out/")                            # one process, streamed

    mpiexec -n 4 python -m mpi4py -m mpishard train --init-from path/to/llama --strategy zero3
    mpishard checkpoint export ckpt/ out/ --format hf

A folder is what ``transformers``' ``save_pretrained`` writes: ``config.json``
and ``model.safetensors``, or shards and ``model.safetensors.index.json``.
Only safetensors is read or written, never a pickle, and no part of this
package imports torch or transformers. See docs/huggingface.md, and the notes
[Note: what converts and what is refused] (config.py), [Note: reading a
transposed tensor] (files.py), [Note: loading Hugging Face weights onto any
layout] (load.py), [Note: writing a model folder] (folder.py) and
[Note: streaming a strategy's export] (save.py).
"""
from mpishard.hf.config import config_from_pretrained, hf_config, model_fields
from mpishard.hf.load import from_pretrained, load_pretrained
from mpishard.hf.save import export_checkpoint, save_pretrained

__all__ = ["model_fields", "config_from_pretrained", "from_pretrained", "load_pretrained",
           "save_pretrained", "export_checkpoint", "hf_config"]
