"""Compile mpishard's CUDA kernels without a GPU, and report what ptxas makes of them.

    pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12     # NVRTC; no GPU needed for this
    python scripts/compile_kernels.py                   # or with the CUDA toolkit's nvcc

The CuPy kernel set (mpishard/kernels/cuda/) is CUDA source that CuPy compiles on
first use, on a GPU: every ``*_src.py`` there. This checks on any machine what can
be checked without one: that CuPy parses every kernel's parameter lists
(``ElementwiseKernel`` and ``ReductionKernel`` construction; with CuPy only), and
that every elementwise and reduction body compiles for sm_90, with ``T`` = float
and double, each inside a small wrapper that declares the parameters as CuPy's
generated code does (inputs as const values, outputs as references, ``float64``
parameters as double scalars, ``float32`` ones as float arrays, ``uint16`` ones as
16-bit words; a reduction's map, reduce and post-map expressions over a
``_type_reduce a, b``), the elementwise bodies that also take float16 data
(``ops_src.FLOAT16_SOURCES``) with ``T`` = CuPy's ``float16`` too (with CuPy only),
their bfloat16 twins on 16-bit words, and every RawKernel module
(``cupy.RawModule``) as the launchers build it: the row kernels, the norms' (also
on float16 and bfloat16 rows), the multi-tensor kernels, the fused attention's
(head sizes 64, 128 and 24; float, double, float16 and bfloat16 rows), the fused
cross-entropy's and the rotary embeddings'. It does not run them: the GPU check
compares each kernel with NumPy's reference (tests/kernels/test_kernels.py).

The compiler is NVRTC when CuPy is installed, else ``nvcc`` (``$CUDA_PATH/bin`` or
the PATH). Both build a cubin for sm_90 with ptxas ``-v`` (an NVRTC too old for
``--ptxas-options`` builds PTX for compute_90 instead, with no report), and the
script prints ptxas's registers, stack frame, spill stores and loads and shared
memory per kernel. The 16-bit RawKernels need CUDA's ``cuda_fp16.h`` and
``cuda_bf16.h`` (``$CUDA_PATH/include``, the ``nvidia-cuda-runtime-cu12`` wheel, or
nvcc's own); without them they are skipped, and said so. Exit status 0 when all
compile and no tensor-core attention kernel spills registers to local memory, 1
otherwise (with the compiler's log, or the spilling kernels named); the spill rule
holds the tensor-core attention kernels (float16 and bfloat16 rows), while the
float32 and float64 ones are reported only.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpishard.kernels.cuda import (attention_src, attention_tc_src, loss_src,  # noqa: E402
                                   multi_src, norms_src, ops_src, rotary_src)

#: the sources with elementwise kernels (``SOURCES``), and with reductions (``REDUCTIONS``)
ELEMENTWISE_MODULES = (ops_src, norms_src, multi_src)
#: the 16-bit row types the RawKernels take (float16 and bfloat16, computed in float)
HALF_ROWS = tuple(c for c, _, _ in ops_src.ROWS16.values())
REDUCTION_MODULES = (norms_src, multi_src)


#: a parameter's CuPy type -> its C type in the wrappers (float64: a scalar, the others
#: arrays, as the kernels pass them)
_C_TYPES = {"T": "T", "float32": "float", "float64": "double", "uint16": "unsigned short"}


def _params(spec: str) -> list:
    out = []
    for item in spec.split(","):
        kind, name = item.split()
        out.append((_C_TYPES[kind], name))
    return out


def _arguments(inputs: list, outputs: list) -> str:
    args = [f"double {n}" if t == "double" else f"const {t}* _{n}" for t, n in inputs]
    return ", ".join(args + [f"{t}* _{n}" for t, n in outputs] + ["int n"])


def _typedef(T: str) -> str:
    """``T`` for the wrappers; CuPy's float16 is a class in its own header."""
    return "#include <cupy/float16.cuh>\ntypedef float16 T;" if T == "float16" else \
        f"typedef {T} T;"


def elementwise_source(name: str, inputs: str, outputs: str, body: str, T: str,
                       preamble: str = "") -> str:
    ins, outs = _params(inputs), _params(outputs)
    loads = [f"const {t} {n} = _{n}[i];" for t, n in ins if t != "double"]
    loads += [f"{t}& {n} = _{n}[i];" for t, n in outs]
    return (f"{_typedef(T)}\n{preamble}extern \"C\" __global__ void "
            f"{name}({_arguments(ins, outs)}) {{\n"
            f"  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;\n"
            f"  {' '.join(loads)}\n  {body}\n}}\n")


def reduction_source(name: str, inputs: str, outputs: str, mapped: str, reduce: str,
                     post: str, T: str) -> str:
    ins, outs = _params(inputs), _params(outputs)
    loads = [f"const {t} {n} = _{n}[i];" for t, n in ins if t != "double"]
    out_type, out = outs[0]          # CuPy reduces in the output's type by default
    return (f"typedef {T} T; typedef {out_type} _type_reduce;\n"
            f"extern \"C\" __global__ void {name}({_arguments(ins, outs)}) {{\n"
            f"  int i = threadIdx.x; {' '.join(loads)}\n"
            f"  _type_reduce a = ({mapped}); _type_reduce b = a; a = ({reduce});\n"
            f"  {out_type}& {out} = _{out}[0]; {post};\n}}\n")


def half_include_dirs(cupy) -> list | None:
    """``-I`` options for the float16 wrappers (CuPy's headers and CUDA's
    ``cuda_fp16.h``), or None when CUDA's headers are not found."""
    candidates = [Path(os.environ["CUDA_PATH"]) / "include"] if os.environ.get("CUDA_PATH") else []
    try:
        import nvidia.cuda_runtime as runtime      # the nvidia-cuda-runtime-cu12 wheel
        candidates += [Path(d) / "include" for d in runtime.__path__]
    except ImportError:
        pass
    candidates.append(Path("/usr/local/cuda/include"))
    for cuda in candidates:
        if (cuda / "cuda_fp16.h").is_file():
            return [f"-I{Path(cupy.__file__).parent / '_core' / 'include'}", f"-I{cuda}"]
    return None


def sources_to_compile(half: list | None, elementwise_half: list | None = None) -> list:
    """``(name, type, CUDA source, include options)`` of everything there is to compile;
    ``half`` the include options of the 16-bit RawKernels, ``elementwise_half`` those of
    the float16 ElementwiseKernels (CuPy's float16 type); ``None`` leaves them out."""
    sources = []
    for module in ELEMENTWISE_MODULES:
        sources += [(name, T, elementwise_source(name, *spec, T), [])
                    for name, spec in module.SOURCES.items() for T in ("float", "double")]
    if elementwise_half is not None:
        sources += [(name, "float16", elementwise_source(name, *ops_src.SOURCES[name],
                                                         "float16"), elementwise_half)
                    for name in ops_src.FLOAT16_SOURCES]
    sources += [(name, "bfloat16 words", elementwise_source(name, *spec, "float",
                                                            ops_src.BF16_WORDS), [])
                for name, spec in ops_src.BFLOAT16_SOURCES.items()]
    for module in REDUCTION_MODULES:
        sources += [(name, T, reduction_source(name, *spec, T), [])
                    for name, spec in module.REDUCTIONS.items() for T in ("float", "double")]
    rows = raw_kernel_names(ops_src.ROW_KERNELS)
    norms = raw_kernel_names(norms_src.NORM_KERNELS)
    sources += [(f"RawKernels {rows}", T, ops_src.row_kernel_source(T), [])  # as ops.py
                for T in ("float", "double")]                                 # builds them
    sources += [(f"RawKernels {norms}", T, norms_src.norm_kernel_source(T), [])  # norms.py
                for T in ("float", "double")]
    if half is not None:                        # the norms' 16-bit rows, computed in float
        sources += [(f"RawKernels {norms}", f"float, {S} rows",
                     norms_src.norm_kernel_source("float", S), half) for S in HALF_ROWS]
    sources += [("multi-tensor Adam and sums of squares", T, multi_src.multi_source(T), [])
                for T in ("float", "double")]
    # fused attention (MPISHARD_ATTENTION=fused), one module per head size, as
    # attention.py builds them (16-bit rows at 64 and 128 on tensor cores,
    # attention_tc_src.tensor_cores)
    for hs in (64, 128, 24):
        sources += [(f"flash attention hs={hs}", S, attention_src.flash_source(T, S, hs), [])
                    for T, S in (("float", "float"), ("double", "double"))]
        if half is not None:
            sources += [(f"flash attention hs={hs}", f"{S} rows",
                         attention_src.flash_source("float", S, hs), half) for S in HALF_ROWS]
    for name, source, what in (("fused cross-entropy", loss_src.loss_kernel_source, "logits"),
                               ("rotary embeddings", rotary_src.rotary_kernel_source, "rows")):
        sources += [(name, S, source(T, S), [])          # as loss.py and rotary.py build them
                    for T, S in (("float", "float"), ("double", "double"))]
        if half is not None:
            sources += [(name, f"{S} {what}", source("float", S), half) for S in HALF_ROWS]
    return sources


def raw_kernel_names(module_source: str) -> str:
    """The RawKernels a module's source defines, comma-separated."""
    name = r'__global__ void (?:__launch_bounds__\(\d+\)[^\n]*\n)?(\w+)_\{[NT]\}'
    return ", ".join(re.findall(name, module_source))


#: a ptxas ``-v`` line naming the kernel the next lines describe, and the lines describing it
_PTXAS_KERNEL = re.compile(r"(?:Compiling entry function '|Function properties for )(\w+)")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers.*?(?:(\d+) bytes smem|$)")


def ptxas_report(log: str) -> dict:
    """Per kernel, what ptxas ``-v`` said of it: ``{name: {"registers", "stack",
    "spill_stores", "spill_loads", "smem"}}`` (bytes; absent figures 0)."""
    report, kernel = {}, None
    for line in log.splitlines():
        if (m := _PTXAS_KERNEL.search(line)):
            kernel = m.group(1)
            report.setdefault(kernel, dict(registers=0, stack=0, spill_stores=0,
                                           spill_loads=0, smem=0))
        elif kernel and (m := _PTXAS_FRAME.search(line)):
            report[kernel].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                  spill_loads=int(m.group(3)))
        elif kernel and (m := _PTXAS_USED.search(line)):
            report[kernel].update(registers=int(m.group(1)), smem=int(m.group(2) or 0))
    return report


#: the tensor-core attention kernels (16-bit rows: the mixed-precision training path)
_TENSOR_CORE_ATTENTION = re.compile(r"mpishard_flash_\w+_(half|bfloat16)_\d+$")


def spilling_attention_kernels(report: dict) -> list:
    """The tensor-core fused-attention kernels (``mpishard_flash_*`` on float16 or
    bfloat16 rows) that ptxas says spill: each spill is a trip to local memory inside
    the inner loop, so none is allowed. (The float32 and float64 kernels, one thread per
    query row, are reported, not held to it.)"""
    return sorted(name for name, r in report.items() if _TENSOR_CORE_ATTENTION.match(name)
                  and (r["spill_stores"] or r["spill_loads"]))


class Nvcc:
    """``nvcc -cubin`` for sm_90 with ptxas ``-v`` (the CUDA toolkit, no GPU needed)."""

    name = "nvcc (sm_90)"

    def __init__(self, path: str):
        self.path = path

    def has_16bit_headers(self) -> bool:
        """Whether nvcc finds ``cuda_fp16.h`` and ``cuda_bf16.h`` itself."""
        return self.compile("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n", [])[0]

    def compile(self, source: str, includes: list) -> tuple:
        import subprocess
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            cu = Path(tmp) / "kernel.cu"
            cu.write_text(source)
            out = subprocess.run([self.path, "-arch=sm_90", "-cubin", "-std=c++17",
                                  "--ptxas-options=-v", *includes, "-o", str(cu) + ".cubin",
                                  str(cu)], capture_output=True, text=True)
        return out.returncode == 0, out.stdout + out.stderr


class Nvrtc:
    """NVRTC through CuPy: a cubin for sm_90 with ptxas ``-v`` where this NVRTC takes
    ``--ptxas-options``, else PTX for compute_90 (compiled, no per-kernel report)."""

    name = "NVRTC"

    def __init__(self, nvrtc):
        self.nvrtc, self.options = nvrtc, ["-arch=sm_90", "--ptxas-options=-v"]

    def compile(self, source: str, includes: list) -> tuple:
        program = self.nvrtc.createProgram(source, "kernel.cu", [], [])
        try:
            self.nvrtc.compileProgram(program, [*self.options, "--std=c++17", *includes])
            return True, self.nvrtc.getProgramLog(program)
        except Exception as err:                # NVRTC's error, with its log
            log = f"{err}\n{self.nvrtc.getProgramLog(program)}"
            if self.options[0] == "-arch=sm_90" and "option" in log.lower():
                self.options = ["-arch=compute_90"]          # an NVRTC without ptxas options
                return self.compile(source, includes)
            return False, log
        finally:
            self.nvrtc.destroyProgram(program)


def pick_compiler(cupy):
    """NVRTC when CuPy is installed, else nvcc from ``$CUDA_PATH/bin`` or the PATH, else
    None."""
    if cupy is not None:
        from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415
        return Nvrtc(nvrtc)
    import shutil
    cuda = os.environ.get("CUDA_PATH")
    path = shutil.which("nvcc", path=str(Path(cuda) / "bin") if cuda else None) or \
        shutil.which("nvcc")
    return Nvcc(path) if path else None


def main() -> int:
    try:
        import cupy
    except ImportError:
        cupy = None
    compiler = pick_compiler(cupy)
    if compiler is None:
        print("compile_kernels: needs NVRTC (pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12) "
              "or the CUDA toolkit's nvcc", file=sys.stderr)
        return 1
    if cupy is not None:
        for module in ELEMENTWISE_MODULES:           # CuPy parses the parameters
            for name, (inputs, outputs, body) in module.SOURCES.items():
                cupy.ElementwiseKernel(inputs, outputs, body, name)
        for module in REDUCTION_MODULES:
            for name, (inputs, outputs, mapped, reduce, post) in module.REDUCTIONS.items():
                cupy.ReductionKernel(inputs, outputs, mapped, reduce, post, "0", name)
        half = half_include_dirs(cupy)
        elementwise_half = half
    else:                                       # nvcc has CUDA's headers, not CuPy's
        half = [] if compiler.has_16bit_headers() else None
        elementwise_half = None
        print("without CuPy: its parameter parsing and the float16 ElementwiseKernels "
              "(CuPy's float16 type) are left out")
    if half is None:
        print("skipped the float16 sources (the elementwise kernels, the norms' RawKernels "
              "on float16 rows, fused attention's): no cuda_fp16.h; pip install "
              "nvidia-cuda-runtime-cu12 or set CUDA_PATH")
    sources = sources_to_compile(half, elementwise_half)
    failures, report = 0, {}
    for name, T, source, includes in sources:
        ok, log = compiler.compile(source, includes)
        if ok:
            print(f"compiled {name} ({T})")
            report.update({(kernel, T): r for kernel, r in ptxas_report(log).items()})
        else:
            failures += 1
            print(f"FAILED {name} ({T}):\n{log}\n{source}")
    if report:
        print(f"\n{'kernel':44} {'variant':22} {'regs':>5} {'stack':>6} {'spill st':>8} "
              f"{'spill ld':>8} {'smem':>6}")
        for (kernel, T), r in sorted(report.items()):
            print(f"{kernel:44} {T:22} {r['registers']:5d} {r['stack']:6d} "
                  f"{r['spill_stores']:8d} {r['spill_loads']:8d} {r['smem']:6d}")
    spilling = sorted({kernel for kernel, _ in report} &
                      set(spilling_attention_kernels({k: r for (k, _), r in report.items()})))
    print(f"compile_kernels: {len(sources) - failures} of {len(sources)} compiled with "
          f"{compiler.name}" + (f"; ptxas reports {len(report)} kernels" if report else
                                "; no ptxas report from this compiler"))
    if spilling:
        print(f"compile_kernels: tensor-core attention kernels spill to local memory: "
              f"{', '.join(spilling)}")
    return 1 if failures or spilling else 0


if __name__ == "__main__":
    raise SystemExit(main())
