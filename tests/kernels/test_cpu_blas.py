"""The CPU's 2-D products through MKL (MPISHARD_BLAS=mkl) against NumPy's, and the
choice's errors. `make test` installs MKL (the `mkl` extra) beside the references."""
import subprocess
import sys

import numpy as np
import pytest

from mpishard.kernels.cpu import blas as cpu_blas
from mpishard.kernels.cuda.gemm import batched_matmul


def _mkl_loads() -> bool:
    probe = ("import os; os.environ['MPISHARD_BLAS'] = 'mkl'; "
             "from mpishard.kernels.cpu.blas import mkl_library; mkl_library()")
    return subprocess.run([sys.executable, "-c", probe], capture_output=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": ""}).returncode == 0


needs_mkl = pytest.mark.skipif(not _mkl_loads(), reason="MKL not installed (pip install mkl)")


@pytest.fixture
def mkl(monkeypatch):
    monkeypatch.setenv("MPISHARD_BLAS", "mkl")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cpu_blas.mkl_library()


def _operand(rng, shape, dtype, layout):
    """A ``shape`` array as rows, transposed rows, rows with padding, or strided."""
    r, c = shape
    if layout == "rows":
        return rng.standard_normal(shape).astype(dtype)
    if layout == "transposed":
        return rng.standard_normal((c, r)).astype(dtype).T
    if layout == "padded":                            # a leading dimension past the width
        return rng.standard_normal((r, c + 5)).astype(dtype)[:, :c]
    return rng.standard_normal((r, 2 * c)).astype(dtype)[:, ::2]     # "strided": NumPy's


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("la", ["rows", "transposed", "padded", "strided"])
@pytest.mark.parametrize("lb", ["rows", "transposed", "padded"])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (37, 53, 29), (1, 300, 7), (64, 1, 5)])
def test_products_match_numpy(mkl, m, k, n, la, lb, dtype):
    rng = np.random.default_rng(m * 1000 + k + n)
    a, b = _operand(rng, (m, k), dtype, la), _operand(rng, (k, n), dtype, lb)
    want = np.matmul(a, b)
    tol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(cpu_blas.matmul(a, b), want, rtol=tol, atol=tol * k)
    out = np.full((m, n + 3), np.nan, dtype=dtype)[:, :n]    # into a padded view
    assert cpu_blas.matmul(a, b, out=out) is out
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * k)
    assert cpu_blas._mkl_gemm(a, b, np.empty((m, n), dtype)) == (la != "strided" or 1 in (m, k))


@needs_mkl
def test_what_mkl_does_not_take_goes_to_numpy(mkl):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 4)).astype(np.float32)
    for x, y in ((a.astype(np.float16), a.T.astype(np.float16)),     # dtype
                 (a, a.T.astype(np.float64)),                      # mixed
                 (a[None], a.T[None]),                             # batched
                 (a[:0], a.T)):                                    # empty
        np.testing.assert_allclose(cpu_blas.matmul(x, y), np.matmul(x, y), rtol=1e-3)
    square = rng.standard_normal((5, 5)).astype(np.float32)
    want = square @ square
    cpu_blas.matmul(square, square.copy(), out=square)               # out is an input
    np.testing.assert_allclose(square, want, rtol=1e-5)


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_gpt_step_on_mkl_matches_numpys(monkeypatch, dtype):
    """A GPT's loss and every gradient under MKL's products against NumPy's, over
    2 AdamW steps: the same to rounding (MKL sums in its own order)."""
    from mpishard.models import GPT, GPTConfig
    from mpishard.optim import AdamW

    def run(blas):
        monkeypatch.setenv("MPISHARD_BLAS", blas)
        cfg = GPTConfig(vocab_size=40, block_size=12, n_layer=2, n_head=2, n_embd=24)
        model = GPT(cfg, seed=1, dtype=np.dtype(dtype).name)
        opt = AdamW(model.parameters(), lr=1e-3)
        rng = np.random.default_rng(3)
        losses = []
        for _ in range(2):
            x, y = (rng.integers(0, 40, (3, 12)) for _ in range(2))
            _, loss = model(x, y)
            model.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, {n: p.grad.copy() for n, p in model.named_parameters()}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    want_losses, want_grads = run("numpy")
    got_losses, got_grads = run("mkl")
    tol = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got_losses, want_losses, rtol=tol)
    for name, g in want_grads.items():
        np.testing.assert_allclose(got_grads[name], g, rtol=tol, atol=tol, err_msg=name)


@needs_mkl
def test_the_linear_weight_gradient_goes_through_mkl(mkl, monkeypatch):
    calls = []
    real = cpu_blas._mkl_gemm
    monkeypatch.setattr(cpu_blas, "_mkl_gemm", lambda *a: calls.append(a[0].shape) or real(*a))
    g, x = np.ones((7, 3), np.float32), np.ones((7, 5), np.float32)
    np.testing.assert_array_equal(batched_matmul(g, x, trans_a=True), np.full((3, 5), 7.0))
    assert calls == [(3, 7)]


def test_an_unknown_choice_names_the_value_and_the_choices(monkeypatch):
    monkeypatch.setenv("MPISHARD_BLAS", "acml")
    with pytest.raises(ValueError, match=r"MPISHARD_BLAS='acml'.*numpy, mkl"):
        cpu_blas.matmul(np.ones((2, 2)), np.ones((2, 2)))


def test_mkl_that_does_not_load_says_how_to_get_it(monkeypatch, tmp_path):
    probe = ("import numpy as np; from mpishard.kernels.cpu import blas as cpu_blas\n"
             "try:\n    cpu_blas.matmul(np.ones((2, 2)), np.ones((2, 2)))\n"
             "except RuntimeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={"MPISHARD_BLAS": "mkl", "OMP_NUM_THREADS": "1", "PATH": "",
                              "MPISHARD_MKL_LIB": str(tmp_path / "libmkl_rt.so.3")})
    assert "pip install mkl" in out.stdout and "MPISHARD_MKL_LIB" in out.stdout, out


def test_numpy_is_the_default(monkeypatch):
    monkeypatch.delenv("MPISHARD_BLAS", raising=False)
    a = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(cpu_blas.matmul(a, a.T), a @ a.T)
    assert cpu_blas.blas_choice() == "numpy" and "NumPy's" in cpu_blas.describe()
