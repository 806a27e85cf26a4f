"""Model presets: published shapes, and small ones for CPUs (``--preset NAME``).

    mpishard estimate --preset llama3.1-8b --dp 8 --strategy zero3
    mpiexec -n 4 python -m mpi4py -m mpishard train --preset llama-tiny --steps 50

A preset fills the ``[model]`` keys it names; any key given in the TOML file or
as a flag still wins (``--preset gpt2 --n-layer 6``). Each model family lists
its own in its spec (``ModelSpec.presets``, mpishard/models/<family>/spec.py,
with where the shapes come from); this is all of them, by name. Parameter
counts are in docs/models.md.
"""
from __future__ import annotations

from mpishard.models import MODELS

__all__ = ["PRESETS"]

#: preset name -> [model] keys (flat names), ``name`` the family's
PRESETS = {preset: {"name": spec.name, **keys} for spec in MODELS.values()
           for preset, keys in spec.presets.items()}
