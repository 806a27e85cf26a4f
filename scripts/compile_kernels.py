"""Compile mpishard's CUDA kernel bodies with NVRTC, without a GPU.

    pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12     # no GPU needed for this
    python scripts/compile_kernels.py

The CuPy kernel set (mpishard/kernels/gpu.py) is CUDA source that CuPy compiles
on first use, on a GPU. This checks on any machine what can be checked without
one: that CuPy parses every kernel's parameter lists (``ElementwiseKernel`` and
``ReductionKernel`` construction), and that NVRTC compiles every body for
``compute_90`` with ``T`` = float and double, each inside a small wrapper that
declares the parameters as CuPy's generated code does (inputs as const values,
outputs as references, scalars as doubles; a reduction's map, reduce and
post-map expressions over a ``_type_reduce a, b``), and the row kernels'
source (``cupy.RawModule``) as it is. It does not run them: the
GPU check compares each kernel with NumPy's reference (tests/test_kernels.py).
Exit status 0 when all compile, 1 otherwise (with NVRTC's log).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _params(spec: str) -> list:
    out = []
    for item in spec.split(","):
        kind, name = item.split()
        out.append(("double" if kind == "float64" else "T", name))
    return out


def _arguments(inputs: list, outputs: list) -> str:
    args = [f"const T* _{n}" if t == "T" else f"double {n}" for t, n in inputs]
    return ", ".join(args + [f"T* _{n}" for _, n in outputs] + ["int n"])


def elementwise_source(name: str, inputs: str, outputs: str, body: str, T: str) -> str:
    ins, outs = _params(inputs), _params(outputs)
    loads = [f"const T {n} = _{n}[i];" for t, n in ins if t == "T"]
    loads += [f"T& {n} = _{n}[i];" for _, n in outs]
    return (f"typedef {T} T;\nextern \"C\" __global__ void {name}({_arguments(ins, outs)}) {{\n"
            f"  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;\n"
            f"  {' '.join(loads)}\n  {body}\n}}\n")


def reduction_source(name: str, inputs: str, outputs: str, mapped: str, reduce: str,
                     post: str, T: str) -> str:
    ins, outs = _params(inputs), _params(outputs)
    loads = [f"const T {n} = _{n}[i];" for t, n in ins if t == "T"]
    out = outs[0][1]
    return (f"typedef {T} T; typedef T _type_reduce;\n"
            f"extern \"C\" __global__ void {name}({_arguments(ins, outs)}) {{\n"
            f"  int i = threadIdx.x; {' '.join(loads)}\n"
            f"  _type_reduce a = ({mapped}); _type_reduce b = a; a = ({reduce});\n"
            f"  T& {out} = _{out}[0]; {post};\n}}\n")


def main() -> int:
    try:
        import cupy
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as err:
        print(f"compile_kernels: needs CuPy and NVRTC ({err}); pip install cupy-cuda12x "
              f"nvidia-cuda-nvrtc-cu12", file=sys.stderr)
        return 1
    from mpishard.kernels import gpu

    failures = 0
    for name, (inputs, outputs, body) in gpu.SOURCES.items():
        cupy.ElementwiseKernel(inputs, outputs, body, name)      # parses the parameters
    for name, (inputs, outputs, mapped, reduce, post) in gpu.REDUCTIONS.items():
        cupy.ReductionKernel(inputs, outputs, mapped, reduce, post, "0", name)
    sources = [(name, T, elementwise_source(name, *spec, T))
               for name, spec in gpu.SOURCES.items() for T in ("float", "double")]
    sources += [(name, T, reduction_source(name, *spec, T))
                for name, spec in gpu.REDUCTIONS.items() for T in ("float", "double")]
    sources += [("row kernels", T, gpu.ROW_KERNELS.replace("{T}", T))   # RawKernels as they are
                for T in ("float", "double")]
    for name, T, source in sources:
        program = nvrtc.createProgram(source, f"{name}.cu", [], [])
        try:
            nvrtc.compileProgram(program, ["-arch=compute_90", "--std=c++17"])
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
