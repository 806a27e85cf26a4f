"""The strict module's random generators: their own stream, their state on the "device".

Like ``cupy.random.default_rng``, :func:`default_rng` gives a :class:`Generator`
whose numbers differ from NumPy's for the same seed (CuPy draws from cuRAND,
NumPy from PCG64), so code that compares a device mask with a host one fails
here as it does on a GPU. As on CuPy, the whole state lives in one device
array, ``bit_generator._state`` (int8 bytes): copying it and writing it back
restores the stream, which is how activation checkpointing and checkpoints
save a device generator.

The bit generator is NumPy's Philox with the key and counter held in that
array: a draw reads them, draws, and writes the advanced counter back.
"""
from __future__ import annotations

import numpy as np

from mpishard.testing.strict.array import launch, ndarray

__all__ = ["Philox4x64", "Generator", "default_rng"]


class Philox4x64:
    """A counter-based bit generator whose state is a strict int8 array of 48 bytes
    (a 2-word key, a 4-word counter)."""

    def __init__(self, seed=None):
        seq = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        words = np.zeros(6, dtype=np.uint64)
        words[:2] = seq.generate_state(2, np.uint64)
        self._state = ndarray._of(words.view(np.int8))

    def _words(self) -> np.ndarray:
        return self._state._a.view(np.uint64)

    def _draw(self, draw):
        """Run ``draw(numpy Generator)`` from the current state, then advance it."""
        words = self._words()
        bits = np.random.Philox(key=words[:2].copy(), counter=words[2:].copy())
        result = draw(np.random.Generator(bits))
        words[2:] = bits.state["state"]["counter"]
        return result


class Generator:
    """``cupy.random.Generator``'s methods that mpishard uses, returning strict arrays."""

    def __init__(self, bit_generator):
        self.bit_generator = bit_generator

    def _out(self, values, out=None):
        launch("random")                    # a draw is a kernel on the device
        values = np.asarray(values)
        if out is not None:
            out._a[...] = values
            return out
        return ndarray._of(values)

    def random(self, size=None, dtype=np.float64, out=None):
        """Uniform floats in [0, 1)."""
        dtype = np.dtype(dtype)
        return self._out(self.bit_generator._draw(lambda g: g.random(size, dtype=dtype)), out)

    def uniform(self, low=0.0, high=1.0, size=None, dtype=np.float64):
        return self._out(self.bit_generator._draw(
            lambda g: g.uniform(low, high, size)).astype(dtype, copy=False))

    def standard_normal(self, size=None, dtype=np.float64, out=None):
        dtype = np.dtype(dtype)
        return self._out(self.bit_generator._draw(
            lambda g: g.standard_normal(size, dtype=dtype)), out)

    def normal(self, loc=0.0, scale=1.0, size=None, dtype=np.float64):
        return self._out(self.bit_generator._draw(
            lambda g: g.normal(loc, scale, size)).astype(dtype, copy=False))

    def integers(self, low, high=None, size=None, dtype=np.int64, endpoint=False):
        return self._out(self.bit_generator._draw(
            lambda g: g.integers(low, high, size, dtype=dtype, endpoint=endpoint)))


def default_rng(seed=None) -> Generator:
    """A :class:`Generator` seeded like ``numpy.random.default_rng`` (another stream)."""
    if isinstance(seed, Generator):
        return seed
    return Generator(Philox4x64(seed))
