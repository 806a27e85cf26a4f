"""Kernel launches, counted on the CuPy-strict module (mpishard.testing.strict).

On a GPU each array operation (a ufunc, in place too, a reduction, a matrix
product, a copy or cast, a gather or scatter, a filled creation) is a kernel
launch, and their number per training step is what kernel fusion must bring
down. The strict module counts them in ``strict.syncs.launches`` (by name in
``launches_by_op``); views and host reads are not launches, and a
``with strict.syncs.fused(name):`` block is one launch (a fused kernel).
benchmarks/syncs.py reports the per-step and per-block figures.
"""
import threading

import numpy as np
import pytest

from mpishard.testing import strict
from mpishard.core.backend import Backend
from mpishard.models import GPT, GPTConfig
from mpishard.optim import AdamW


@pytest.fixture(autouse=True)
def fresh_counter():
    strict.syncs.reset()
    yield
    strict.syncs.reset()


def launches(fn) -> dict:
    """The launches ``fn()`` makes, by name."""
    strict.syncs.reset()
    fn()
    counted = dict(strict.syncs.launches_by_op)
    assert strict.syncs.launches == sum(counted.values())
    return counted


def _inplace(a):
    a += 1.0


OPS = {   # each is one launch, named as given
    "ufunc": (lambda a, i: strict.exp(a), "exp"),
    "numpy-ufunc": (lambda a, i: np.exp(a), "exp"),
    "operator": (lambda a, i: a * 2.0, "multiply"),
    "in-place": (lambda a, i: _inplace(a), "add"),
    "ufunc-out": (lambda a, i: strict.multiply(a, 2.0, out=a), "multiply"),
    "reduction": (lambda a, i: a.sum(axis=0), "sum"),
    "numpy-reduction": (lambda a, i: np.max(a), "max"),
    "ufunc-reduce": (lambda a, i: np.add.reduce(a, axis=1), "add.reduce"),
    "matmul": (lambda a, i: a @ a.T, "matmul"),
    "einsum": (lambda a, i: strict.einsum("ij,kj->ik", a, a), "einsum"),
    "zeros": (lambda a, i: strict.zeros((3, 4), dtype=np.float32), "zeros"),
    "arange": (lambda a, i: strict.arange(5), "arange"),
    "astype": (lambda a, i: a.astype(np.float32), "astype"),
    "copy": (lambda a, i: a.copy(), "copy"),
    "gather": (lambda a, i: a[i], "take"),
    "gather-columns": (lambda a, i: a[:, i], "take"),
    "scatter": (lambda a, i: strict.scatter_add(a, i, 1.0), "scatter_add"),
    "setitem": (lambda a, i: a.__setitem__(slice(None), 0.0), "setitem"),
    "concatenate": (lambda a, i: np.concatenate([a, a]), "concatenate"),
    "where": (lambda a, i: strict.where(a, a, 0.0), "where"),
    "reshape-that-copies": (lambda a, i: a.T.reshape(-1), "reshape"),   # as CuPy: a copy
}


@pytest.mark.parametrize("case", list(OPS))
def test_an_operation_is_one_launch(case):
    fn, name = OPS[case]
    a, idx = strict.arange(12.0).reshape(3, 4), strict.asarray([0, 2])
    assert launches(lambda: fn(a, idx)) == {name: 1}


def test_views_attributes_and_host_reads_are_not_launches():
    a = strict.arange(12.0).reshape(3, 4)
    got = launches(lambda: (a.reshape(4, 3), a.reshape(-1), a.transpose(1, 0), a.T, a[1:],
                            a[:, ::2], a[0], a[0, 1], np.moveaxis(a, 0, 1),
                            strict.broadcast_to(a[0], (2, 3, 4)), a.astype(a.dtype, copy=False),
                            strict.asarray(a), strict.empty((2, 2)),
                            a.shape, a.dtype, a.ndim, a.size, np.shape(a)))
    assert got == {}
    strict.syncs.reset()
    a.get(), float(a[0, 0])                               # syncs, not launches
    assert strict.syncs.count == 2 and strict.syncs.launches == 0


def test_a_fused_block_is_one_launch():
    a = strict.arange(4.0)

    def five_ops():
        b = a * 2.0
        b += 1.0
        c = np.exp(b) - a
        return (c * c).sum()
    assert launches(five_ops) == {"multiply": 2, "add": 1, "exp": 1, "subtract": 1, "sum": 1}
    strict.syncs.reset()
    with strict.syncs.fused("x"):
        five_ops()
    assert strict.syncs.launches == 1 and strict.syncs.launches_by_op["x"] == 1
    strict.syncs.reset()
    with strict.syncs.fused("outer"):
        a * 2.0
        with strict.syncs.fused("inner"):
            a + 1.0
        with strict.syncs.fused("inner"):
            float(a.sum())                                # a sync inside stays a sync
    assert dict(strict.syncs.launches_by_op) == {"outer": 1} and strict.syncs.count == 1
    a + 1.0                                               # counted again after the block
    assert strict.syncs.launches == 2 and strict.syncs.fusing is None


def test_reset_zeroes_the_launches():
    a = strict.ones(3)
    a + a, a.sum()
    assert dict(strict.syncs.launches_by_op) == {"ones": 1, "add": 1, "sum": 1}
    strict.syncs.reset()
    assert strict.syncs.launches == 0 and not strict.syncs.launches_by_op


def test_the_launch_counter_is_per_thread():
    a = strict.ones(3)
    strict.syncs.reset()
    a + a
    seen = {}

    def other():
        strict.syncs.reset()
        a * a, a * a, a * a
        seen["launches"] = strict.syncs.launches
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen["launches"] == 3 and strict.syncs.launches == 1


def _gpt_step_launches(n_layer: int, steps: int = 3) -> list:
    """Launches in each of ``steps`` identical training steps of a tiny GPT."""
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=n_layer, n_head=2, n_embd=16)
    model = GPT(cfg, seed=0, backend=Backend.resolve("strict"))
    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (2, cfg.block_size)) for _ in range(2))
    counts = []
    for _ in range(steps):
        strict.syncs.reset()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        model.zero_grad()
        counts.append(strict.syncs.launches)
    return counts


def test_a_gpt_step_launches_more_with_more_blocks_and_the_same_each_step():
    one, two = _gpt_step_launches(1), _gpt_step_launches(2)
    assert one[1] == one[2] and two[1] == two[2], (one, two)    # after a warm-up step
    assert two[1] > one[1] > 0, (one, two)


def test_the_copies_cupys_matmul_makes_are_counted():
    """A transposed 2-D operand is a flag to cuBLAS; a strided one, and every transposed
    or float16 operand of a batched product, is copied first (CuPy 14's matmul)."""
    a = strict.ones((6, 4), dtype=np.float32)
    assert launches(lambda: a.T @ a) == {"matmul": 1}
    assert launches(lambda: a[:, ::2].T @ a[:, ::2]) == {"matmul": 1, "matmul-copy": 2}
    b = strict.ones((2, 6, 4), dtype=np.float32)
    assert launches(lambda: b @ b.swapaxes(-1, -2)) == {"matmul": 1, "matmul-copy": 1}
    h = strict.ones((2, 6, 4), dtype=np.float16)
    # float16: both operands cast to float32, the result cast back
    assert launches(lambda: h @ h.swapaxes(-1, -2)) == {"matmul": 1, "matmul-copy": 3}
    out = strict.empty((2, 6, 6), dtype=np.float32)
    assert launches(lambda: strict.matmul(h, h.swapaxes(-1, -2), out=out)) == {
        "matmul": 1, "matmul-copy": 2}                # a float32 out is written directly


def _block_launches(strategy: str, precision=None, optimizer: bool = False,
                    dropout: float = 0.1) -> tuple:
    """Launches per GPT block in ``train_step`` (forward, backward, gradient reduction;
    with ``optimizer``, in ``step`` instead: clipping and AdamW) under ``strategy`` at
    world size 1, from a 1- and a 2-block model, and the operations of the 2-block
    one's ``train_step`` (or ``step``)."""
    from mpishard.comm import Mesh
    from mpishard.testing.fake_cupy import make_test_comm
    from mpishard.parallel import ParallelModel

    per_step, by_op = [], None
    for n_layer in (1, 2):
        cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=n_layer, n_head=2, n_embd=16,
                        dropout=dropout)
        comm = make_test_comm("self")
        try:
            run = ParallelModel(GPT(cfg, seed=0, backend=Backend.resolve("strict"),
                                    materialize_now=False), Mesh(comm, dp=1),
                                strategy=strategy, precision=precision)
            opt = AdamW(run.parameters(), lr=1e-3, ledger=run.ledger)
            rng = np.random.default_rng(0)
            for step in range(2):
                x, y = (rng.integers(0, cfg.vocab_size, (2, cfg.block_size)) for _ in range(2))
                strict.syncs.reset()
                run.train_step(x, y)
                counted = strict.syncs.launches
                by_op = dict(strict.syncs.launches_by_op)
                strict.syncs.reset()
                run.step(opt, max_norm=1e-3 if optimizer else 1.0)    # clipping: every
                in_step = strict.syncs.launches                        # gradient scaled
                if optimizer:
                    by_op = dict(strict.syncs.launches_by_op)
        finally:
            comm.free()
        per_step.append(in_step if optimizer else counted)
    return per_step[1] - per_step[0], by_op


@pytest.mark.parametrize("precision", [None, "float16"])
def test_zero1_computes_gradients_into_its_buffers_like_ddp(precision):
    """ZeRO-1's full gradient buffer takes the gradients straight from backward (no copy
    per parameter), as DDP's buckets do; no product goes through CuPy's copies; under
    float16 the weights' gradients come out of the 16-bit products in float32."""
    ddp, ddp_ops = _block_launches("ddp", precision)
    zero1, zero1_ops = _block_launches("zero1", precision)
    assert zero1 == ddp, (ddp_ops, zero1_ops)
    assert "matmul-copy" not in zero1_ops and "matmul-copy" not in ddp_ops


def test_bfloat16_takes_the_launches_of_float16():
    """bfloat16 rows go to the same 16-bit kernels as float16 (GELU, layer norm, the
    products on cuBLAS), not through casts around the float32 ones: the same launches
    per block."""
    f16, f16_ops = _block_launches("ddp", "float16")
    bf16, bf16_ops = _block_launches("ddp", "bfloat16")
    assert bf16 == f16, (f16_ops, bf16_ops)
    for kernel in ("mpishard_gelu16_forward", "mpishard_gelu16_backward",
                   "mpishard_layer_norm_forward", "cublas_gemm_strided_batched"):
        assert bf16_ops.get(kernel) == f16_ops.get(kernel) > 0, kernel
    assert "matmul-copy" not in bf16_ops


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_a_gpt_block_takes_at_most_43_launches(strategy):
    """The fusion budget (benchmarks/syncs.py reports the same figure at a larger size):
    a block's forward, backward and gradient reduction in float32 with dropout on, 43
    launches at most (40 before its two layer norms and its GELU ran their forward
    kernels again in backward instead of keeping float32 normalised rows and tanh: see
    [Note: what ops keep] in mpishard/autodiff/rows.py), each of the block's fused
    kernels among them once or twice."""
    per_block, by_op = _block_launches(strategy)
    assert per_block <= 43, (per_block, by_op)
    for kernel in ("mpishard_causal_softmax", "mpishard_softmax_backward",
                   "mpishard_unpack_heads", "mpishard_bias_gelu_backward"):
        assert by_op.get(kernel) == 2, (kernel, by_op)           # 2 blocks, once each
    assert "mpishard_dropout_add" in by_op and "matmul-copy" not in by_op


@pytest.mark.parametrize("strategy,precision", [("ddp", None), ("zero1", None),
                                                ("zero3", None), ("ddp", "float16")])
def test_clipping_and_adamw_take_three_launches_whatever_the_blocks(strategy, precision):
    """The gradients' sums of squares (two multi-tensor kernels: the chunks', then each
    gradient's), the loss scale's and the clipping's factor, the decoupled weight
    decay and Adam's update (one multi-tensor kernel, the factor and the decay inside)
    take the same launches for 1 and 2 blocks: none per block (there were 40: three
    per parameter and the 4 weight matrices' decay)."""
    per_block, by_op = _block_launches(strategy, precision, optimizer=True)
    assert per_block == 0, (per_block, by_op)
    assert by_op.get("mpishard_multi_adam") == 1, by_op
    assert by_op.get("mpishard_multi_sq_sum") == 1 and by_op.get("mpishard_multi_sq_total") == 1
    assert "mpishard_adam_update" not in by_op and "mpishard_sq_sum" not in by_op


def test_rope_qkv_is_one_launch_each_way_for_grouped_heads():
    """rope_qkv on a device with grouped-query heads (8 query heads reading 2 key/value
    heads, 4 each, as Llama's; or a tp rank's 2 reading the 2nd of 3) is one kernel each
    way: forward writes the packed rows, backward q's, k's and v's gradients (the
    rotation's sign taken inside, no tables built; 20 launches forward and 17 backward
    before). The uneven map [1, 2, 2] runs the reference, a copy per query head."""
    from mpishard.autodiff import Tensor, rms_rope_swiglu
    cos, sin = rms_rope_swiglu.rope_tables(3, 4, dtype="float32", xp=strict)

    def run(n_q, n_kv, heads):
        r = np.random.default_rng(0)
        q, k, v = (Tensor(strict.asarray(r.standard_normal((2, 3, n, 4), dtype=np.float32)),
                          requires_grad=True) for n in (n_q, n_kv, n_kv))
        forward = launches(lambda: rms_rope_swiglu.rope_qkv(q, k, v, cos, sin, heads))
        out = rms_rope_swiglu.rope_qkv(q, k, v, cos, sin, heads)
        backward = launches(lambda: out.backward(strict.ones(out.shape, dtype=np.float32)))
        backward.pop("ones")                                     # the upstream gradient
        return forward, backward
    for n_q, n_kv, heads in ((8, 2, [j // 4 for j in range(8)]), (2, 3, [1, 1])):
        forward, backward = run(n_q, n_kv, heads)
        assert forward == {"mpishard_rope_qkv_forward": 1}, forward
        assert backward == {"mpishard_rope_qkv_backward": 1}, backward
    forward, _ = run(3, 3, [1, 2, 2])
    assert forward["setitem"] >= 2 * 3                           # a copy per query head
