"""The kernel layer: every set against the protocol, every CPU kernel against its
reference, the selection, the thread pool."""
import inspect
import types

import numpy as np
import pytest

from mpishard.kernels import kernel_choice, kernels_for, reference
from mpishard.kernels.cpu import ops as cpu
from mpishard.kernels.cuda import ops as gpu
from mpishard.kernels.cpu import threads
from mpishard.kernels.protocol import KERNEL_NAMES, KernelSet

KERNEL_SETS = {"reference": reference, "cpu": cpu, "gpu": gpu}

def _protocol_mismatches(kernel_set) -> list:
    """What ``kernel_set`` lacks or gets wrong of :class:`KernelSet`: an attribute of
    another type, a kernel missing or with another signature (``self`` left out)."""
    wrong = [f"{attr} is not a {kind}" for attr, kind in KernelSet.__annotations__.items()
             if not isinstance(getattr(kernel_set, attr, None), {"str": str, "bool": bool}[kind])]
    for name in KERNEL_NAMES:
        kernel = getattr(kernel_set, name, None)
        if not callable(kernel):
            wrong.append(f"no kernel {name}")
            continue
        want = inspect.signature(getattr(KernelSet, name))
        want = want.replace(parameters=list(want.parameters.values())[1:])
        if inspect.signature(kernel) != want:
            wrong.append(f"{name}{inspect.signature(kernel)}, not {name}{want}")
    return wrong


@pytest.mark.parametrize("name", sorted(KERNEL_SETS))
def test_every_kernel_set_provides_the_protocol(name):
    """Each set has every kernel of the protocol, with its signature: a kernel added to
    KernelSet and missing in a set (or taking other parameters) fails here."""
    kernel_set = KERNEL_SETS[name]
    assert kernel_set.NAME == name
    assert _protocol_mismatches(kernel_set) == []
    assert {"NAME", "NATIVE_FLOAT16", *KERNEL_NAMES} <= set(kernel_set.__all__)


def test_the_protocol_check_finds_a_missing_kernel_and_a_changed_signature():
    assert "gelu_forward" in KERNEL_NAMES and "NAME" not in KERNEL_NAMES
    short = types.SimpleNamespace(**{n: getattr(reference, n) for n in KERNEL_NAMES
                                     if n != "sq_sum"}, NAME="short", NATIVE_FLOAT16=False)
    assert _protocol_mismatches(short) == ["no kernel sq_sum"]

    def sq_sum(x, result):
        return result
    short.sq_sum, short.NATIVE_FLOAT16 = sq_sum, None
    assert _protocol_mismatches(short) == ["NATIVE_FLOAT16 is not a bool",
                                           "sq_sum(x, result), not sq_sum(x, out)"]


SHAPES = [(37, 53), (1, 7), (0, 16), (300, 301), (2048, 64)]
TOL = {np.float64: 1e-12, np.float32: 2e-5}


def _rand(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _close(a, b, dtype):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"threads{n}")
def n_threads(request, monkeypatch):
    monkeypatch.setenv("MPISHARD_THREADS", str(request.param))
    return request.param


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_cpu_kernel_matches_its_reference(shape, dtype, n_threads):
    x, g = _rand(shape, dtype), _rand(shape, dtype, 1)
    w, b = _rand(shape[1:], dtype, 2), _rand(shape[1:], dtype, 3)
    # GELU
    (y1, t1), (y2, t2) = cpu.gelu_forward(x), reference.gelu_forward(x)
    _close(y1, y2, dtype), _close(t1, t2, dtype)
    _close(cpu.gelu_backward(x, t1, g), reference.gelu_backward(x, t2, g), dtype)
    # layer norm and RMS norm, with and without affine parameters
    for weight, bias in ((w, b), (None, None), (w, None)):
        got, want = cpu.layer_norm_forward(x, weight, bias, 1e-5), \
            reference.layer_norm_forward(x, weight, bias, 1e-5)
        for a, c in zip(got, want):
            _close(a, c, dtype)
        _close(cpu.layer_norm_backward(g, got[1], got[2], weight),
               reference.layer_norm_backward(g, want[1], want[2], weight), dtype)
        got, want = cpu.rms_norm_forward(x, weight, 1e-6), \
            reference.rms_norm_forward(x, weight, 1e-6)
        for a, c in zip(got, want):
            _close(a, c, dtype)
        _close(cpu.rms_norm_backward(g, got[1], got[2], weight),
               reference.rms_norm_backward(g, want[1], want[2], weight), dtype)
    # the norms' weight and bias gradients, fresh and into given buffers
    for need in ((True, True), (True, False), (False, True), (False, False)):
        for out in (False, True):
            outs = [np.full(shape[1], np.nan, dtype) if out and n else None for n in need]
            got = cpu.norm_param_grads(g, x, *need, *outs)
            for a, c, o in zip(got, reference.norm_param_grads(g, x, *need), outs):
                assert (a is None) == (c is None)
                if a is not None:
                    _close(a, c, dtype)
                    assert o is None or a is o
    # dropout, with and without the residual
    drop_u = np.random.default_rng(5).random(shape, dtype=np.float32)
    for resid in (x, None):
        np.testing.assert_array_equal(cpu.dropout_add(resid, g, drop_u, 0.3),
                                      reference.dropout_add(resid, g, drop_u, 0.3))
    np.testing.assert_array_equal(cpu.dropout_backward(g, drop_u, 0.3),
                                  reference.dropout_backward(g, drop_u, 0.3))
    # SwiGLU, both gradients and each alone
    u = _rand(shape, dtype, 4)
    _close(cpu.swiglu_forward(x, u), reference.swiglu_forward(x, u), dtype)
    for need in ((True, True), (True, False), (False, True)):
        for a, c in zip(cpu.swiglu_backward(x, u, g, *need),
                        reference.swiglu_backward(x, u, g, *need)):
            assert (a is None) == (c is None)
            if a is not None:
                _close(a, c, dtype)
    # softmax in place
    a, c = x.copy(), x.copy()
    cpu.softmax_rows(a), reference.softmax_rows(c)
    _close(a, c, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("T,n,scale", [(7, 3, 0.3), (16, 1, 1.0), (1, 4, 2.0), (33, 0, 0.5)])
def test_attention_softmax_matches_its_reference(T, n, scale, dtype, n_threads):
    s, g = _rand((n * T, T), dtype), _rand((n * T, T), dtype, 1)
    a, want = s.copy(), s.copy()
    cpu.causal_softmax(a, T, scale)
    reference.causal_softmax(want, T, scale)
    _close(a, want, dtype)
    q = np.arange(n * T) % T                              # each row's query position
    assert (a[np.arange(T)[None, :] > q[:, None]] == 0).all()          # later keys masked
    np.testing.assert_allclose(a.sum(axis=1), 1.0, rtol=TOL[dtype])
    manual = np.exp(scale * s - (scale * s).max(axis=1, keepdims=True))
    manual[np.arange(T)[None, :] > q[:, None]] = 0
    np.testing.assert_allclose(a, manual / manual.sum(axis=1, keepdims=True),
                               rtol=10 * TOL[dtype], atol=TOL[dtype])
    d, dwant = g.copy(), g.copy()
    cpu.softmax_backward(d, a, scale)
    reference.softmax_backward(dwant, want, scale)
    _close(d, dwant, dtype)
    np.testing.assert_allclose(d, (g - (g * a).sum(axis=1, keepdims=True)) * a * scale,
                               rtol=10 * TOL[dtype], atol=TOL[dtype])


def _model_mask(u, p, dtype):
    """The dropout mask the models multiplied by before the dropout kernels."""
    mask = (u >= p).astype(dtype)
    mask *= 1.0 / (1.0 - p)
    return mask


def _draws(shape, p, seed=6):
    """Uniform float32 draws, some exactly at float32(p) (kept: NumPy compares in float32)."""
    u = np.random.default_rng(seed).random(shape, dtype=np.float32)
    u.reshape(-1)[::7] = np.float32(p)
    return u


def _same_bits(got, want):
    """Equal values and dtype (a dropped element may be +0 where the mask gave -0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(37, 53), (0, 16), (300, 301)], ids=str)
def test_fused_biases_and_added_gradients_are_the_models_math_bit_for_bit(shape, dtype,
                                                                         n_threads):
    """The CPU kernels that take a linear layer's bias (GELU, dropout and the residual
    add) or add into a gradient (the norms' backward) give what the unfused model
    computed: the bias added to the product first, the bias's gradient a ones-vector
    product, the gradient added after; bit for bit."""
    a, g, x = _rand(shape, dtype), _rand(shape, dtype, 1), _rand(shape, dtype, 2)
    bias = _rand(shape[1:], dtype, 3)
    ones = np.ones(shape[0], dtype)
    y, t = cpu.gelu_forward(a, bias)
    want_y, want_t = cpu.gelu_forward(a + bias)
    _same_bits(y, want_y), _same_bits(t, want_t)
    out = np.full(shape[1], np.nan, dtype)
    gx, gb = cpu.bias_gelu_backward(a, bias, t, g, out_bias=out)
    want = cpu.gelu_backward(a + bias, t, g)
    _same_bits(gx, want), _same_bits(gb, ones @ want)
    assert gb is out
    (rx, rb), (wx, wb) = cpu.bias_gelu_backward(a, bias, t, g), \
        reference.bias_gelu_backward(a, bias, t, g)
    _close(rx, wx, dtype), _close(rb, wb, dtype) if shape[0] < 100 else None
    u, p = _draws(shape, 0.3), 0.3
    mask = _model_mask(u, p, dtype)
    for module in (cpu, reference):
        _same_bits(module.dropout_add(x, a, u, p, bias), x + (a + bias) * mask)
        _same_bits(module.dropout_add(None, a, u, p, bias), (a + bias) * mask)
        _same_bits(module.dropout_add(x, a, None, 0.0, bias), x + (a + bias))
        gy, gb = module.bias_dropout_backward(g, u, p)
        _same_bits(gy, g * mask), _same_bits(gb, ones @ (g * mask))
        gy, gb = module.bias_dropout_backward(g, None, 0.0, out_bias=out)
        assert gy is g and gb is out
        _same_bits(gb, ones @ g)
    # the norms' input gradient added into the gradient so far
    w = _rand(shape[1:], dtype, 4)
    _, xhat, rstd = cpu.layer_norm_forward(a, w, bias, 1e-5)
    for fn in (cpu.layer_norm_backward, cpu.rms_norm_backward,
               reference.layer_norm_backward, reference.rms_norm_backward):
        so_far = x.copy()
        assert fn(g, xhat, rstd, w, into=so_far) is so_far
        _same_bits(so_far, x + fn(g, xhat, rstd, w))


@pytest.mark.parametrize("module", [cpu, reference], ids=lambda m: m.NAME)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("shape", [(37, 53), (0, 16), (2, 3, 40), (5,)], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.7])
def test_dropout_is_the_models_mask_bit_for_bit(module, shape, dtype, p):
    x, y = _rand(shape, dtype), _rand(shape, dtype, 1)
    u = _draws(shape, p)
    mask = _model_mask(u, p, dtype)
    _same_bits(module.dropout_add(x, y, u, p), x + y * mask)
    _same_bits(module.dropout_add(None, y, u, p), y * mask)
    _same_bits(module.dropout_backward(y, u, p), y * mask)
    assert np.array_equal(y, _rand(shape, dtype, 1))                  # inputs only read


@pytest.mark.parametrize("module", [cpu, reference], ids=lambda m: m.NAME)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("T,n", [(7, 3), (16, 1), (33, 0), (64, 20)])
def test_attention_dropout_is_the_models_mask_bit_for_bit(module, T, n, dtype, n_threads):
    s, g = _rand((n * T, T), dtype), _rand((n * T, T), dtype, 1)
    u, p = _draws(s.shape, 0.2), 0.2
    a, plain = s.copy(), s.copy()
    module.causal_softmax(plain, T, 0.25)
    dropped = module.causal_softmax(a, T, 0.25, drop_u=u, drop_p=p)
    _same_bits(a, plain)                                  # the weights as without dropout
    _same_bits(dropped, plain * _model_mask(u, p, dtype))
    into = np.empty_like(a)
    assert module.causal_softmax(s.copy(), T, 0.25, u, p, dropped=into) is into
    _same_bits(into, dropped)
    d, want = g.copy(), g * _model_mask(u, p, dtype)
    module.softmax_backward(d, a, 0.25, drop_u=u, drop_p=p)
    module.softmax_backward(want, a, 0.25)
    _same_bits(d, want)
    again, d2 = np.full_like(a, np.nan), g.copy()   # the dropped weights on the way
    module.softmax_backward(d2, a, 0.25, drop_u=u, drop_p=p, dropped=again)
    _same_bits(again, dropped)
    _same_bits(d2, want)


def _packed_by_hand(h, dtype):
    """The packed rows of a head-major (3, B, nh, T, hs) buffer, one element at a time."""
    _, B, nh, T, hs = h.shape
    out = np.empty((B * T, 3 * nh * hs), dtype=dtype)
    for w, b, head, t in np.ndindex(3, B, nh, T):
        out[b * T + t, (w * nh + head) * hs:(w * nh + head + 1) * hs] = h[w, b, head, t]
    return out


@pytest.mark.parametrize("module", [cpu, reference], ids=lambda m: m.NAME)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("B,nh,T,hs", [(2, 3, 5, 7), (1, 1, 1, 1), (3, 2, 0, 4), (1, 4, 9, 16)])
def test_unpack_heads_is_the_packed_layout_with_column_sums(module, B, nh, T, hs, dtype):
    h = _rand((3, B, nh, T, hs), dtype)
    want = _packed_by_hand(h, dtype)
    rows, sums = module.unpack_heads(h)
    assert sums is None
    _same_bits(rows, want)
    sum_dtype = np.float32 if dtype == np.float16 else dtype
    into = np.full(3 * nh * hs, np.nan, dtype=sum_dtype)
    rows, sums = module.unpack_heads(h, True, into)
    assert sums is into
    _same_bits(rows, want)
    _same_bits(sums, np.ones(B * T, dtype=sum_dtype) @ want.astype(sum_dtype))
    rows, sums = module.unpack_heads(h, True, dtype=np.float64)      # cast on the way
    _same_bits(rows, want.astype(np.float64))
    assert sums.dtype == np.float64 and sums.shape == (3 * nh * hs,)


@pytest.mark.parametrize("module", [cpu, reference], ids=lambda m: m.NAME)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("shape", [(37, 53), (0,), (1,), (3, 0, 2), (4097,)], ids=str)
def test_sq_sum_is_the_float64_dot_into_its_slot(module, shape, dtype):
    x = _rand(shape, dtype)
    slots = np.full(3, np.nan)
    assert module.sq_sum(x, slots[1:2]).base is slots
    flat = x.reshape(-1).astype(np.float64)
    assert slots[1] == np.dot(flat, flat) and np.isnan(slots[[0, 2]]).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(37, 53), (0, 16), (1, 7), (2048, 64)], ids=str)
def test_norm_param_grads_are_the_models_col_sums_bit_for_bit(shape, dtype):
    g, xhat = _rand(shape, dtype), _rand(shape, dtype, 1)
    ones = np.ones(shape[0], dtype=dtype)
    gw, gb = cpu.norm_param_grads(g, xhat, True, True)
    _same_bits(gw, ones @ (g * xhat))
    _same_bits(gb, ones @ g)
    bucket = np.full(2 * shape[1] + 3, np.nan, dtype)     # views into a gradient bucket
    out_w, out_b = bucket[:shape[1]], bucket[shape[1] + 3:]
    got = cpu.norm_param_grads(g, xhat, True, True, out_weight=out_w, out_bias=out_b)
    assert got[0] is out_w and got[1] is out_b
    _same_bits(bucket[:shape[1]], gw)
    _same_bits(bucket[shape[1] + 3:], gb)
    assert np.isnan(bucket[shape[1]:shape[1] + 3]).all()
    assert cpu.norm_param_grads(g, xhat, False, False) == (None, None)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("size", [0, 5, 4096, 3 * 4096 + 17, 100_003])
def test_adam_update_matches_reference(size, dtype, n_threads):
    p, g = _rand(size, dtype), _rand(size, dtype, 1)
    m, v = _rand(size, dtype, 2), np.abs(_rand(size, dtype, 3))
    args = (0.9, 0.95, 1e-3 / (1 - 0.9 ** 3), 1 / np.sqrt(1 - 0.95 ** 3), 1e-8)
    mine = [a.copy() for a in (p, g, m, v)]
    ref = [a.copy() for a in (p, g, m, v)]
    cpu.adam_update(*mine, *args)
    reference.adam_update(*ref, *args)
    for a, c in zip(mine, ref):
        _close(a, c, dtype)
    assert np.array_equal(mine[1], g)                    # the gradient is only read


def test_adam_update_on_strided_views_updates_the_views():
    base = [_rand((6, 10), np.float64, s) for s in range(4)]
    base[3] = np.abs(base[3])
    ref = [b.copy() for b in base]
    views = [b[:, ::2] for b in base]
    cpu.adam_update(*views, 0.9, 0.99, 1e-3, 1.0, 1e-8)
    reference.adam_update(*[r[:, ::2] for r in ref], 0.9, 0.99, 1e-3, 1.0, 1e-8)
    for a, c in zip(base, ref):
        _close(a, c, np.float64)
    assert not np.array_equal(base[0], _rand((6, 10), np.float64, 0))


def test_results_do_not_depend_on_the_thread_count(monkeypatch):
    x = _rand((1000, 257), np.float32)
    out = {}
    for n in (1, 2, 4):
        monkeypatch.setenv("MPISHARD_THREADS", str(n))
        out[n] = (cpu.gelu_forward(x)[0], cpu.layer_norm_forward(x, None, None, 1e-5)[0])
    for n in (2, 4):
        for a, b in zip(out[1], out[n]):
            assert np.array_equal(a, b)


def test_selection_per_backend_and_the_reference_switch(monkeypatch):
    monkeypatch.delenv("MPISHARD_KERNELS", raising=False)
    assert kernel_choice() == "auto"
    assert kernels_for(np) is cpu
    from mpishard.testing import strict
    assert kernels_for(strict) is gpu
    monkeypatch.setenv("MPISHARD_KERNELS", "reference")
    assert kernels_for(np) is reference and kernels_for(strict) is reference
    monkeypatch.setenv("MPISHARD_KERNELS", "fastest")
    with pytest.raises(ValueError, match="MPISHARD_KERNELS='fastest'.*reference"):
        kernels_for(np)


def test_a_model_step_under_reference_kernels_matches_the_default(monkeypatch):
    from mpishard.models import GPT, GPTConfig
    from mpishard.optim import AdamW
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    x = np.random.default_rng(0).integers(0, 32, (3, 8))
    losses = {}
    for choice in ("auto", "reference"):
        monkeypatch.setenv("MPISHARD_KERNELS", choice)
        model = GPT(cfg, seed=0, dtype="float64")
        opt = AdamW(model.parameters(), lr=1e-2)
        got = []
        for _ in range(3):
            _, loss = model(x, np.roll(x, -1, 1))
            model.zero_grad()
            loss.backward()
            opt.step()
            got.append(loss.item())
        losses[choice] = got
    np.testing.assert_allclose(losses["auto"], losses["reference"], rtol=1e-12)


def test_thread_count_is_opt_in(monkeypatch):
    monkeypatch.delenv("MPISHARD_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")              # BLAS's, not the kernels'
    assert threads.thread_count() == 1
    monkeypatch.setenv("MPISHARD_THREADS", "2")
    assert threads.thread_count() == 2
    for bad in ("zero", "0"):
        monkeypatch.setenv("MPISHARD_THREADS", bad)
        with pytest.raises(ValueError, match="MPISHARD_THREADS"):
            threads.thread_count()


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("n_rows,n_cols", [(0, 5), (1, 1 << 17), (1000, 300), (7, 40000)])
def test_for_rows_covers_every_row_once(n, n_rows, n_cols):
    seen = np.zeros(n_rows, int)

    def visit(rows):
        seen[rows] += 1
    threads.for_rows(visit, n_rows, n_cols, threads=n)
    assert (seen == 1).all()


def test_for_rows_raises_a_workers_error_after_all_finish():
    done = []

    def visit(rows):
        if rows.start > 0:
            raise RuntimeError(f"bad block {rows.start}")
        done.append(rows)
    with pytest.raises(RuntimeError, match="bad block"):
        threads.for_rows(visit, 4096, 256, threads=2)
    assert done                                           # the caller's share still ran


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_device_kernels_match_the_references(array_backend, dtype):
    """The kernel set of each array module (on CuPy the compiled kernels; on the strict
    module the fused blocks, one launch each) against the reference computed by NumPy,
    at T=1024 sizes of a 768-wide model (tiny on NumPy and strict, where this is about
    the plumbing)."""
    xp = array_backend.xp
    if xp is np:
        pytest.skip("NumPy's kernels are checked against the references above")
    k = kernels_for(xp)
    rows = 1024 if array_backend.name == "cupy" else 37
    width = 3 * 257
    host = [_rand((rows, width), dtype, s) for s in range(4)]
    a, t, g, u = (xp.asarray(h) for h in host)
    tol = TOL[np.dtype(dtype).type]

    def close(got, want, rtol=tol, atol=tol):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(xp.asnumpy(got) if hasattr(xp, "asnumpy") else got.get(),
                                   want, rtol=rtol, atol=atol)

    def same_as_before(got, before):    # a column sum launched again: the same bits
        for x, y in zip(got, before):
            np.testing.assert_array_equal(x.get(), y.get())
    y, tt = k.gelu_forward(a)
    wy, wt = reference.gelu_forward(host[0])
    close(y, wy), close(tt, wt)
    close(k.gelu_backward(a, t, g), reference.gelu_backward(host[0], host[1], host[2]))
    close(k.swiglu_forward(a, u), reference.swiglu_forward(host[0], host[3]))
    for got, want in zip(k.swiglu_backward(a, u, g),
                         reference.swiglu_backward(host[0], host[3], host[2])):
        close(got, want)
    p, m, v = (xp.asarray(h) for h in (host[0], host[1], np.abs(host[3])))
    wp, wm, wv = host[0].copy(), host[1].copy(), np.abs(host[3])
    k.adam_update(p, g, m, v, 0.9, 0.95, 1e-3, 1.2, 1e-8)
    reference.adam_update(wp, host[2], wm, wv, 0.9, 0.95, 1e-3, 1.2, 1e-8)
    close(p, wp), close(m, wm), close(v, wv)
    # the norms, with each of their affine parameters and none; then the parameters'
    # gradients (sums over the rows: their rounding grows with the row count)
    w, b = xp.asarray(host[1][0]), xp.asarray(host[2][0])
    for weight, bias in ((w, b), (None, None), (w, None), (None, b)):
        hw = None if weight is None else host[1][0]
        hb = None if bias is None else host[2][0]
        got = k.layer_norm_forward(a, weight, bias, 1e-5)
        want = reference.layer_norm_forward(host[0], hw, hb, 1e-5)
        for x, y in zip(got, want):
            close(x, y)
        close(k.layer_norm_backward(g, got[1], got[2], weight),
              reference.layer_norm_backward(host[2], want[1], want[2], hw))
        got = k.rms_norm_forward(a, weight, 1e-6)
        want = reference.rms_norm_forward(host[0], hw, 1e-6)
        for x, y in zip(got, want):
            close(x, y)
        close(k.rms_norm_backward(g, got[1], got[2], weight),
              reference.rms_norm_backward(host[2], want[1], want[2], hw))
    sum_tol = tol * rows ** 0.5
    want_w, want_b = reference.norm_param_grads(host[2], host[0], True, True)
    gw, gb = k.norm_param_grads(g, a, True, True)
    close(gw, want_w, sum_tol, sum_tol), close(gb, want_b, sum_tol, sum_tol)
    same_as_before(k.norm_param_grads(g, a, True, True), (gw, gb))
    bucket = xp.zeros(2 * width + 1, dtype=dtype)        # views into a gradient bucket
    out_w, out_b = bucket[:width], bucket[width + 1:]
    gw, gb = k.norm_param_grads(g, a, True, True, out_weight=out_w, out_bias=out_b)
    assert gw is out_w and gb is out_b
    close(bucket[:width], want_w, sum_tol, sum_tol), close(bucket[width + 1:], want_b,
                                                            sum_tol, sum_tol)
    gw, gb = k.norm_param_grads(g, a, False, True)
    assert gw is None
    close(gb, want_b, sum_tol, sum_tol)
    close(k.norm_param_grads(g[:0], a[:0], True, False)[0], np.zeros(width, dtype))
    # rows with a stride (not C-contiguous): CuPy's norms fall back to 3 and 2 launches
    view, hview = a[:, 5:], host[0][:, 5:]
    got = k.layer_norm_forward(view, None, None, 1e-5)
    want = reference.layer_norm_forward(hview, None, None, 1e-5)
    for x, y in zip(got, want):
        close(x, y)
    close(k.layer_norm_backward(g[:, 5:], got[1], got[2], None),
          reference.layer_norm_backward(host[2][:, 5:], want[1], want[2], None))
    got = k.rms_norm_forward(view, None, 1e-6)
    want = reference.rms_norm_forward(hview, None, 1e-6)
    for x, y in zip(got, want):
        close(x, y)
    close(k.rms_norm_backward(g[:, 5:], got[1], got[2], None),
          reference.rms_norm_backward(host[2][:, 5:], want[1], want[2], None))
    # dropout, also of 16-bit data (the draws always float32)
    u_host = _draws((rows, width), 0.3)
    drop_u = xp.asarray(u_host)
    close(k.dropout_add(a, g, drop_u, 0.3), reference.dropout_add(host[0], host[2], u_host, 0.3))
    close(k.dropout_add(None, g, drop_u, 0.3), reference.dropout_add(None, host[2], u_host, 0.3))
    close(k.dropout_backward(g, drop_u, 0.3), reference.dropout_backward(host[2], u_host, 0.3))
    h16 = [h.astype(np.float16) for h in host[:2]]
    close(k.dropout_add(*(xp.asarray(h) for h in h16), drop_u, 0.3),
          reference.dropout_add(*h16, u_host, 0.3), 1e-3, 1e-3)
    close(k.dropout_backward(xp.asarray(h16[1]), drop_u, 0.3),
          reference.dropout_backward(h16[1], u_host, 0.3), 1e-3, 1e-3)
    # attention's softmax, without and with dropout of the weights
    T = 64 if array_backend.name == "cupy" else 8
    scores = _rand((3 * T, T), dtype, 5)
    got, want = xp.asarray(scores), scores.copy()
    k.causal_softmax(got, T, 0.125)
    reference.causal_softmax(want, T, 0.125)
    close(got, want)
    d, dwant = xp.asarray(scores), scores.copy()
    k.softmax_backward(d, got, 0.125)
    reference.softmax_backward(dwant, want, 0.125)
    close(d, dwant)
    su_host = _draws(scores.shape, 0.25)
    su = xp.asarray(su_host)
    got, want = xp.asarray(scores), scores.copy()
    dropped = k.causal_softmax(got, T, 0.125, drop_u=su, drop_p=0.25)
    close(dropped, reference.causal_softmax(want, T, 0.125, drop_u=su_host, drop_p=0.25))
    close(got, want)
    d, dwant = xp.asarray(scores), scores.copy()
    k.softmax_backward(d, got, 0.125, drop_u=su, drop_p=0.25)
    reference.softmax_backward(dwant, want, 0.125, drop_u=su_host, drop_p=0.25)
    close(d, dwant)
    # GELU on float16 rows (one kernel each way on a GPU), against float32 math
    h16 = [h.astype(np.float16) for h in host[:3]] + [host[3][0].astype(np.float16)]
    a16, t16, g16, b16 = (xp.asarray(h) for h in h16)
    for bias, hb in ((None, None), (b16, h16[3])):
        y, t32 = k.gelu16_forward(a16, bias)
        wy, wt = reference.gelu16_forward(h16[0], hb)
        assert y.dtype == np.float16 and t32.dtype == np.float32
        close(y, wy, 1e-3, 1e-3), close(t32, wt, 1e-6, 1e-6)
        for need in (False, True):
            gx, gb = k.gelu16_backward(a16, bias, t32, g16, need and bias is not None)
            wx, wb = reference.gelu16_backward(h16[0], hb, wt, h16[2], need and hb is not None)
            close(gx, wx, 1e-3, 1e-3)
            assert (gb is None) == (wb is None)
            if gb is not None:
                close(gb, wb, 1e-4 * rows, 1e-4 * rows)
    # rope_qkv's kernels (one each way on a GPU): Llama's groups and a tp rank's (its
    # query heads reading the second of three key/value heads), in dtype and on float16
    # rows (computed in float32), against the references
    from mpishard.autodiff.rms_rope_swiglu import rope_tables
    Tr, hs = (256, 64) if array_backend.name == "cupy" else (5, 8)
    for H, n_kv, kv_of in ((8, 2, [j // 4 for j in range(8)]), (2, 3, [1, 1])):
        kv_of = np.asarray(kv_of)
        shapes = ((2, Tr, H, hs), (2, Tr, n_kv, hs), (2, Tr, n_kv, hs), (2, Tr, 3, H, hs))
        for rdt, rtol in ((dtype, tol), (np.float16, 1e-3)):
            hq, hk, hv, hd = (_rand(shape, rdt, i) for i, shape in enumerate(shapes))
            tables = rope_tables(Tr, hs, 500000.0, dtype=dtype)
            cos, sin = (xp.asarray(t) for t in tables)
            close(k.rope_qkv_forward(*(xp.asarray(h) for h in (hq, hk, hv)), cos, sin, kv_of),
                  reference.rope_qkv_forward(hq, hk, hv, *tables, kv_of), rtol, rtol)
            for rgot, rwant in zip(k.rope_qkv_backward(xp.asarray(hd), cos, sin, kv_of, n_kv),
                                   reference.rope_qkv_backward(hd, *tables, kv_of, n_kv)):
                close(rgot, rwant, rtol, rtol)
    # the layer norm on float16 rows (statistics and parameter gradients float32)
    w16 = xp.asarray(host[1][0].astype(np.float16))
    y, h16k, r16k = k.layer_norm_forward(a16, w16, b16, 1e-5)
    h, r = h16k, r16k
    wy, wh, wr = reference.layer_norm_forward(h16[0].astype(np.float32),
                                              host[1][0].astype(np.float16).astype(np.float32),
                                              h16[3].astype(np.float32), 1e-5)
    assert (y.dtype, h.dtype, r.dtype) == (np.float16, np.float32, np.float32)
    close(y, wy.astype(np.float16), 2e-3, 2e-3), close(h, wh, 1e-4, 1e-4), close(r, wr, 1e-4, 0)
    w32 = host[1][0].astype(np.float16).astype(np.float32)
    gx = k.layer_norm_backward(g16, h, r, w16)
    hh = xp.asnumpy(h) if hasattr(xp, "asnumpy") else h.get()
    hr = xp.asnumpy(r) if hasattr(xp, "asnumpy") else r.get()
    close(gx, reference.layer_norm_backward(h16[2].astype(np.float32), hh, hr, w32)
          .astype(np.float16), 2e-3, 2e-3)
    gw, gb = k.norm_param_grads(g16, h, True, True)
    ww, wb = reference.norm_param_grads(h16[2].astype(np.float32), hh, True, True)
    close(gw, ww, 1e-4 * rows, 1e-4 * rows), close(gb, wb, 1e-4 * rows, 1e-4 * rows)
    # a gradient's sum of squares (the clipping norm) into its slot
    slots = xp.asarray(np.zeros(2))
    assert k.sq_sum(g, slots[1:2]) is not None
    flat = host[2].reshape(-1).astype(np.float64)
    close(slots[1:2], np.array([np.dot(flat, flat)]), 1e-12, 0)
    # attention's gradients from the head-major layout, with c_attn's bias gradient
    heads = _rand((3, 2, 3, T, 8), dtype, 7)
    want_rows, want_sums = reference.unpack_heads(heads, True)
    got_rows, got_sums = k.unpack_heads(xp.asarray(heads), True)
    close(got_rows, want_rows), close(got_sums, want_sums, sum_tol, sum_tol)
    into = xp.asarray(np.full(want_sums.shape, np.nan, dtype=dtype))
    assert k.unpack_heads(xp.asarray(heads), True, into)[1] is into
    close(into, want_sums, sum_tol, sum_tol)
    close(k.unpack_heads(xp.asarray(heads))[0], want_rows)
    d, again = xp.asarray(scores), xp.asarray(np.full_like(scores, np.nan))
    k.softmax_backward(d, got, 0.125, drop_u=su, drop_p=0.25, dropped=again)
    close(d, dwant)
    close(again, reference.causal_softmax(scores.copy(), T, 0.125, drop_u=su_host,
                                          drop_p=0.25))
    # a linear layer's bias inside GELU, dropout and the residual add; the norms'
    # input gradient added into the gradient so far
    bias = xp.asarray(host[3][0])
    y, tt = k.gelu_forward(a, bias)
    wy, wt = reference.gelu_forward(host[0], host[3][0])
    close(y, wy), close(tt, wt)
    gx, gbias = k.bias_gelu_backward(a, bias, tt, g)
    wx, wb = reference.bias_gelu_backward(host[0], host[3][0], wt, host[2])
    close(gx, wx), close(gbias, wb, sum_tol, sum_tol)
    same_as_before(k.bias_gelu_backward(a, bias, tt, g), (gx, gbias))
    for du, dp in ((drop_u, 0.3), (None, 0.0)):
        hu = None if du is None else u_host
        close(k.dropout_add(a, g, du, dp, bias),
              reference.dropout_add(host[0], host[2], hu, dp, host[3][0]))
        close(k.dropout_add(None, g, du, dp, bias),
              reference.dropout_add(None, host[2], hu, dp, host[3][0]))
        gy, gbias = k.bias_dropout_backward(g, du, dp)
        wy, wb = reference.bias_dropout_backward(host[2], hu, dp)
        close(gy, wy), close(gbias, wb, sum_tol, sum_tol)
    _, h, r = k.layer_norm_forward(a, w, b, 1e-5)
    hh, hr = xp.asnumpy(h) if hasattr(xp, "asnumpy") else h.get(), \
        xp.asnumpy(r) if hasattr(xp, "asnumpy") else r.get()
    for name in ("layer_norm_backward", "rms_norm_backward"):
        so_far = xp.asarray(host[1])
        assert getattr(k, name)(g, h, r, w, into=so_far) is so_far
        close(so_far, host[1] + getattr(reference, name)(host[2], hh, hr, host[1][0]))
    if array_backend.name == "strict":                    # one launch per fused kernel
        from mpishard.testing import strict

        def one_launch(name, fn, *args, **kwargs):
            strict.syncs.reset()
            result = fn(*args, **kwargs)
            assert dict(strict.syncs.launches_by_op) == {name: 1}, fn.__name__
            return result
        one_launch("mpishard_gelu_forward", k.gelu_forward, a)
        one_launch("mpishard_adam_update", k.adam_update, p, g, m, v, 0.9, 0.95, 1e-3, 1.2,
                   1e-8)
        one_launch("mpishard_causal_softmax", k.causal_softmax, got, T, 0.125)
        one_launch("mpishard_softmax_backward", k.softmax_backward, d, got, 0.125)
        one_launch("mpishard_causal_softmax", k.causal_softmax, got, T, 0.125, su, 0.25)
        one_launch("mpishard_causal_softmax", k.causal_softmax, got, T, 0.125, su, 0.25,
                   dropped)
        one_launch("mpishard_softmax_backward", k.softmax_backward, d, got, 0.125, su, 0.25)
        one_launch("mpishard_softmax_backward", k.softmax_backward, d, got, 0.125, su, 0.25,
                   again)
        one_launch("mpishard_unpack_heads", k.unpack_heads, xp.asarray(heads), True)
        one_launch("mpishard_sq_sum", k.sq_sum, g, slots[0:1])
        one_launch("mpishard_gelu16_forward", k.gelu16_forward, a16, b16)
        one_launch("mpishard_layer_norm_forward", k.layer_norm_forward, a16, w16, b16, 1e-5)
        one_launch("mpishard_layer_norm_backward", k.layer_norm_backward, g16, h16k, r16k,
                   w16)
        one_launch("mpishard_norm_param_grads", k.norm_param_grads, g16, h16k, True, True)
        one_launch("mpishard_gelu16_backward", k.gelu16_backward, a16, None, t32, g16, False)
        one_launch("mpishard_unpack_heads", k.unpack_heads, xp.asarray(heads), True, into)
        _, h, r = one_launch("mpishard_layer_norm_forward", k.layer_norm_forward, a, w, b, 1e-5)
        one_launch("mpishard_layer_norm_backward", k.layer_norm_backward, g, h, r, w)
        _, h, r = one_launch("mpishard_rms_norm_forward", k.rms_norm_forward, a, w, 1e-6)
        one_launch("mpishard_rms_norm_backward", k.rms_norm_backward, g, h, r, w)
        one_launch("mpishard_norm_param_grads", k.norm_param_grads, g, h, True, True)
        one_launch("mpishard_norm_param_grads", k.norm_param_grads, g, h, True, True, out_w,
                   out_b)
        one_launch("mpishard_dropout_add", k.dropout_add, a, g, drop_u, 0.3)
        one_launch("mpishard_dropout_add", k.dropout_add, None, g, drop_u, 0.3)
        one_launch("mpishard_dropout_backward", k.dropout_backward, g, drop_u, 0.3)
        one_launch("mpishard_gelu_forward", k.gelu_forward, a, bias)
        one_launch("mpishard_bias_gelu_backward", k.bias_gelu_backward, a, bias, tt, g)
        one_launch("mpishard_dropout_add", k.dropout_add, a, g, drop_u, 0.3, bias)
        one_launch("mpishard_dropout_add", k.dropout_add, a, g, None, 0.0, bias)
        one_launch("mpishard_bias_dropout_backward", k.bias_dropout_backward, g, drop_u, 0.3)
        one_launch("mpishard_bias_dropout_backward", k.bias_dropout_backward, g, None, 0.0)
        one_launch("mpishard_layer_norm_backward", k.layer_norm_backward, g, h, r, w,
                   into=xp.asarray(host[1]))


@pytest.mark.parametrize("with_bias", [False, True])
def test_float16_gelu_on_a_device_is_the_cast_up_math_bit_for_bit(with_bias):
    """On the strict module (as on a GPU) float16 GELU runs the 16-bit kernels instead of
    casting up, computing and casting down: the same values, one launch forward and one
    backward (and the bias's column sums)."""
    from mpishard.testing import strict
    from mpishard.autodiff import Tensor
    from mpishard.autodiff.nn_ops import gelu

    rng = np.random.default_rng(0)
    a, g = (rng.standard_normal((37, 53)).astype(np.float16) for _ in range(2))
    b = rng.standard_normal(53).astype(np.float16)
    x = Tensor(strict.asarray(a), requires_grad=True)
    bias = Tensor(strict.asarray(b), requires_grad=True) if with_bias else None
    strict.syncs.reset()
    y = gelu(x, bias)
    assert dict(strict.syncs.launches_by_op) == {"mpishard_gelu16_forward": 1}
    y.backward(strict.asarray(g))
    a32, b32 = a.astype(np.float32), b.astype(np.float32) if with_bias else None
    wy, wt = reference.gelu_forward(a32, b32)
    _same_bits(y.data.get(), wy.astype(np.float16))
    wx = reference.gelu_backward(a32 if b32 is None else a32 + b32, wt, g.astype(np.float32))
    _same_bits(x.grad.get(), wx.astype(np.float16))
    if with_bias:
        np.testing.assert_allclose(bias.grad.get(), wx.sum(axis=0).astype(np.float16),
                                   rtol=2e-3, atol=1e-3)


def _launches_each_way(forward, g) -> tuple:
    """``(y, forward's launches, backward's)`` of ``y = forward()`` on the strict module,
    backward from the host gradient ``g``."""
    from mpishard.testing import strict
    strict.syncs.reset()
    y = forward()
    launched = dict(strict.syncs.launches_by_op)
    dy = strict.asarray(g)
    strict.syncs.reset()
    y.backward(dy)
    return y, launched, dict(strict.syncs.launches_by_op)


def test_float16_layer_norm_on_a_device_is_the_cast_up_math_bit_for_bit():
    """On the strict module (as on a GPU) a float16 layer norm runs its kernels on the
    float16 rows (see [Note: float16 rows] in mpishard/kernels/cuda/norms.py): the values of
    casting up, the float32 kernels and casting down, one launch each (backward's
    forward kernel again: the normalised rows, not kept), no casts."""
    from mpishard.testing import strict
    from mpishard.autodiff import Tensor
    from mpishard.autodiff.nn_ops import layer_norm

    rng = np.random.default_rng(1)
    a, g = (rng.standard_normal((37, 53)).astype(np.float16) for _ in range(2))
    w, b = (rng.standard_normal(53).astype(np.float16) for _ in range(2))
    x = Tensor(strict.asarray(a), requires_grad=True)
    weight, bias = (Tensor(strict.asarray(v), requires_grad=True) for v in (w, b))
    for p in (weight, bias):              # as mixed precision's: float32 gradients
        p.grad_dtype = np.dtype(np.float32)
    y, forward, backward = _launches_each_way(lambda: layer_norm(x, weight, bias), g)
    assert forward == {"mpishard_layer_norm_forward": 1}
    assert backward == {"mpishard_layer_norm_forward": 1, "mpishard_layer_norm_backward": 1,
                        "mpishard_norm_param_grads": 1}
    a32, w32, b32, g32 = (v.astype(np.float32) for v in (a, w, b, g))
    wy, wh, wr = reference.layer_norm_forward(a32, w32, b32, 1e-5)
    _same_bits(y.data.get(), wy.astype(np.float16))
    _same_bits(x.grad.get(), reference.layer_norm_backward(g32, wh, wr, w32)
               .astype(np.float16))
    ww, wb = reference.norm_param_grads(g32, wh, True, True)
    _same_bits(weight.grad.get(), ww)
    _same_bits(bias.grad.get(), wb)


@pytest.mark.parametrize("held", ["tensor", "parameter"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float16_rms_norm_on_a_device_is_the_cast_up_math_bit_for_bit(dtype, held):
    """RMS norm (Llama's) the same way: its kernels on the 16-bit rows, one launch each
    way (and the forward's again in backward) and one for the weight's gradient, the
    values of casting up and down; also with the weight a Parameter holding its 16-bit
    compute copy, as mixed precision's (whose ``dtype`` is the float32 master's: the op
    cast every norm up and down, 6 launches more each, when it asked that)."""
    from mpishard.testing import strict
    from mpishard.autodiff import Tensor
    from mpishard.autodiff.rms_rope_swiglu import rms_norm
    from mpishard.core.dtypes import resolve_dtype
    from mpishard.nn import Parameter

    rng = np.random.default_rng(2)
    dt = resolve_dtype(dtype)
    a, g = (rng.standard_normal((37, 53)).astype(dt) for _ in range(2))
    w = rng.standard_normal(53).astype(dt)
    x = Tensor(strict.asarray(a), requires_grad=True)
    if held == "tensor":
        weight = Tensor(strict.asarray(w), requires_grad=True)
    else:
        weight = Parameter((53,), dtype="float32")
        weight.data = strict.asarray(w)                  # the strategy's compute copy
        assert weight.dtype == np.float32 and weight.data.dtype == dt
    weight.grad_dtype = np.dtype(np.float32)             # as mixed precision's
    y, forward, backward = _launches_each_way(lambda: rms_norm(x, weight, 1e-6), g)
    assert forward == {"mpishard_rms_norm_forward": 1}
    assert backward == {"mpishard_rms_norm_forward": 1, "mpishard_rms_norm_backward": 1,
                        "mpishard_norm_param_grads": 1}
    a32, w32, g32 = (v.astype(np.float32) for v in (a, w, g))
    wy, wh, wr = reference.rms_norm_forward(a32, w32, 1e-6)
    _same_bits(y.data.get(), wy.astype(dt))
    _same_bits(x.grad.get(), reference.rms_norm_backward(g32, wh, wr, w32).astype(dt))
    _same_bits(weight.grad.get(), reference.norm_param_grads(g32, wh, True, False)[0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_swiglu_on_a_device_is_the_cast_up_math_bit_for_bit(dtype):
    """SwiGLU on 16-bit rows runs the 16-bit kernels on the strict module (as on a GPU):
    one launch each way where casting up, computing and casting down took 3 and 5
    more, the same values."""
    from mpishard.autodiff import Tensor
    from mpishard.autodiff.rms_rope_swiglu import swiglu
    from mpishard.core.dtypes import resolve_dtype
    from mpishard.testing import strict

    dt = resolve_dtype(dtype)
    rng = np.random.default_rng(4)
    a, u, g = (rng.standard_normal((37, 53)).astype(dt) for _ in range(3))
    gate, up = (Tensor(strict.asarray(v), requires_grad=True) for v in (a, u))
    y, forward, backward = _launches_each_way(lambda: swiglu(gate, up), g)
    assert forward == {"mpishard_swiglu16_forward": 1}
    assert backward == {"mpishard_swiglu16_backward": 1}
    a32, u32, g32 = (v.astype(np.float32) for v in (a, u, g))
    _same_bits(y.data.get(), reference.swiglu_forward(a32, u32).astype(dt))
    want_gate, want_up = reference.swiglu_backward(a32, u32, g32)
    _same_bits(gate.grad.get(), want_gate.astype(dt))
    _same_bits(up.grad.get(), want_up.astype(dt))
    # a float32 gradient into 16-bit rows (not the kernels' dtype): the cast-up path
    y = swiglu(gate, up)
    gate.grad = up.grad = None
    y.backward(strict.asarray(g32))
    _same_bits(gate.grad.get(), want_gate.astype(dt))


def test_compile_kernels_covers_every_cuda_source():
    """scripts/compile_kernels.py (NVRTC, no GPU) reads every kernels/cuda/*_src.py and
    lists every elementwise body, reduction and RawKernel module they hold."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("compile_kernels",
                                                  root / "scripts" / "compile_kernels.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for path in sorted((root / "mpishard" / "kernels" / "cuda").glob("*_src.py")):
        module = getattr(script, path.stem, None)
        assert module is not None, f"compile_kernels.py does not read {path.name}"
        assert hasattr(module, "SOURCES") == (module in script.ELEMENTWISE_MODULES), path.name
        assert hasattr(module, "REDUCTIONS") == (module in script.REDUCTION_MODULES), path.name
    listed = script.sources_to_compile(["-I."])
    names = {name for name, *_ in listed}
    for module in script.ELEMENTWISE_MODULES:
        assert set(module.SOURCES) <= names
    for module in script.REDUCTION_MODULES:
        assert set(module.REDUCTIONS) <= names
    raw = " ".join(name for name in names if name.startswith("RawKernels"))
    for module, source in ((script.ops_src, "ROW_KERNELS"), (script.norms_src, "NORM_KERNELS")):
        kernels = script.raw_kernel_names(getattr(module, source)).split(", ")
        assert len(kernels) >= 3 and all(kernel in raw for kernel in kernels), kernels
    assert {T for name, T, *_ in listed if name.startswith("multi-tensor")} == {"float", "double"}
    assert sum(name.startswith("flash attention") for name, *_ in listed) == 12
    assert len(script.sources_to_compile(None)) < len(listed)     # 16-bit left out
