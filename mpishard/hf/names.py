"""Which tensor of a Hugging Face checkpoint each mpishard parameter is.

Each model family's mapping lists its tensors (``HFMapping.tensors``, in
mpishard/models/<family>/hf.py): Llama's names and layouts are transformers'
own and map one to one; GPT-2's ``Conv1D`` weights are transposed; a tied
output layer is not a tensor of its own in a transformers checkpoint (it is
left out on save and re-tied on load), so it is neither read nor written;
a Mixtral's stacked experts are the concatenation of the files' per-expert
tensors (``parts``).
"""
from __future__ import annotations

from mpishard.hf.config import mapping_of
from mpishard.models.hf_mapping import HFTensor

__all__ = ["HFTensor", "tensor_plan"]


def tensor_plan(config) -> list:
    """Every tensor of the Hugging Face form of the model ``config`` builds, in model order."""
    return mapping_of(config).tensors(config)
