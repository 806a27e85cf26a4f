"""Fused attention on tensor cores: the WMMA kernels that float16 and bfloat16 rows at a
head size that is a multiple of 16 run (``MPISHARD_ATTENTION=fused``).

* tests/cuda_wmma.py's emulation of ``nvcuda::wmma`` against CUDA's definition of
  its product, each layout;
* the kernels compiled for the host (tests/cuda_host.py, with that emulation) through the kernel set's own launch code, against
  the fused reference: output, log-sum-exp and the q, k and v gradients, float16 and
  bfloat16, head sizes 16 to 128, sequences within one tile, across several, and off
  the tiles, run twice for the same bits;
* the same source compiled by ``nvcc`` for sm_90 (skipped without it): no spills, no
  stack, and the shared memory the launcher plans, within 48 KiB;
* a GPT step on the CuPy-strict module in float16 and bfloat16 with the fused kernels
  (their reference math) against the batched path.

    pytest tests/kernels/test_tensor_core_attention.py
"""
from __future__ import annotations

import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from cuda_host import HostModule, host_compiler, use_host_kernels
from mpishard.kernels import reference
from mpishard.kernels.cuda import attention as gpu_attention
from mpishard.kernels.cuda.attention_src import flash_source
from mpishard.kernels.cuda.attention_tc_src import (TC_ROWS, TC_WARPS, tc_shared_bytes, tc_tiles,
                                                    tensor_cores)

BF16 = np.dtype(ml_dtypes.bfloat16)
#: the largest difference from the reference, relative to the largest value: the 16-bit
#: rows' step at 1 (the weights and dS enter the products as 16-bit numbers), twice it
#: for bfloat16
TOLERANCE = {"float16": 4e-3, "bfloat16": 1.6e-2}
# (B, heads, T, head size): one tile, several with T off the tiles, a partial tile
SHAPES = [(1, 2, 70, 64), (1, 1, 130, 128), (2, 1, 17, 16), (1, 3, 64, 32), (1, 1, 200, 48)]


@pytest.fixture
def host_flash(monkeypatch):
    use_host_kernels(monkeypatch)


def _f64(a):
    return np.asarray(a, dtype=np.float64)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("B,nh,T,hs", SHAPES, ids=str)
def test_tensor_core_kernels_compute_the_fused_math(host_flash, B, nh, T, hs, dtype):
    r = np.random.default_rng(hs + T)
    hm = r.standard_normal((3, B, nh, T, hs)).astype(dtype)
    gy = r.standard_normal((B, nh, T, hs)).astype(dtype)
    scale = 1.0 / np.sqrt(hs)
    assert gpu_attention._launch(hm)[1] == (TC_WARPS * 32,)         # the WMMA kernels
    y, lse = gpu_attention.flash_attention_forward(hm, scale)
    want_y, want_lse = reference.flash_attention_forward(hm, scale)
    assert y.dtype == dtype and lse.dtype == np.float32 and lse.shape == (B, nh, T)
    tol = TOLERANCE[dtype.name]
    np.testing.assert_allclose(_f64(y), _f64(want_y), rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    dh = gpu_attention.flash_attention_backward(hm, y, gy, lse, scale)
    want = reference.flash_attention_backward(hm, y, gy, lse, scale)
    assert dh.dtype == dtype and dh.shape == hm.shape
    for part, name in enumerate(("dq", "dk", "dv")):
        largest = max(1.0, float(np.abs(_f64(want[part])).max()))
        np.testing.assert_allclose(_f64(dh[part]), _f64(want[part]), rtol=tol,
                                   atol=tol * largest, err_msg=name)
    again = gpu_attention.flash_attention_backward(hm, y, gy, lse, scale)
    np.testing.assert_array_equal(again.view(np.uint16), dh.view(np.uint16))   # no atomics


#: D = A B + C through the warp matrix functions, every operand through shared memory
#: with rows 24 elements apart; ``transposed``: each read and written column-major
WMMA_PRODUCT = r"""
#include <mma.h>
typedef {S} S;
using namespace nvcuda;
extern "C" __global__ void product(const S* a, const S* b, const float* c, float* d,
                                   const int transposed) {
  alignas(32) __shared__ S as[16 * 24], bs[16 * 24];
  alignas(32) __shared__ float cs[16 * 24];
  for (int e = threadIdx.x; e < 256; e += 32) {
    as[e / 16 * 24 + e % 16] = a[e];
    bs[e / 16 * 24 + e % 16] = b[e];
    cs[e / 16 * 24 + e % 16] = c[e];
  }
  __syncwarp();
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  const wmma::layout_t layout = transposed ? wmma::mem_col_major : wmma::mem_row_major;
  wmma::load_matrix_sync(acc, cs, 24, layout);
  if (transposed) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::col_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::col_major> fb;
    wmma::load_matrix_sync(fa, as, 24);
    wmma::load_matrix_sync(fb, bs, 24);
    wmma::mma_sync(acc, fa, fb, acc);
  } else {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::row_major> fb;
    wmma::load_matrix_sync(fa, as, 24);
    wmma::load_matrix_sync(fb, bs, 24);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  __syncwarp();
  wmma::store_matrix_sync(cs, acc, 24, layout);
  __syncwarp();
  for (int e = threadIdx.x; e < 256; e += 32) d[e] = cs[e / 16 * 24 + e % 16];
}
"""


@pytest.mark.skipif(host_compiler() is None, reason="no g++")
@pytest.mark.parametrize("S,dtype", [("__half", np.dtype(np.float16)), ("__nv_bfloat16", BF16)])
def test_the_wmma_emulation_is_the_documented_product(S, dtype):
    """tests/cuda_wmma.py against CUDA's definition: row-major, ``A B + C``; every operand
    column-major, the transposes' product, so ``B A + C`` in memory."""
    r = np.random.default_rng(5)
    a, b = (r.standard_normal((16, 16)).astype(dtype) for _ in range(2))
    c = r.standard_normal((16, 16)).astype(np.float32)
    kernel = HostModule(WMMA_PRODUCT.replace("{S}", S)).get_function("product")
    a64, b64 = _f64(a), _f64(b)
    for transposed, want in ((0, a64 @ b64 + c), (1, b64 @ a64 + c)):
        d = np.empty((16, 16), dtype=np.float32)
        kernel((1,), (32,), (a, b, c, d, np.int32(transposed)))
        np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-5)


def test_other_rows_keep_the_thread_a_row_kernels():
    """float32, float64, and 16-bit rows at a head size off the fragments."""
    assert tensor_cores("__half", 64) and tensor_cores("__nv_bfloat16", 128)
    assert not tensor_cores("__half", 24) and not tensor_cores("float", 64)
    assert not tensor_cores("__half", 144)
    for dtype, S, hs in ((np.float32, "float", 64), (np.float64, "double", 64),
                         (np.float16, "__half", 24)):
        hm = np.zeros((3, 1, 1, 40, hs), dtype=dtype)
        assert gpu_attention._launch(hm)[1][0] in (16, 32)              # a thread a row
        assert "wmma" not in flash_source("double" if S == "double" else "float", S, hs)


def test_the_tiles_fit_the_shared_memory():
    for hs in range(16, 129, 16):
        for kernel, tile in tc_tiles(hs).items():
            assert tile % 16 == 0 and tc_shared_bytes(kernel, hs, tile) <= 48 * 1024
    assert tc_tiles(64) == {"forward": 64, "dq": 64, "dkv": 64}
    assert tc_tiles(128) == {"forward": 32, "dq": 16, "dkv": 16}


_PTXAS_FUNCTION = re.compile(r"Function properties for (\w+)")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers.*?(\d+) bytes smem")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("S", ["__half", "__nv_bfloat16"])
@pytest.mark.parametrize("hs", [64, 128])
def test_ptxas_reports_no_spills(tmp_path, S, hs):
    """ptxas's report for sm_90: every kernel without a stack frame or spills, at most
    255 registers, and the static shared memory :func:`tc_shared_bytes` plans."""
    (tmp_path / "k.cu").write_text(flash_source("float", S, hs))
    done = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"),
                           "--ptxas-options=-v", str(tmp_path / "k.cu")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report, kernel = {}, None
    for line in done.stderr.splitlines():
        if m := _PTXAS_FUNCTION.search(line):
            kernel = m.group(1)
        elif kernel and (m := _PTXAS_FRAME.search(line)):
            report[kernel] = [int(g) for g in m.groups()]
        elif kernel and (m := _PTXAS_USED.search(line)):
            report[kernel] += [int(m.group(1)), int(m.group(2))]
    tiles = tc_tiles(hs)
    assert sorted(report) == sorted(f"mpishard_flash_{k}_{'half' if S == '__half' else 'bfloat16'}"
                                    f"_{hs}" for k in tiles)
    for name, (stack, stores, loads, registers, smem) in report.items():
        kind = name.split("_")[2]
        assert (stack, stores, loads) == (0, 0, 0), (name, report[name])
        assert registers <= 255 and smem == tc_shared_bytes(kind, hs, tiles[kind]) <= 48 * 1024


def _step(monkeypatch, choice, precision):
    from mpishard.comm import Mesh
    from mpishard.core.backend import Backend
    from mpishard.models import GPT, GPTConfig
    from mpishard.parallel import ParallelModel
    from mpishard.testing.fake_cupy import make_test_comm

    monkeypatch.setenv("MPISHARD_ATTENTION", choice)
    cfg = GPTConfig(vocab_size=64, block_size=40, n_layer=2, n_head=2, n_embd=64)
    model = GPT(cfg, seed=0, backend=Backend.resolve("strict"))
    comm = make_test_comm("self")
    try:
        run = ParallelModel(model, Mesh(comm, dp=1), strategy="ddp", precision=precision)
        r = np.random.default_rng(0)
        x, y = (r.integers(0, cfg.vocab_size, (3, cfg.block_size)) for _ in range(2))
        loss = run.train_step(x, y)
    finally:
        comm.free()
    return loss, {n: np.asarray(p.grad.get(), dtype=np.float64)
                  for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_a_16_bit_gpt_step_matches_the_batched_path(monkeypatch, precision):
    """One training step on the strict module with 16-bit compute (head size 32, the
    tensor-core kernels' rows on a GPU; here the fused reference): the loss and every
    parameter's gradient (loss-scaled in float16) as with the batched products, to the
    16-bit rows' tolerance of each gradient's largest value."""
    fused_loss, fused = _step(monkeypatch, "fused", precision)
    loss, params = _step(monkeypatch, "batched", precision)
    tol = TOLERANCE[precision]
    np.testing.assert_allclose(float(fused_loss), float(loss), rtol=tol)
    for name, value in params.items():
        np.testing.assert_allclose(fused[name], value, rtol=0,
                                   atol=tol * float(np.abs(value).max()), err_msg=name)
