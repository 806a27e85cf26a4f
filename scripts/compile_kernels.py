"""Compile mpishard's CUDA kernel bodies with NVRTC, without a GPU.

    pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12     # no GPU needed for this
    python scripts/compile_kernels.py

The CuPy kernel set (mpishard/kernels/cuda/) is CUDA source that CuPy compiles on
first use, on a GPU: every ``*_src.py`` there. This checks on
any machine what can be checked without one: that CuPy parses every kernel's
parameter lists (``ElementwiseKernel`` and ``ReductionKernel`` construction), and
that NVRTC compiles for ``compute_90`` every elementwise and reduction body, with
``T`` = float and double, each inside a small wrapper that declares the parameters
as CuPy's generated code does (inputs as const values, outputs as references,
``float64`` parameters as double scalars, ``float32`` ones as float arrays; a
reduction's map, reduce and post-map expressions over a ``_type_reduce a, b``), the
elementwise bodies that also take float16 data (``ops_src.FLOAT16_SOURCES``) with
``T`` = CuPy's ``float16`` too, and every RawKernel module (``cupy.RawModule``) as
the launchers build it: the row kernels, the norms' (also on float16 rows), the
multi-tensor kernels and the fused attention's (head sizes 64, 128 and 24). It does
not run them: the GPU check compares each kernel with NumPy's reference
(tests/kernels/test_kernels.py).

The float16 bodies need CUDA's ``cuda_fp16.h``, from ``$CUDA_PATH/include`` or
the ``nvidia-cuda-runtime-cu12`` wheel; without it they are skipped, and said so.
Exit status 0 when all compile, 1 otherwise (with NVRTC's log).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpishard.kernels.cuda import attention_src, multi_src, norms_src, ops_src  # noqa: E402

#: the sources with elementwise kernels (``SOURCES``), and with reductions (``REDUCTIONS``)
ELEMENTWISE_MODULES = (ops_src, norms_src, multi_src)
REDUCTION_MODULES = (norms_src, multi_src)


#: a parameter's CuPy type -> its C type in the wrappers (float64: a scalar, the others
#: arrays, as the kernels pass them)
_C_TYPES = {"T": "T", "float32": "float", "float64": "double"}


def _params(spec: str) -> list:
    out = []
    for item in spec.split(","):
        kind, name = item.split()
        out.append((_C_TYPES[kind], name))
    return out


def _arguments(inputs: list, outputs: list) -> str:
    args = [f"double {n}" if t == "double" else f"const {t}* _{n}" for t, n in inputs]
    return ", ".join(args + [f"T* _{n}" for _, n in outputs] + ["int n"])


def _typedef(T: str) -> str:
    """``T`` for the wrappers; CuPy's float16 is a class in its own header."""
    return "#include <cupy/float16.cuh>\ntypedef float16 T;" if T == "float16" else \
        f"typedef {T} T;"


def elementwise_source(name: str, inputs: str, outputs: str, body: str, T: str) -> str:
    ins, outs = _params(inputs), _params(outputs)
    loads = [f"const {t} {n} = _{n}[i];" for t, n in ins if t != "double"]
    loads += [f"T& {n} = _{n}[i];" for _, n in outs]
    return (f"{_typedef(T)}\nextern \"C\" __global__ void {name}({_arguments(ins, outs)}) {{\n"
            f"  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;\n"
            f"  {' '.join(loads)}\n  {body}\n}}\n")


def reduction_source(name: str, inputs: str, outputs: str, mapped: str, reduce: str,
                     post: str, T: str) -> str:
    ins, outs = _params(inputs), _params(outputs)
    loads = [f"const {t} {n} = _{n}[i];" for t, n in ins if t != "double"]
    out = outs[0][1]
    return (f"typedef {T} T; typedef T _type_reduce;\n"
            f"extern \"C\" __global__ void {name}({_arguments(ins, outs)}) {{\n"
            f"  int i = threadIdx.x; {' '.join(loads)}\n"
            f"  _type_reduce a = ({mapped}); _type_reduce b = a; a = ({reduce});\n"
            f"  T& {out} = _{out}[0]; {post};\n}}\n")


def half_include_dirs(cupy) -> list:
    """``-I`` options for the float16 wrappers (CuPy's headers and CUDA's
    ``cuda_fp16.h``), or [] when CUDA's headers are not found."""
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
    return []


def sources_to_compile(half: list) -> list:
    """``(name, type, CUDA source, include options)`` of everything there is to compile;
    ``half`` the include options of the float16 sources (``[]``: they are left out)."""
    sources = []
    for module in ELEMENTWISE_MODULES:
        sources += [(name, T, elementwise_source(name, *spec, T), [])
                    for name, spec in module.SOURCES.items() for T in ("float", "double")]
    if half:
        sources += [(name, "float16", elementwise_source(name, *ops_src.SOURCES[name],
                                                         "float16"), half)
                    for name in ops_src.FLOAT16_SOURCES]
    for module in REDUCTION_MODULES:
        sources += [(name, T, reduction_source(name, *spec, T), [])
                    for name, spec in module.REDUCTIONS.items() for T in ("float", "double")]
    rows = raw_kernel_names(ops_src.ROW_KERNELS)
    norms = raw_kernel_names(norms_src.NORM_KERNELS)
    sources += [(f"RawKernels {rows}", T, ops_src.row_kernel_source(T), [])  # as ops.py
                for T in ("float", "double")]                                 # builds them
    sources += [(f"RawKernels {norms}", T, norms_src.norm_kernel_source(T), [])  # norms.py
                for T in ("float", "double")]
    if half:                                    # the norms' float16 rows, computed in float
        sources.append((f"RawKernels {norms}", "float, float16 rows",
                        norms_src.norm_kernel_source("float", "__half"), half))
    sources += [("multi-tensor Adam and sums of squares", T, multi_src.multi_source(T), [])
                for T in ("float", "double")]
    # fused attention (MPISHARD_ATTENTION=fused), one module per head size, as
    # attention.py builds them
    for hs in (64, 128, 24):
        sources += [(f"flash attention hs={hs}", S, attention_src.flash_source(T, S, hs), [])
                    for T, S in (("float", "float"), ("double", "double"))]
        if half:
            sources.append((f"flash attention hs={hs}", "float16 rows",
                            attention_src.flash_source("float", "__half", hs), half))
    return sources


def raw_kernel_names(module_source: str) -> str:
    """The RawKernels a module's source defines, comma-separated."""
    name = r'__global__ void (?:__launch_bounds__\(\d+\)[^\n]*\n)?(\w+)_\{[NT]\}'
    return ", ".join(re.findall(name, module_source))


def main() -> int:
    try:
        import cupy
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as err:
        print(f"compile_kernels: needs CuPy and NVRTC ({err}); pip install cupy-cuda12x "
              f"nvidia-cuda-nvrtc-cu12", file=sys.stderr)
        return 1
    for module in ELEMENTWISE_MODULES:           # CuPy parses the parameters
        for name, (inputs, outputs, body) in module.SOURCES.items():
            cupy.ElementwiseKernel(inputs, outputs, body, name)
    for module in REDUCTION_MODULES:
        for name, (inputs, outputs, mapped, reduce, post) in module.REDUCTIONS.items():
            cupy.ReductionKernel(inputs, outputs, mapped, reduce, post, "0", name)
    half = half_include_dirs(cupy)
    if not half:
        print("skipped the float16 sources (the elementwise kernels, the norms' RawKernels "
              "on float16 rows, fused attention's): no cuda_fp16.h; pip install "
              "nvidia-cuda-runtime-cu12 or set CUDA_PATH")
    sources = sources_to_compile(half)
    failures = 0
    for name, T, source, includes in sources:
        program = nvrtc.createProgram(source, f"{name.split()[0]}.cu", [], [])
        try:
            nvrtc.compileProgram(program, ["-arch=compute_90", "--std=c++17", *includes])
            print(f"compiled {name} ({T})")
        except Exception as err:                # NVRTC's error, with its log below
            failures += 1
            print(f"FAILED {name} ({T}): {err}\n{nvrtc.getProgramLog(program)}\n{source}")
        finally:
            nvrtc.destroyProgram(program)
    print(f"compile_kernels: {len(sources) - failures} of {len(sources)} compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
