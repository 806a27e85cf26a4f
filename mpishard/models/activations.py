"""The terms of an activation count that every model family's shares.

A family's activation terms live beside its model (models/<family>/activations.py;
the GPT's [Note: activation bytes] defines ``c``, ``f`` and the table of what
each op keeps). What they count alike lives here: one micro-batch's sizes and
splits (:class:`MicroBatch`), what a stage takes in (token rows or the received
activations), attention under context parallelism, the head and loss, a mixture
of experts' routing indices, and the graph's Python objects.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpishard.autodiff.rows import keeps_least

__all__ = ["MicroBatch", "micro_batch", "stage_input", "width", "row_parallel",
           "graph_objects", "split_of", "attention_bytes", "token_rows", "routing_indices",
           "head_and_loss"]

#: the graph's Python objects (tensors, closures): measured, bytes
_OBJECTS_BASE, _OBJECTS_PER_BLOCK, _OBJECTS_PER_CHECKPOINTED_BLOCK = 8 << 10, 8 << 10, 1536
#: sequence parallelism's extra objects (gathers, scatters, per-use parameter sums), and
#: context-parallel attention's per block
_OBJECTS_SP_BASE, _OBJECTS_SP_PER_BLOCK = 3584, 3840
_OBJECTS_CP_PER_BLOCK = {"ring": 3072, "all-to-all": 4096}


def width(linear) -> int:
    """This rank's output features of a (possibly column-parallel) linear layer."""
    return int(linear.weight.shape[0])


def row_parallel(linear) -> bool:
    return int(linear.weight.shape[1]) != int(linear.in_features)


def graph_objects(n_blocks: int, checkpointing: bool, sp: int, cp: int, cp_mode: str,
             per_block: int = _OBJECTS_PER_BLOCK) -> int:
    """Bytes of the graph's Python objects (measured constants)."""
    if checkpointing:
        per_block = _OBJECTS_PER_CHECKPOINTED_BLOCK
    else:
        per_block += (_OBJECTS_SP_PER_BLOCK if sp > 1 else 0) + (
            _OBJECTS_CP_PER_BLOCK.get(cp_mode, 0) if cp > 1 else 0)
    return _OBJECTS_BASE + n_blocks * per_block + (_OBJECTS_SP_BASE if sp > 1 else 0)


def split_of(model, cp=None, cp_mode=None, sp=None) -> tuple:
    """``(cp, cp_mode, sp)``: the context-parallel size and mode and the sequence-parallel
    split; each ``None`` is read from ``model`` (its ``sequence`` shard, its
    ``sequence_parallel_size``), else no split."""
    seq = getattr(model, "sequence", None)
    if cp is None:
        cp = int(seq.cp.size) if seq is not None else 1
    if cp_mode is None:
        cp_mode = seq.mode if seq is not None else "ring"
    if sp is None:
        sp = int(getattr(model, "sequence_parallel_size", 1))
    return int(cp), cp_mode, int(sp)


def attention_bytes(B: int, h: int, T: int, hs: int, c: int, f: int, cp: int = 1,
                    cp_mode: str = "ring", fused: bool = False) -> int:
    """What one attention of ``h`` heads of ``hs`` over ``T`` local rows of ``B``
    sequences keeps (weights or their context-parallel stand-ins, and its output);
    ``fused``: a GPU's flash-style kernels (:func:`mpishard.kernels.fused_attention`),
    which keep their head-major output and a log-sum-exp per row instead of weights."""
    N, A = B * T, h * hs
    if cp == 1 and fused:
        return N * A * c + B * h * T * f + N * A * c
    if cp == 1:
        return B * h * T * T * f + N * A * c
    if cp_mode == "ring":                                   # output, log-sum-exp
        return B * h * T * f + N * A * c
    return 3 * N * A * c + B * h * cp * T * T * f + 2 * N * A * c   # all-to-all


def token_rows(table, N: int, C: int, c: int, rows: bool = True) -> int:
    """The looked-up token rows (``rows``: where they are the blocks' input; a GPT adds
    positions and lets them go) and, vocabulary-parallel, the mask and the local ids
    (the lookup and the masked product are let go once summed over tp)."""
    split_vocab = int(table.weight.shape[0]) != int(table.num_embeddings)
    return N * C * c * rows + (N * c + 8 * N if split_vocab else 0)


def routing_indices(N: int, E: int, k: int, c: int) -> int:
    """What a mixture of experts' routing keeps beside its activations: each pair's
    token and slot ids and the rows' expert ranking (int64: ``2 N k + N E``), the row
    ids ``N`` (int64) and the sum of each row's top-k probabilities ``N c``."""
    return 8 * (2 * N * k + N * E + N) + N * c


def head_and_loss(lm_head, N: int, c: int, f: int) -> int:
    """Logits, and the loss's per-row target ids, flags, maxima and sums of
    exponentials (both cross-entropies recompute their softmax in backward; the
    vocabulary-parallel one keeps row ids and its own target flags too)."""
    vocab = width(lm_head)
    if vocab != int(lm_head.out_features):              # split over tp
        return N * vocab * c + N * (18 + 2 * f)
    return N * vocab * c + N * (9 + 2 * f)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of ``B`` sequences of ``T`` local rows as a count reads it: ``N =
    B T`` rows, ``Ns = N / sp`` outside the tensor-parallel layers, width ``C``, the
    activation dtype's size ``c`` and the reductions' ``f``, the splits, whether
    blocks recompute in backward, and whether the ops keep the least (``lean``, on
    NumPy: see [Note: what ops keep] in mpishard/autodiff/rows.py)."""

    B: int
    T: int
    N: int
    Ns: int
    C: int
    c: int
    f: int
    cp: int
    cp_mode: str
    sp: int
    checkpointing: bool
    lean: bool = True

    @property
    def mask(self) -> int:
        """Bytes a dropout keeps an element: its mask's byte, or a device's draws."""
        return 1 if self.lean else 4

    def norm(self, rows: int) -> int:
        """What a layer norm of ``rows`` keeps: its output (backward normalises again)."""
        return rows * self.C * self.c


def micro_batch(model, blocks, batch_size: int, seq_len: int, dtype, checkpointing=None,
                cp=None, cp_mode=None, sp=None, lean=None) -> MicroBatch:
    """The :class:`MicroBatch` of ``model`` (whose blocks are ``blocks``); each ``None`` as
    the model is set (:func:`split_of`, the blocks' checkpointing, ``lean`` as the model's
    array module's ops keep)."""
    cp, cp_mode, sp = split_of(model, cp, cp_mode, sp)
    c = np.dtype(dtype).itemsize
    if checkpointing is None:
        checkpointing = any(b.activation_checkpointing for b in blocks)
    N = batch_size * seq_len
    return MicroBatch(batch_size, seq_len, N, N // sp, int(model.config.n_embd), c,
                      4 if c == 2 else c, cp, cp_mode, sp, bool(checkpointing),
                      keeps_least(model.backend.xp) if lean is None else bool(lean))


def stage_input(table, m: MicroBatch, rows: bool = True) -> int:
    """What a stage keeps of its input: the first stage (``table``, its token table) the
    looked-up rows (``rows``: when they are the blocks' input) or, under sequence
    parallelism, this rank's cut of them (the whole rows let go); a later stage
    (``table`` None) the received activations."""
    if table is None:
        return m.Ns * m.C * m.c
    return token_rows(table, m.N, m.C, m.c, rows and m.sp == 1) + (
        m.Ns * m.C * m.c if m.sp > 1 else 0)
