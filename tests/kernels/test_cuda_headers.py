"""Where NVRTC finds ``crt/mma.h`` for the tensor-core attention kernels
(mpishard/kernels/cuda/headers.py), and what runs when it is nowhere.

CUDA 13's pip wheels ship ``mma.h`` without the ``crt/`` headers it includes (those
are the ``nvidia-cuda-crt`` wheel), so a GPU with CuPy and no toolkit stopped at the
first 16-bit fused attention with "cannot open source file crt/mma.h".

    pytest tests/kernels/test_cuda_headers.py
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from cuda_host import use_host_kernels
from mpishard.kernels import reference
from mpishard.kernels.cuda import attention as gpu_attention
from mpishard.kernels.cuda import headers, launch
from mpishard.kernels.cuda.attention_src import flash_tile
from mpishard.kernels.cuda.attention_tc_src import TC_WARPS

MMA_CODE = "#include <mma.h>\nextern \"C\" __global__ void k() {}\n"


@pytest.fixture
def fresh_headers(monkeypatch, tmp_path):
    """headers' caches emptied before and after, its search limited to ``tmp_path``'s
    ``include`` (returned) and a scratch temp folder for the link."""
    for cached in (headers.crt_directory, headers.tensor_core_headers,
                   headers._crt_only_include):
        cached.cache_clear()
    include = tmp_path / "include"
    monkeypatch.setattr(headers, "_candidates", lambda: [str(tmp_path / "none"), str(include)])
    monkeypatch.setattr(headers.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    yield include
    for cached in (headers.crt_directory, headers.tensor_core_headers,
                   headers._crt_only_include):
        cached.cache_clear()


def test_a_found_crt_is_offered_alone(fresh_headers):
    crt = fresh_headers / "crt"
    crt.mkdir(parents=True)
    (crt / "mma.h").write_text("/* crt */\n")
    (fresh_headers / "cuda_fp16.h").write_text("/* not to be offered */\n")
    assert headers.crt_directory() == os.path.realpath(crt)
    options = headers.header_options(MMA_CODE)
    assert len(options) == 1 and options[0].startswith("-I")
    folder = options[0][2:]
    assert os.listdir(folder) == ["crt"]                     # nothing else shadows CuPy's
    assert os.path.realpath(os.path.join(folder, "crt", "mma.h")) == str(crt / "mma.h")
    assert headers.header_options(MMA_CODE) == options       # the same folder each time
    assert headers.header_options("extern \"C\" __global__ void k() {}") == ()
    assert headers.tensor_core_headers() is True


def test_no_crt_turns_the_tensor_cores_off_once_with_the_fix(fresh_headers):
    assert headers.crt_directory() is None
    assert headers.header_options(MMA_CODE) == ()
    with pytest.warns(RuntimeWarning, match="pip install nvidia-cuda-crt"):
        assert headers.tensor_core_headers() is False
    assert headers.tensor_core_headers() is False             # cached: warned once


def test_raw_function_compiles_with_the_header_options(monkeypatch):
    made = []

    class FakeModule:
        def __init__(self, code, options=()):
            made.append((code, options))

        def get_function(self, name):
            return name

    class FakeXp:
        RawModule = FakeModule

    monkeypatch.setattr(launch, "header_options", lambda code: ("-I/x",) if "mma" in code
                        else ())
    monkeypatch.setattr(launch, "_compiled", {})
    assert launch.raw_function(FakeXp, "k_tc", lambda: MMA_CODE) == "k_tc"
    assert launch.raw_function(FakeXp, "k", lambda: "plain") == "k"
    assert made == [(MMA_CODE, ("-I/x",)), ("plain", ())]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_without_the_headers_16_bit_rows_run_the_thread_a_row_kernels(monkeypatch, dtype):
    import ml_dtypes
    use_host_kernels(monkeypatch)
    monkeypatch.setattr(gpu_attention, "tensor_core_headers", lambda: False)
    monkeypatch.setattr(launch, "_compiled", {})
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    r = np.random.default_rng(5)
    hm = r.standard_normal((3, 1, 2, 70, 64)).astype(dt)
    gy = r.standard_normal((1, 2, 70, 64)).astype(dt)
    scale = 0.125
    assert gpu_attention._launch(hm)[1] == (flash_tile("float"),) != (TC_WARPS * 32,)
    y, lse = gpu_attention.flash_attention_forward(hm, scale)
    want_y, want_lse = reference.flash_attention_forward(hm, scale)
    tol = 4e-3 if dtype == "float16" else 1.6e-2
    np.testing.assert_allclose(y.astype(np.float64), want_y.astype(np.float64), rtol=tol,
                               atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    dh = gpu_attention.flash_attention_backward(hm, y, gy, lse, scale)
    want = reference.flash_attention_backward(hm, y, gy, lse, scale)
    for part in range(3):
        largest = max(1.0, float(np.abs(want[part].astype(np.float64)).max()))
        np.testing.assert_allclose(dh[part].astype(np.float64), want[part].astype(np.float64),
                                   rtol=tol, atol=tol * largest)
