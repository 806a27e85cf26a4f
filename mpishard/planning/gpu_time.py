"""A GPU's time for one micro-batch of a stage: every kernel's FLOPs and bytes at shape-dependent rates.

    ops = stage_ops(stage, layout, itemsize=2)                 # mpishard's CUDA kernels
    ops = stage_ops(stage, layout, itemsize=2, kernels=MEGATRON_KERNELS)
    times = micro_batch_times(ops, load_machine("a100-80gb"), "float16", layout)
    times["forward"], times["backward"], times["recompute"], times["by class"]

[Note: GPU kernel model]
Each kernel a stage's forward and backward launch is an :class:`Op`: its FLOPs and
the bytes it reads and writes, forward and backward, read from the built stage
(its modules' local shapes, so tensor, sequence and context parallelism are in
them). Its time is the time of its FLOPs at the engine's rate plus the time of
its bytes at the memory's, one after the other (Calculon's ``no_overlap``
processing mode, calculon-ai/calculon ``calculon/system.py``), plus one launch:

* a matrix product (``2 M N K`` FLOPs, ``M K + K N + M N`` elements) on the
  tensor cores at ``peak x`` an efficiency that depends on the product's size
  (the machine's ``matmul_efficiency_table``, GFLOP -> efficiency, first row
  the op reaches), at most the ``matmul_efficiency`` measured at the best shape
  (the maximum achievable matmul FLOP/s); backward is two such products (the input's and the
  weight's gradients);
* attention's two batched products over ``B x heads`` of ``T_local x T x hs``,
  their softmax over the ``T x T`` scores and its dropout (unfused, as
  Megatron-LM and mpishard's batched path run them), or one fused kernel
  forward and one or two backward (flash attention: the causal half of the
  products, only Q, K, V and the output through memory) at the machine's
  ``flash_attention_efficiency`` (FlashAttention-2's published rate) or, for
  mpishard's own tensor-core kernel, :data:`TENSOR_CORE_ATTENTION_SHARE` of it;
* memory-bound kernels (norms, the MLP's activation, dropout fused with the
  residual add, the embedding lookup, the loss's softmax) on the vector
  units at ``vector_flops x`` their table's efficiency, and their bytes at
  ``memory_bandwidth x`` the ``memory_efficiency_table``'s (MB ->
  efficiency). Under sequence parallelism norms, dropouts and residual adds
  see ``rows / tp``, otherwise every tp rank repeats them on all rows;
* the loss over the head's logits: mpishard's fused cross-entropy (a launch
  each way, the 16-bit logits read once forward, read and their gradient
  written backward), or the logits cast to float32 and the vocabulary-parallel
  cross-entropy's passes over them (Megatron-LM, torchtitan);
* a Llama's rotary embeddings on q and k (and, for frameworks that copy them,
  grouped-query attention's keys and values out to the query heads), memory-bound,
  as the framework runs them; and where a framework runs PyTorch's eager ops
  (torchtitan without torch.compile) its RMS norms and SwiGLU as one kernel per op,
  each a pass over the rows.

Which of these a step runs is its :class:`KernelSet`, the framework's: mpishard's
CUDA backend (:data:`MPISHARD_KERNELS`, what ``mpishard plan`` costs), Megatron-LM
(:data:`MEGATRON_KERNELS`), FlashAttention-2 with a float32 loss
(:data:`FLASH2_KERNELS`), or the published Hopper runs' stacks (torchtitan's with and
without torch.compile, llm-foundry's, NeMo's).

Recomputation adds forward kernels: the blocks' (full) or, under selective
recomputation, those the framework's policy drops (the op's ``selective`` flag):
attention's core (its products, softmax and dropout; Megatron-LM's and mpishard's,
Korthikanti et al. 2022) or, with ``KernelSet(selective="op")``, torchtitan's
per-op policy: every kernel of a block but the matrix products and the fused
attention, and every second matrix product of each block (torchtitan
``_apply_ac_to_transformer_block``, ``selective_ac_option = "op"``: "Saves output of
all compute ops, except every second mm"; the save list holds ``aten.mm``, the SDPA
flash/efficient kernels and ``reduce_scatter``; the count restarts per block). What
it leaves out: bias adds (fused into the next kernel), kernel fusion beyond the
above, and GEMM tile quantisation.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mpishard.kernels import attention_choice, device_fused_attention
from mpishard.kernels.cuda.attention_tc_src import tensor_cores
from mpishard.models import spec_of
from mpishard.nn.sharding import plan_of
from mpishard.parallel.plans import matching_modules

__all__ = ["Op", "KernelSet", "stage_ops", "micro_batch_times", "moe_rows", "OP_CLASSES",
           "MPISHARD_KERNELS", "MEGATRON_KERNELS", "FLASH2_KERNELS", "TORCHTITAN_KERNELS",
           "TORCHTITAN_COMPILED_KERNELS", "LLMFOUNDRY_KERNELS", "NEMO_KERNELS",
           "TENSOR_CORE_ATTENTION_SHARE", "FLASH1_ATTENTION_SHARE",
           "tensor_core_attention_seconds"]

#: the op classes of a breakdown, in the order they are printed
OP_CLASSES = ("matmul", "attention", "rotary", "norm", "activation", "dropout+residual",
              "embedding", "loss")


#: mpishard's tensor-core attention (kernels/cuda/attention_tc_src.py) at this share of the
#: machine's FlashAttention-2 rate. An estimate: FlashAttention-2's abstract (Dao 2023,
#: arXiv:2307.08691) puts FlashAttention-1 at 25-40% of the A100's peak against its own
#: 50-73%; mpishard's kernel (WMMA 16 x 16 x 16 fragments, the softmax through shared
#: memory, no asynchronous copies) is counted as the first kind, at the ratio of the two
#: ranges' low ends, 25 / 50. Not yet timed alone: on one H100 (docs/gpu.md, "First runs
#: on an H100") the attention benchmark's whole float16 backward at batch 8, 12 heads,
#: T = 1024, head size 64 (these kernels with the heads' unpacking around them) took
#: 2.28 ms, where this share plans the kernels at 0.25 ms; so the share is likely
#: high, by how much the kernels' own time will say (benchmarks/attention.py times them
#: alone beside :func:`tensor_core_attention_seconds`).
TENSOR_CORE_ATTENTION_SHARE = 0.5
#: FlashAttention's Triton kernels (flash_attn/flash_attn_triton.py, Dao-AILab/flash-attention:
#: "Overall Triton forward + backward is slightly slower than CUDA forward + backward", the
#: CUDA kernels of FlashAttention-1 then) at this share of the FlashAttention-2 rate: the
#: ratio of the two generations' A100 ranges' low ends in FlashAttention-2's abstract
#: (25-40% of the peak against 50-73%), 25 / 50
FLASH1_ATTENTION_SHARE = 0.5
_ATTENTION = ("mpishard", "unfused", "flash2", "flash1")
_LOSS = ("fused", "float32")
_SELECTIVE = ("core", "op")
_EAGER = ("none", "all", "outside blocks")
_ROTARY = ("fused", "complex", "packed")


@dataclass(frozen=True)
class KernelSet:
    """The kernels a framework runs where frameworks differ (see [Note: GPU kernel model]).

    ``attention``: ``"mpishard"``, mpishard's CUDA backend with ``MPISHARD_ATTENTION=fused``
    (its tensor-core flash kernels where they take the rows: 16-bit, a head size that is a
    multiple of 16 up to 128, no dropout of the weights; otherwise the batched path),
    ``"unfused"`` (products, softmax and dropout as separate kernels, Megatron-LM's) or
    ``"flash2"`` (one FlashAttention-2 kernel each way). ``loss``: ``"fused"`` (mpishard's
    cross-entropy kernels) or ``"float32"`` (the logits cast to float32 first: Megatron-LM
    without ``--fp16-lm-cross-entropy``, torchtitan). ``grad_reduce_itemsize``:
    the bytes per gradient element the data-parallel and tied-weight all-reduces send
    (None: the plan's, mpishard's reduce dtype). ``selective``: what a layout's
    selective recomputation repeats, ``"core"`` (attention's core: Megatron-LM,
    mpishard) or ``"op"`` (torchtitan's per-op policy, see [Note: GPU kernel model]).
    ``tp_overlap``: sequence parallelism's collectives overlapped with the products
    (Megatron-Core's ``--tp-comm-overlap`` on Transformer Engine's userbuffers), its
    value the splits of the forward reduce-scatters (0: none): the all-gathers run as
    ring exchanges behind the products they feed, backward's reduce-scatters and
    all-gathers in bulk behind the weight-gradient products, and the forward
    reduce-scatters (a quarter of a block's tp traffic: two of its eight collectives)
    pipelined in ``tp_overlap`` splits, the last of which waits: ``1 / (4 tp_overlap)``
    of the tp group's time stays exposed, the rest hides and costs the link's
    ``processor_usage``.
    ``cp_grouped_kv``: context parallelism passes the key/value heads as they are
    (grouped-query attention's fewer heads) and their gradients in the activations'
    dtype (Transformer Engine's context-parallel attention), where mpishard's ring
    passes them expanded to the query heads, the gradients in float32.
    ``rows_again``: the norms and GELU keep no float32 normalised rows or tanh for
    backward, where their backward runs the forward kernel again first (mpishard's, see
    [Note: what ops keep] in mpishard/autodiff/rows.py): one launch and a forward's
    passes (reading the rows, writing the output and the float32 rows) more each.
    ``eager``: where RMS norms and SwiGLU run as PyTorch's eager ops, one kernel per op
    (torchtitan's ``RMSNorm``: ``x.float()``, ``pow``, ``mean``, ``+ eps``, ``rsqrt``, the
    product, ``type_as`` and the weight's product, 8 kernels forward and 16 backward, in
    float32 between the casts; ``silu`` then the product): ``"none"`` (fused kernels),
    ``"all"`` (torchtitan without ``torch.compile``) or ``"outside blocks"`` (torchtitan's
    ``torch.compile``, which compiles each block: the final norm stays eager).
    ``rotary``: how rotary embeddings run on q and k: ``"fused"`` (a kernel each for q
    and k each way, reading and writing them once: Transformer Engine's fused RoPE,
    torch.compile's), ``"complex"`` (torchtitan's eager ``apply_rotary_emb``: to float32,
    a complex product, back, three kernels each way for each) or ``"packed"``
    (mpishard's ``rope_qkv`` on a device, mpishard/kernels/cuda/rotary.py: one kernel
    each way, q, k and v read once and the packed rows written, k and v copied out to
    the query heads; where a Llama takes its one-op grouped-query path, that op's
    casts and complex products instead, :func:`_one_op_rotary`).
    ``kv_copies``: grouped-query attention's keys and values copied out to the query
    heads before attention (torchtitan's ``repeat_kv``, an ``expand`` then ``reshape``),
    their gradients summed back."""

    attention: str = "mpishard"
    loss: str = "fused"
    grad_reduce_itemsize: int | None = None
    selective: str = "core"
    tp_overlap: int = 0
    cp_grouped_kv: bool = False
    rows_again: bool = False
    eager: str = "none"
    rotary: str = "fused"
    kv_copies: bool = False

    def __post_init__(self):
        if self.attention not in _ATTENTION or self.loss not in _LOSS or \
                self.selective not in _SELECTIVE or self.eager not in _EAGER or \
                self.rotary not in _ROTARY:
            raise ValueError(f"KernelSet(attention={self.attention!r}, loss={self.loss!r}, "
                             f"selective={self.selective!r}, eager={self.eager!r}, "
                             f"rotary={self.rotary!r}): attention must be one of "
                             f"{_ATTENTION}, loss one of {_LOSS}, selective one of "
                             f"{_SELECTIVE}, eager one of {_EAGER}, rotary one of {_ROTARY}")
        if isinstance(self.tp_overlap, bool) or not isinstance(self.tp_overlap, int) or \
                self.tp_overlap < 0:
            raise ValueError(f"KernelSet(tp_overlap={self.tp_overlap!r}): the splits of the "
                             f"forward reduce-scatters, an integer >= 0 (0: no overlap)")


#: mpishard's CUDA backend, what ``mpishard plan`` costs
MPISHARD_KERNELS = KernelSet(rows_again=True, rotary="packed")
#: Megatron-LM as the 2021-2022 papers ran it (NVIDIA/Megatron-LM at commit de7dc40f,
#: 'scripts for sc21': megatron/model/transformer.py, gpt_model.py, arguments.py): the
#: gradients all-reduced in 16 bits (torch DDP's .grad, or local DDP's main_grad buffer
#: in the params' dtype without --accumulate-allreduce-grads-in-fp32, which the sc21
#: scripts do not pass)
MEGATRON_KERNELS = KernelSet("unfused", "float32", 2)
#: FlashAttention-2 with the loss over float32 logits
FLASH2_KERNELS = KernelSet("flash2", "float32")
#: torchtitan (pytorch/torchtitan at 9dec370, 2024-12, the commit its H100 benchmark names):
#: SDPA's FlashAttention-2 kernels, the loss over float32 logits (``pred.flatten(0, 1).float()``
#: in ``cross_entropy_loss``), selective recomputation by op ("op", the default of its
#: llama3_8b.toml: ``mode = 'selective'``, ``selective_ac_option = 'op'``), without
#: ``torch.compile`` (the toml's ``compile = false``): its model code's eager ops
#: (torchtitan/models/norms.py ``RMSNorm``, torchtitan/models/llama/model.py
#: ``apply_rotary_emb``, ``repeat_kv``, ``FeedForward``)
TORCHTITAN_KERNELS = KernelSet("flash2", "float32", selective="op", eager="all",
                               rotary="complex", kv_copies=True)
#: the same with ``torch.compile`` (``training.compile = true``: each block compiled,
#: torchtitan/parallelisms/parallelize_llama.py ``apply_compile``): the blocks' norms,
#: rotary embeddings and SwiGLU as fused kernels; the final norm and the loss stay eager,
#: ``repeat_kv``'s copies stay (the attention kernel reads whole heads)
TORCHTITAN_COMPILED_KERNELS = replace(TORCHTITAN_KERNELS, eager="outside blocks",
                                      rotary="fused")
#: llm-foundry v0.3.0 (the release its 2023 H100 benchmarks ran: sweep.sh, submit_benchmarks.py
#: at mosaicml/llm-foundry b2a43a1): ``attn_impl: triton`` (submit_benchmarks.py's default;
#: FlashAttention's Triton kernels on the ``triton-pre-mlir`` sm90 build, costed at
#: :data:`FLASH1_ATTENTION_SHARE` of FlashAttention-2's rate: their own notes put them
#: level with FlashAttention-1 on the A100; no published H100 rate of them was found) and
#: flash-attn 1.0.9's fused cross-entropy (``loss_fn: fused_crossentropy``,
#: modeling_mpt.py's default; setup.py's gpu extras install ``xentropy-cuda-lib``)
LLMFOUNDRY_KERNELS = KernelSet("flash1", "fused")
#: NeMo 24.09 on Megatron-Core as NVIDIA's DGX Cloud benchmarks of Llama 3.1 ran it
#: (NVIDIA/dgxc-benchmarking v24.11.1, llama3.1/llama3.1_{8b,70b,405b}.yaml):
#: Transformer Engine's fused attention (``use_flash_attention: true``; costed at
#: FlashAttention-2's rate, a lower bound where cuDNN's kernels run faster),
#: ``cross_entropy_loss_fusion: true`` (no float32 copy of the logits), the distributed
#: optimizer's gradients reduced in bfloat16 (``grad_sync_dtype: bf16``), where tp > 1
#: ``ub_tp_comm_overlap: true`` (``ub_tp_comm_overlap_cfg``: ``ring_exchange`` for the
#: forward all-gathers and backward's gathers of the output gradient, ``bulk`` for
#: backward's others, ``pipeline`` with ``num_splits: 4`` for the forward
#: reduce-scatters), and context parallelism by Transformer Engine's attention (grouped
#: K/V heads)
NEMO_KERNELS = KernelSet("flash2", "fused", 2, tp_overlap=4, cp_grouped_kv=True)


def moe_rows(module, rows: int) -> int:
    """The rows a mixture of experts' layer routes to its experts: ``top_k`` per row,
    capped by each expert's capacity (even routing)."""
    k, E = module.top_k, module.n_experts
    if module.capacity is None:
        return rows * k
    return min(rows * k, E * int(np.ceil(module.capacity * rows * k / E)))


@dataclass(frozen=True)
class Op:
    """One kernel of a micro-batch: FLOPs and bytes forward and backward (see
    [Note: GPU kernel model]); ``block``: inside the pipelined blocks (recomputed under
    full checkpointing), ``core``: attention's core (recomputed under selective)."""

    cls: str
    fw_flops: float
    fw_bytes: float
    bw_flops: float
    bw_bytes: float
    matrix: bool = False
    block: bool = False
    core: bool = False
    fw_kernels: int = 1
    bw_kernels: int = 2
    flash: float = 0.0           # a fused attention kernel: its share of the flash rate
    selective: bool = False      # repeated by selective recomputation (see KernelSet)
    kept: bool = False           # a block's 1st, 3rd, ... product: its output kept under
    # mpishard's recomputation by op (see [Note: recomputation by op])


def _gemm(cls, m, n, k, s, block, core=False, batch=1) -> Op:
    flops = 2.0 * batch * m * n * k
    nbytes = float(batch) * (m * k + k * n + m * n) * s
    return Op(cls, flops, nbytes, 2 * flops, 2 * nbytes, True, block, core)


def _vector(cls, elements, s, fw_flops, bw_flops, fw_passes, bw_passes, block,
            core=False, extra_bytes=0.0, again=False) -> Op:
    """A memory-bound kernel over ``elements`` of ``s`` bytes: ``fw_passes`` reads and
    writes of them forward, ``bw_passes`` backward (``extra_bytes``: a dropout mask);
    ``again``: backward runs the forward kernel first, writing float32 rows too (see
    :class:`KernelSet`'s ``rows_again``)."""
    fw_bytes = fw_passes * elements * s + extra_bytes
    return Op(cls, fw_flops * elements, fw_bytes,
              (bw_flops + again * fw_flops) * elements,
              bw_passes * elements * s + extra_bytes + again * (fw_bytes + 4 * elements),
              False, block, core, 1, 1 + again)


def _eager(kernels, in_block: bool) -> bool:
    """Whether ``kernels`` runs an op here as PyTorch's eager ops (see :class:`KernelSet`)."""
    return kernels.eager == "all" or (kernels.eager == "outside blocks" and not in_block)


def _eager_rms_norm(elements, s, block) -> Op:
    """torchtitan's eager ``RMSNorm`` over ``elements`` of ``s`` bytes: forward ``x.float()``
    (``s`` in, 4 out), ``pow`` (8), ``mean`` (4), ``+ eps`` and ``rsqrt`` (a value a row),
    the product by the row's ``rsqrt`` (8), ``type_as`` (4 + ``s``) and the weight's
    product (``2 s``): 8 kernels; backward the autograd of each, 16 kernels: the weight's
    products and sum (``6 s``), the casts (``2 (4 + s)``), the rsqrt product's two
    (``8 + 12``) and its row sum (4), ``rsqrt``'s three on a value a row, ``mean``'s
    expansion (4), ``pow``'s three passes (28) and the two gradients' sum (12)."""
    return Op("norm", 4.0 * elements, (28.0 + 4 * s) * elements, 10.0 * elements,
              (76.0 + 8 * s) * elements, False, block, False, 8, 16)


def _eager_swiglu(elements, s, block) -> Op:
    """``silu(gate) * up`` as two eager ops (``silu``: ``2 s``, the product: ``3 s``);
    backward the product's two gradients (``6 s``) and ``silu``'s (``3 s``)."""
    return Op("activation", 8.0 * elements, 5.0 * s * elements, 13.0 * elements,
              9.0 * s * elements, False, block, False, 2, 3)


def _rotary_kv_heads(stage, tp: int) -> int:
    """This tp rank's key/value heads where ``stage``'s model rotates q and k (a
    ``rope_theta`` in its config; tp splits them where it divides them, else every rank
    keeps them all), else 0."""
    cfg = getattr(stage, "config", None)
    if getattr(cfg, "rope_theta", None) is None:
        return 0
    kv = getattr(cfg, "n_kv_head", 0) or cfg.n_head
    return kv // tp if kv % tp == 0 else kv


def _rotary(rows, hq, hkv, hs, s, kernels, block) -> list:
    """Rotary embeddings (and torchtitan's key/value copies) for ``rows`` rows of ``hq``
    query and ``hkv`` key/value heads of size ``hs`` (this rank's), as ``kernels`` runs
    them (see :class:`KernelSet`; mpishard's one-op path: :func:`_one_op_rotary`)."""
    eq, ekv = float(rows) * hq * hs, float(rows) * hkv * hs
    ops = []
    if kernels.rotary == "fused":            # q and k each read and written once
        ops.append(Op("rotary", 3.0 * (eq + ekv), 2.0 * s * (eq + ekv), 3.0 * (eq + ekv),
                      2.0 * s * (eq + ekv), False, block, False, 2, 2))
    elif kernels.rotary == "complex":        # float(), the complex product, type_as
        ops.append(Op("rotary", 3.0 * (eq + ekv), (2.0 * s + 16) * (eq + ekv),
                      3.0 * (eq + ekv), (2.0 * s + 16) * (eq + ekv), False, block, False,
                      6, 6))
    else:   # rope_qkv: one kernel reads q, k and v and writes the packed rows (k and v
        # copied out to the query heads); backward one reads the packed gradient and
        # writes q's, k's and v's (k's and v's summed over each group)
        ops.append(Op("rotary", 6.0 * eq, s * (4 * eq + 2 * ekv), 6.0 * eq + 3 * ekv,
                      s * (4 * eq + 2 * ekv), False, block, False, 1, 1))
    if kernels.kv_copies and hkv < hq:       # repeat_kv: k and v out to the query heads
        nbytes = 2.0 * s * (eq + ekv)
        ops.append(Op("attention", 0.0, nbytes, 2.0 * eq, nbytes, False, block, False, 2, 2))
    return ops


def _llama_one_op(layout, hs: int) -> bool:
    """Whether mpishard's Llama attention runs its one op on a device under ``layout``
    (mpishard/models/llama/model.py ``takes_one_op_path``, from the layout rather than
    from the stage a planner reuses across layouts): no context parallelism, no tensor
    parallelism (plain q/k/v products), no recomputation by op (which keeps the
    per-projection path's products), and no fused attention kernels for its heads."""
    return (layout.cp == 1 and layout.tp == 1 and not layout.keep_products
            and not device_fused_attention(hs, False))


def _one_op_rotary(rows, seq, hq, hkv, hs, s, block) -> Op:
    """The rotations of mpishard's one-op grouped-query attention on a device
    (mpishard/autodiff/gqa_attention.py) over ``rows`` rows of ``seq`` positions each,
    rotating in ``r``-byte reals (float32 for 16-bit rows, else the rows' own). Forward:
    the projections' q, k and v rows up to float32 (16-bit rows: ``s`` in, 4 out), the
    tables (q's and k's turns, ``(heads, seq, hs/2)`` complex, and their conjugates: ``r``
    bytes an element written, the conjugates' read too; 4 launches each), q's and k's
    complex products (the rows and the turns, a sequence at a time, in; ``r`` out) and,
    for 16-bit rows, their cast into the activations' dtype (``r`` in, ``s`` out), v's
    copy (``2 s``). Backward: q's and k's gradients times the kept conjugates (``3 r``),
    16-bit rows' float32 gradient rows cast back (4 in, ``s`` out)."""
    eq, ekv = float(rows) * hq * hs, float(rows) * hkv * hs
    r = 4.0 if s < 8 else 8.0
    cast = s + r if s < 4 else 0.0
    tables = 3.0 * r * seq * hs * (hq + hkv)
    fw = cast * (eq + 2 * ekv) + tables + 3.0 * r * (eq + ekv) + cast * (eq + ekv) \
        + 2.0 * s * ekv
    bw = 3.0 * r * (eq + ekv) + cast * (eq + 2 * ekv)
    return Op("rotary", 3.0 * (eq + ekv), fw, 3.0 * (eq + ekv), bw, False, block, False,
              8 + (6 if s < 4 else 3), 2 + (1 if s < 4 else 0))


def _dropout(stage) -> float:
    return float(getattr(getattr(stage, "config", None), "dropout", 0.0) or 0.0)


def _loss(elements, s, kernels) -> Op:
    """The loss over ``elements`` logits of ``s`` bytes (see :class:`KernelSet`)."""
    if kernels.loss == "fused":      # max, exponentials' sum and target; gradient rows
        return Op("loss", 5.0 * elements, elements * s, 3.0 * elements, 2.0 * elements * s,
                  False, False, False, 1, 1)
    # Megatron-LM's vocab_parallel_cross_entropy (megatron/mpu/cross_entropy.py) on
    # output.float(): the cast (s in, 4 out; none for float32 logits), the maximum (4),
    # subtracting it (8), exponentials in place (8), their sum (4), dividing to keep the
    # softmax for backward (8); backward scales it in place (8) and casts back (4 + s)
    cast = s + 4.0 if s < 4 else 0.0
    return Op("loss", 5.0 * elements, (cast + 32.0) * elements, 2.0 * elements,
              (8.0 + (4.0 + s if s < 4 else 0.0)) * elements, False, False, False,
              6 if s < 4 else 5, 2 if s < 4 else 1)


def stage_ops(stage, layout, itemsize: int, kernels: KernelSet = MPISHARD_KERNELS) -> list:
    """The kernels of one micro-batch of ``stage`` (built for ``layout``'s split) with
    activations of ``itemsize`` bytes, as ``kernels`` runs them (see [Note: GPU kernel
    model])."""
    plan = plan_of(stage)
    blocks = plan.pipeline.blocks + "." if plan.pipeline is not None else None
    rows = layout.batch_size * layout.local_seq_len            # a Linear's rows (gathered)
    sp = layout.sequence_parallel and layout.tp > 1
    split_rows = rows / layout.tp if sp else rows              # norms, dropouts, adds
    p, s = _dropout(stage), itemsize
    mask = 1.0 if p > 0 else 0.0                               # a byte per element kept
    ops = []
    block_of = {}                        # an in-block product's index in ops -> its block
    for path, m in stage.named_modules():
        in_block = bool(blocks) and path.startswith(blocks)
        name = type(m).__name__
        weight = m._parameters.get("weight")
        if weight is not None and len(weight.shape) == 2 and name.endswith("Linear"):
            out, inp = weight.shape
            if in_block:
                block_of[len(ops)] = path[len(blocks):].split(".", 1)[0]
            ops.append(_gemm("matmul", rows, out, inp, s, in_block))
            if blocks and not in_block:
                ops.append(_loss(rows * out, s, kernels))   # the head's logits
        elif weight is not None and len(weight.shape) == 1 and "Norm" in name:
            n = split_rows * weight.shape[0]
            if "RMS" in name and _eager(kernels, in_block):
                ops.append(_eager_rms_norm(n, s, in_block))
            else:
                ops.append(_vector("norm", n, s, 9, 21, 2, 3, in_block,
                                   again=kernels.rows_again))
            if in_block:         # each norm opens a residual branch: dropout + add closes it
                ops.append(_vector("dropout+residual", n, s, 1 + mask, mask + 1, 3, 2,
                                   in_block, extra_bytes=mask * n))
        elif weight is not None and len(weight.shape) == 2 and "Embedding" in name:
            n = split_rows * weight.shape[1]
            ops.append(_vector("embedding", n, s, 1, 1, 2, 2, in_block))
        elif name.endswith("MLP"):
            linears = [c for c in m._modules.values() if type(c).__name__.endswith("Linear")]
            if len(linears) >= 2:
                inputs = len(linears) - 1                    # GELU: 1, SwiGLU: gate and up
                n = rows * linears[0].weight.shape[0]
                if inputs == 2 and _eager(kernels, in_block):
                    ops.append(_eager_swiglu(n, s, in_block))
                else:
                    ops.append(_vector("activation", n, s, 8, 13, inputs + 1, 2 * inputs + 1,
                                       in_block, again=kernels.rows_again and inputs == 1))
        if hasattr(m, "n_experts") and "experts" in m._modules:
            routed = moe_rows(m, rows)
            for w in m.experts._parameters.values():
                if w is not None and len(w.shape) == 3:
                    ops.append(_gemm("matmul", routed / w.shape[0], w.shape[2], w.shape[1], s,
                                     in_block, batch=w.shape[0]))
    for pattern in plan.attention:
        for path, m in matching_modules(stage, pattern):
            in_block = bool(blocks) and path.startswith(blocks)
            heads, hs = spec_of(stage).attention_heads(m)
            B, Tl, T = layout.batch_size, layout.local_seq_len, layout.seq_len
            ops += _attention(B * heads, Tl, T, hs, s, p, in_block, _flash(kernels, s, hs, p))
            hkv = _rotary_kv_heads(stage, layout.tp)
            if hkv and kernels.rotary == "packed" and hasattr(m, "takes_one_op_path") \
                    and _llama_one_op(layout, hs):
                ops.append(_one_op_rotary(B * Tl, Tl, heads, hkv, hs, s, in_block))
            elif hkv:
                ops += _rotary(B * Tl, heads, hkv, hs, s, kernels, in_block)
    return _mark_selective(ops, block_of, kernels.selective)


def _mark_selective(ops, block_of, policy) -> list:
    """``ops`` with ``selective`` set on those selective recomputation repeats under
    ``policy`` (see :class:`KernelSet`): ``"core"``, attention's core; ``"op"``, the blocks'
    kernels other than the matrix products and the fused attention, and the 2nd, 4th, ...
    matrix product of each block (torchtitan counts ``aten.mm`` calls per checkpointed
    block; the products run in module order: q, k, v, o, then the MLP's). ``kept`` is
    set on the 1st, 3rd, ... product of each block under either policy: what
    mpishard's recomputation by op (``Layout.keep_products``) does not repeat."""
    if policy == "core":
        return [replace(op, selective=op.core, kept=by_op.kept)
                for op, by_op in zip(ops, _mark_selective(ops, block_of, "op"))]
    count: dict = {}
    out = []
    for i, op in enumerate(ops):
        if i in block_of:
            count[block_of[i]] = count.get(block_of[i], 0) + 1
            again = count[block_of[i]] % 2 == 0
        else:
            again = op.block and not op.matrix and not op.flash
        out.append(replace(op, selective=again, kept=i in block_of and not again))
    return out


def _flash(kernels, s, hs, p) -> tuple:
    """``(share of the flash rate, backward kernels)`` of a fused attention, else None."""
    if kernels.attention == "flash2":
        return 1.0, 1
    if kernels.attention == "flash1":                 # the Triton kernels: the do.o
        return FLASH1_ATTENTION_SHARE, 2              # row sums, then dq, dk and dv
    if kernels.attention == "mpishard" and p == 0 and attention_choice() == "fused" and \
            tensor_cores("__half" if s == 2 else "", hs):
        return TENSOR_CORE_ATTENTION_SHARE, 2                 # dq, then dk and dv
    return None


def _attention(bh, Tl, T, hs, s, p, block, flash) -> list:
    """Attention's core over ``bh`` (batch x local heads) of ``Tl`` queries and ``T`` keys
    (``flash``: a fused kernel's share of the flash rate and its backward kernels)."""
    if flash:           # one kernel forward; the causal half of the tiles
        flops = 2.0 * 2 * bh * Tl * T * hs / 2
        io = 4.0 * bh * Tl * hs * s
        share, backward = flash
        return [Op("attention", flops, io, 2.5 * flops, 2.5 * io, True, block, True, 1,
                   backward, flash=share)]
    scores = float(bh) * Tl * T
    mask = scores if p > 0 else 0.0
    ops = [_gemm("attention", Tl, T, hs, s, block, True, batch=bh),          # q k^T
           _vector("attention", scores, s, 5, 8, 2, 3, block, True)]        # scale, mask, softmax
    if p > 0:
        ops.append(_vector("attention", scores, s, 1, 1, 2, 2, block, True, extra_bytes=mask))
    ops.append(_gemm("attention", Tl, hs, T, s, block, True, batch=bh))      # probs v
    return ops


def tensor_core_attention_seconds(machine, bh: int, T: int, hs: int, dtype: str) -> tuple:
    """``(forward, backward)`` seconds this model plans for mpishard's tensor-core
    attention kernels over ``bh`` (batch x heads) causal sequences of ``T`` at head size
    ``hs`` in 16-bit ``dtype``: what ``benchmarks/attention.py`` times the kernels
    against, to measure :data:`TENSOR_CORE_ATTENTION_SHARE`."""
    s = 2 if dtype in ("float16", "bfloat16") else 4
    op, = _attention(bh, T, T, hs, s, 0.0, True, (TENSOR_CORE_ATTENTION_SHARE, 2))
    return op_seconds(op, machine, dtype)


def _table(table, size: float) -> float:
    for threshold, efficiency in table:
        if size >= threshold:
            return float(efficiency)
    return float(table[-1][1])


def op_seconds(op: Op, machine, dtype: str) -> tuple:
    """``(forward, backward)`` seconds of ``op`` on ``machine`` (see [Note: GPU kernel model])."""
    peak = machine.peak(dtype)

    def one(flops, nbytes, kernels):
        if not flops and not nbytes:
            return 0.0
        per_flops, per_bytes = flops / kernels, nbytes / kernels
        if op.flash:
            rate = peak * machine.flash_attention_efficiency * op.flash
        elif op.matrix:
            rate = peak * min(machine.matmul_efficiency,     # the best shape measured
                              _table(machine.matmul_efficiency_table, per_flops / 1e9))
        else:
            rate = machine.vector_peak(dtype) * _table(machine.vector_efficiency_table,
                                                       per_flops / 1e9)
        memory = machine.memory_bandwidth * _table(machine.memory_efficiency_table,
                                                   per_bytes / 1e6)
        return kernels * (per_flops / rate + per_bytes / memory + machine.launch_s)
    return one(op.fw_flops, op.fw_bytes, op.fw_kernels), one(op.bw_flops, op.bw_bytes,
                                                             op.bw_kernels)


def micro_batch_times(ops: list, machine, dtype: str, layout) -> dict:
    """One micro-batch's seconds: ``forward``, ``backward``, ``recompute`` (the forward
    kernels checkpointing repeats), ``attention`` (its core, both ways) and ``by
    class`` (forward + backward + recompute per op class)."""
    forward = backward = recompute = attention = 0.0
    by_class = dict.fromkeys(OP_CLASSES, 0.0)
    for op in ops:
        fw, bw = op_seconds(op, machine, dtype)
        again = fw if (layout.activation_checkpointing and op.block and not (
            layout.keep_products and op.kept)) or (layout.selective and op.selective) else 0.0
        forward, backward, recompute = forward + fw, backward + bw, recompute + again
        if op.core:
            attention += fw + bw
        by_class[op.cls] = by_class.get(op.cls, 0.0) + fw + bw + again
    return {"forward": forward, "backward": backward, "recompute": recompute,
            "attention": attention, "by class": by_class,
            "kernels": sum(op.fw_kernels + op.bw_kernels for op in ops)}
