"""Where NVRTC finds ``crt/mma.h`` for the tensor-core attention kernels
(mpishard/kernels/cuda/headers.py), and what runs when it is nowhere.

CUDA 13's pip wheels ship ``mma.h`` without the ``crt/`` headers it includes (those
are the ``nvidia-cuda-crt`` wheel), so a GPU with CuPy and no toolkit stopped at the
first 16-bit fused attention with "cannot open source file crt/mma.h".

    pytest tests/kernels/test_cuda_headers.py
"""
from __future__ import annotations

import os
import types
import warnings

import numpy as np
import pytest

from cuda_host import use_host_kernels
from mpishard.kernels import reference
from mpishard.kernels.cuda import attention as gpu_attention
from mpishard.kernels.cuda import headers, launch
from mpishard.kernels.cuda.attention_src import flash_tile
from mpishard.kernels.cuda.attention_tc_src import TC_WARPS

@pytest.fixture
def fresh_headers(monkeypatch, tmp_path):
    """headers' caches emptied before and after; its search limited to ``tmp_path``'s
    ``include`` (returned) and its links made under ``tmp_path``'s ``cache``."""
    def clear():
        headers.crt_directory.cache_clear()
        headers.tensor_core_options.cache_clear()
    clear()
    include = tmp_path / "include"
    monkeypatch.setattr(headers, "_candidates", lambda: [str(tmp_path / "none"), str(include)])
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    yield include
    clear()


class FakeNvrtc:
    """An array module whose RawModule compiles ``<mma.h>`` only with an ``-I`` folder
    holding ``crt/mma.h`` (or, ``own_crt``, always: CuPy's own headers have it)."""

    def __init__(self, own_crt: bool = False):
        self.own_crt, self.tried = own_crt, []

    def RawModule(self, code, options=()):            # noqa: N802 (CuPy's name)
        self.tried.append(options)
        found = self.own_crt or any(
            os.path.isfile(os.path.join(o[2:], "crt", "mma.h")) for o in options)
        if "<mma.h>" in code and not found:
            raise RuntimeError('cannot open source file "crt/mma.h"')
        return types.SimpleNamespace(get_function=lambda name: name)


def _crt(include):
    crt = include / "crt"
    crt.mkdir(parents=True)
    (crt / "mma.h").write_text("/* crt */\n")
    (include / "cuda_fp16.h").write_text("/* not to be offered */\n")
    return crt


def test_cupys_own_headers_need_no_options(fresh_headers):
    nvrtc = FakeNvrtc(own_crt=True)
    assert headers.tensor_core_options(nvrtc) == () and nvrtc.tried == [()]


def test_a_found_crt_is_offered_alone(fresh_headers):
    crt = _crt(fresh_headers)
    nvrtc = FakeNvrtc()
    options = headers.tensor_core_options(nvrtc)
    assert len(options) == 1 and options[0].startswith("-I") and nvrtc.tried == [(), options]
    folder = options[0][2:]
    assert os.listdir(folder) == ["crt"]                     # nothing else shadows CuPy's
    assert os.path.samefile(os.path.join(folder, "crt", "mma.h"), crt / "mma.h")
    assert headers.tensor_core_options(nvrtc) == options and len(nvrtc.tried) == 2  # once
    assert headers.crt_only_include(headers.crt_directory()) == folder   # the same folder


def test_a_stale_link_is_replaced(fresh_headers, tmp_path):
    crt = str(_crt(fresh_headers))
    wrong = tmp_path / "elsewhere"
    wrong.mkdir()
    made = headers.crt_only_include(crt)
    os.remove(os.path.join(made, "crt"))
    os.symlink(wrong, os.path.join(made, "crt"))
    assert headers.crt_only_include(crt) == made
    assert os.readlink(os.path.join(made, "crt")) == crt


def test_no_crt_turns_the_tensor_cores_off_once_with_the_fix(fresh_headers):
    nvrtc = FakeNvrtc()
    with pytest.warns(RuntimeWarning, match="pip install nvidia-cuda-crt"):
        assert headers.tensor_core_options(nvrtc) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # cached: no second warning
        assert headers.tensor_core_options(nvrtc) is None
    assert nvrtc.tried == [()]


def test_mpishard_info_says_whether_the_tensor_cores_run(fresh_headers):
    assert headers.describe(FakeNvrtc(own_crt=True)) == "on"
    headers.tensor_core_options.cache_clear()
    crt = _crt(fresh_headers)
    assert headers.describe(FakeNvrtc()) == f"on (crt/ from {os.path.realpath(crt)})"
    for cached in (headers.tensor_core_options, headers.crt_directory):
        cached.cache_clear()
    (crt / "mma.h").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # the line, not a warning
        line = headers.describe(FakeNvrtc())
    assert line.startswith("off") and "pip install nvidia-cuda-crt" in line


def test_raw_function_compiles_with_the_options_given(monkeypatch):
    made = []

    class FakeModule:
        def __init__(self, code, options=()):
            made.append((code, options))

        def get_function(self, name):
            return name

    class FakeXp:
        RawModule = FakeModule

    monkeypatch.setattr(launch, "_compiled", {})
    assert launch.raw_function(FakeXp, "k_tc", lambda: "tc", ("-I/x",)) == "k_tc"
    assert launch.raw_function(FakeXp, "k", lambda: "plain") == "k"
    assert made == [("tc", ("-I/x",)), ("plain", ())]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_without_the_headers_16_bit_rows_run_the_thread_a_row_kernels(monkeypatch, dtype):
    import ml_dtypes
    use_host_kernels(monkeypatch)
    monkeypatch.setattr(gpu_attention, "tensor_core_options", lambda xp: None)
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
