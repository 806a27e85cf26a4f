"""scripts/compile_kernels.py's ptxas report: registers, stack and spills per kernel, and
the exit status that fails on a spilling fused-attention kernel.

The parser reads the lines ptxas ``-v`` prints (as nvcc and NVRTC pass them on); one
test compiles a small kernel with nvcc for sm_90 where the CUDA toolkit is installed,
so the format the parser expects is the one this toolkit prints.
"""
import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compile_kernels",
                                              ROOT / "scripts" / "compile_kernels.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)

# as CUDA 13's ptxas prints it for two kernels of one module
LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'mpishard_flash_dq_half_64' for 'sm_90'
ptxas info    : Function properties for mpishard_flash_dq_half_64
    80 bytes stack frame, 76 bytes spill stores, 72 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 80 bytes cumulative stack size, 16384 bytes smem
ptxas info    : Compile time = 79.508 ms
ptxas info    : Compiling entry function 'mpishard_flash_forward_half_64' for 'sm_90'
ptxas info    : Function properties for mpishard_flash_forward_half_64
    128 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 128 bytes cumulative stack size, 16384 bytes smem
ptxas info    : Compiling entry function 'mpishard_flash_dkv_float_64' for 'sm_90'
ptxas info    : Function properties for mpishard_flash_dkv_float_64
    424 bytes stack frame, 424 bytes spill stores, 424 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 424 bytes cumulative stack size, 16640 bytes smem
ptxas info    : Compiling entry function 'mpishard_gelu_forward' for 'sm_90'
ptxas info    : Function properties for mpishard_gelu_forward
    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 15 registers, used 0 barriers, 384 bytes cmem[0]
"""


def test_report_reads_every_kernel_and_figure():
    report = script.ptxas_report(LOG)
    assert report == {
        "mpishard_flash_dq_half_64": dict(registers=255, stack=80, spill_stores=76,
                                          spill_loads=72, smem=16384),
        "mpishard_flash_forward_half_64": dict(registers=168, stack=128, spill_stores=0,
                                               spill_loads=0, smem=16384),
        "mpishard_flash_dkv_float_64": dict(registers=255, stack=424, spill_stores=424,
                                            spill_loads=424, smem=16640),
        "mpishard_gelu_forward": dict(registers=15, stack=0, spill_stores=8, spill_loads=8,
                                      smem=0),
    }


def test_only_spilling_attention_kernels_fail():
    """A spill in tensor-core (16-bit) attention fails the script; one in the float32
    kernels or elsewhere is reported only."""
    assert script.spilling_attention_kernels(script.ptxas_report(LOG)) == \
        ["mpishard_flash_dq_half_64"]
    assert script.spilling_attention_kernels({}) == []


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit (nvcc)")
def test_nvcc_report_of_a_real_kernel():
    source = ('extern "C" __global__ void mpishard_flash_probe_half_64(float* x) {\n'
              '  __shared__ float tile[64]; tile[threadIdx.x] = x[threadIdx.x];\n'
              '  __syncthreads(); x[threadIdx.x] = tile[63 - threadIdx.x];\n}\n')
    ok, log = script.Nvcc(shutil.which("nvcc")).compile(source, [])
    assert ok, log
    report = script.ptxas_report(log)
    probe = report["mpishard_flash_probe_half_64"]
    assert probe["smem"] == 256 and 0 < probe["registers"] < 32
    assert probe["spill_stores"] == 0 and script.spilling_attention_kernels(report) == []
