"""CUDA C kernels run on the host, for tests on machines without a GPU.

    from cuda_host import HostModule, host_compiler, host_elementwise
    kernel = HostModule(code).get_function("my_kernel")   # as cupy.RawModule's
    kernel((blocks,), (threads,), (array, np.int32(n), np.float32(x)))
    add = host_elementwise("add", "float32 x, float32 y", "float32 z", "z = x + y;")
    z = add(x, y)                                          # as a cupy.ElementwiseKernel

A CuPy ``RawKernel`` written for a GPU has indices, block reductions, warp
shuffles and barriers that no CPU test exercises: on the CuPy-strict module the
kernel set runs its reference math instead. Here ``g++`` compiles the same CUDA
source as C++20 against a small shim (:data:`SHIM`) and runs it:

* each CUDA thread of a block is a fiber (``ucontext``, its own stack) of the one
  host thread that calls the launch; in turn, each fiber runs until it waits at a
  barrier or ends (thousands of host threads meeting at barriers cost a 2-core
  machine seconds a launch in context switches). The fibers walk the grid's blocks
  one at a time together, meeting at a barrier between blocks, so ``__shared__``
  variables (static storage) belong to the one block running;
* ``__syncthreads()`` is a barrier of the block's fibers, ``__shfl_*_sync`` an
  exchange through a per-warp slot between two barriers of the warp's 32 lanes
  (lanes numbered as on a GPU: x fastest, 32 to a warp); ``atomicAdd`` is a plain
  add (no fiber is switched out inside one) and ``__threadfence`` nothing (blocks run
  one at a time); the blocks run in grid order, or shuffled (:data:`BLOCK_ORDER`);
* ``__half`` is the compiler's IEEE binary16 ``_Float16`` (``numpy.float16``'s
  format), converted with round-to-nearest-even like ``__float2half_rn``;
  ``__nv_bfloat16`` is a 16-bit word, the top half of a float32 (``ml_dtypes.bfloat16``'s
  format): read as a float by putting the word back on top, written with
  round-to-nearest-even like ``__float2bfloat16_rn`` (:data:`BF16_HEADER`);
* arguments are checked as CuPy would pass them, and more strictly: a NumPy
  scalar's dtype must be the parameter's (a Python ``int`` is an int64, a
  ``float`` a float64, as in CuPy), because a mismatch on a GPU reads garbage
  rather than failing; an array of another dtype than its pointer's element type
  (the kernels' stand-in for an absent optional array, behind a flag 0) is passed
  as a NULL pointer, so a kernel that reads it anyway crashes the test instead of
  reading garbage (``HostKernel.null_pointers`` names them).

A warp shuffle in a warp of fewer than 32 threads (undefined on a GPU) fails the
launch, and so do threads waiting at a barrier that the others never reach (a hang
on a GPU). What it proves: the kernel's arithmetic, indexing, shared memory and
barriers give the reference results for the launch shapes the caller uses. What
it does not: speed, register and shared-memory limits, the device's own rounding
(``exp``, ``tanh``, and multiply-adds NVRTC contracts into FMAs, which this build
does not), memory races that a barrier-exact schedule hides, reads of shared
memory before any write (here zeros, or the last block's values; on a GPU
garbage), or anything of the GPU's memory model. Compiled libraries are cached by the hash of
their source under the system temporary directory.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
from cuda_wmma import WMMA_HEADER

__all__ = ["HostModule", "HostKernel", "host_compiler", "host_elementwise", "SHIM",
           "BF16_HEADER"]

SHIM = r"""
#include <algorithm>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <ucontext.h>
#include <vector>

struct dim3 { unsigned int x = 1, y = 1, z = 1; };
namespace emu {
/* A barrier of fibers: the last to arrive opens it, the others yield until it has. */
struct Barrier { unsigned expected = 0, arrived = 0; unsigned long generation = 0; };
struct Fiber { ucontext_t context; dim3 thread_idx, block_idx; int lane = 0, warp = 0;
               bool done = false; };
inline dim3 grid_dim, block_dim;
/* the running fiber's indices (the scheduler sets them before it resumes one) */
inline dim3 thread_idx, block_idx;
inline int lane = 0, warp = 0;
inline Barrier block_barrier;
inline std::vector<Barrier> warp_barriers;
inline std::vector<unsigned> warp_lanes;
inline bool partial_shuffle = false;
inline unsigned char warp_slots[32][32][8];
inline std::vector<Fiber> fibers;
inline std::vector<std::unique_ptr<char[]>> stacks;
inline ucontext_t scheduler;
inline unsigned current = 0;
inline unsigned long progress = 0;      /* arrivals, openings and ends: what a round must see */
inline std::function<void()>* body = nullptr;
/* the order the fibers walk the grid's blocks in: grid order (x fastest), or with a
   seed other than 0 a shuffle of it (a GPU runs blocks in no order it promises) */
inline unsigned block_order_seed = 0;
inline std::vector<dim3> block_order;
constexpr size_t STACK_BYTES = 1 << 18;

inline void yield() {
  Fiber& f = fibers[current];
  f.block_idx = block_idx;
  swapcontext(&f.context, &scheduler);
}
inline void arrive_and_wait(Barrier& b) {
  const unsigned long generation = b.generation;
  ++progress;
  if (++b.arrived == b.expected) { b.arrived = 0; ++b.generation; return; }
  while (b.generation == generation) yield();
}
}
#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__
#define warpSize 32

inline void __syncthreads() { emu::arrive_and_wait(emu::block_barrier); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::arrive_and_wait(emu::warp_barriers[emu::warp]); }

template <class V> V emu_exchange(V v, int src, bool keep) {
  if (emu::warp_lanes[emu::warp] < 32) emu::partial_shuffle = true;  /* undefined on a GPU */
  std::memcpy(emu::warp_slots[emu::warp][emu::lane], &v, sizeof(V));
  emu::arrive_and_wait(emu::warp_barriers[emu::warp]);
  V r = v;
  if (!keep) std::memcpy(&r, emu::warp_slots[emu::warp][src], sizeof(V));
  emu::arrive_and_wait(emu::warp_barriers[emu::warp]);
  return r;
}
template <class V> V __shfl_xor_sync(unsigned, V v, int m, int w = 32) {
  return emu_exchange(v, emu::lane ^ m, false);
}
template <class V> V __shfl_down_sync(unsigned, V v, unsigned d, int w = 32) {
  const int start = (emu::lane / w) * w, src = emu::lane + (int)d;
  return emu_exchange(v, src, src >= start + w);
}
template <class V> V __shfl_up_sync(unsigned, V v, unsigned d, int w = 32) {
  const int start = (emu::lane / w) * w, src = emu::lane - (int)d;
  return emu_exchange(v, src, src < start);
}
template <class V> V __shfl_sync(unsigned, V v, int src, int w = 32) {
  return emu_exchange(v, (emu::lane / w) * w + (src % w), false);
}
/* one host thread runs every fiber, and a fiber is never switched out inside a call */
template <class V> V atomicAdd(V* p, V v) { V old = *p; *p = old + v; return old; }
/* one host thread, blocks one after another: every write is seen at once */
inline void __threadfence() {}

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
using std::max;
using std::min;

namespace emu {
inline void run_fiber() {
  for (const dim3& b : block_order) {
    block_idx = b;
    (*body)();
    arrive_and_wait(block_barrier);         /* the block's shared memory is free again */
  }
  fibers[current].done = true;             /* and back to the scheduler (uc_link) */
  ++progress;
}
inline int launch(dim3 grid, dim3 block, std::function<void()> kernel) {
  grid_dim = grid;
  block_dim = block;
  const unsigned n = block.x * block.y * block.z;
  if (n == 0 || n > 1024) return 1;
  body = &kernel;
  block_order.clear();
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) block_order.push_back(dim3{x, y, z});
  if (block_order_seed)
    std::shuffle(block_order.begin(), block_order.end(), std::mt19937(block_order_seed));
  block_barrier = Barrier{n};
  warp_barriers.clear();
  warp_lanes.clear();
  partial_shuffle = false;
  for (unsigned w = 0; w * 32 < n; ++w) {
    warp_barriers.push_back(Barrier{std::min(32u, n - 32 * w)});
    warp_lanes.push_back(std::min(32u, n - 32 * w));
  }
  while (stacks.size() < n) stacks.emplace_back(new char[STACK_BYTES]);
  fibers.assign(n, Fiber{});
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    f.thread_idx.x = i % block.x;
    f.thread_idx.y = (i / block.x) % block.y;
    f.thread_idx.z = i / (block.x * block.y);
    f.lane = i % 32;
    f.warp = i / 32;
    if (getcontext(&f.context) != 0) return 2;
    f.context.uc_stack.ss_sp = stacks[i].get();
    f.context.uc_stack.ss_size = STACK_BYTES;
    f.context.uc_link = &scheduler;
    makecontext(&f.context, run_fiber, 0);
  }
  /* Round robin: each fiber runs until it waits at a barrier or ends. A round in
     which no fiber arrived anywhere or ended is a deadlock (a barrier that some
     thread never reaches: a hang on a GPU). */
  for (unsigned live = n; live;) {
    const unsigned long before = progress;
    live = 0;
    for (unsigned i = 0; i < n; ++i) {
      Fiber& f = fibers[i];
      if (f.done) continue;
      current = i;
      thread_idx = f.thread_idx; block_idx = f.block_idx; lane = f.lane; warp = f.warp;
      swapcontext(&scheduler, &f.context);
      live += !f.done;
    }
    if (live && progress == before) return 4;
  }
  return partial_shuffle ? 3 : 0;
}
}
extern "C" void emu_set_block_order(unsigned seed) { emu::block_order_seed = seed; }
"""

FP16_HEADER = r"""
#pragma once
typedef _Float16 __half;
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half(float f) { return (__half)f; }
inline __half __float2half_rn(float f) { return (__half)f; }
"""

BF16_HEADER = r"""
#pragma once
#include <cstdint>
#include <cstring>
/* bfloat16: the top 16 bits of a float32. Rounded to nearest even as CUDA's
   __float2bfloat16_rn; NaN stays a quiet NaN of the same sign. */
inline unsigned short emu_float2bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(emu_float2bf16_bits(f)) {}
  /* a double would round twice through float here, once on a GPU: the kernels
     convert from float only, and this keeps it so */
  __nv_bfloat16(double) = delete;
  operator float() const {
    const uint32_t u = (uint32_t)__x << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short w) {
  __nv_bfloat16 h;
  h.__x = w;
  return h;
}
"""

_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?'
                     r'(?:/\*.*?\*/\s*)?(\w+)\s*\(([^)]*)\)', re.S)
_TYPEDEF = re.compile(r"typedef\s+([\w ]+?)\s+(\w+)\s*;")
#: a scalar parameter's C type -> (ctypes type, NumPy dtype CuPy passes for it)
_SCALARS = {
    "int": (ctypes.c_int32, np.int32), "unsigned int": (ctypes.c_uint32, np.uint32),
    "unsigned": (ctypes.c_uint32, np.uint32), "long long": (ctypes.c_int64, np.int64),
    "long long int": (ctypes.c_int64, np.int64), "float": (ctypes.c_float, np.float32),
    "double": (ctypes.c_double, np.float64), "bool": (ctypes.c_bool, np.bool_),
    "size_t": (ctypes.c_uint64, np.uint64),
}
#: a pointer's element C type -> the dtype its array must have
_ELEMENTS = {"float": np.float32, "double": np.float64, "__half": np.float16,
             "__nv_bfloat16": ml_dtypes.bfloat16, "unsigned short": np.uint16,
             "int": np.int32, "long long": np.int64, "unsigned char": np.uint8,
             "bool": np.bool_, "unsigned int": np.uint32, "unsigned long long": np.uint64}
_lock = threading.Lock()
#: the order a launch runs its blocks in: 0 grid order (x fastest, then y, then z), any
#: other value a shuffle seeded by it, to show that a kernel's results do not depend on
#: which block runs (or, with atomics, arrives) first
BLOCK_ORDER = 0


def host_compiler() -> str | None:
    """The C++ compiler the emulation uses (``$CXX``, else ``g++``), or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cache_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"mpishard-cuda-host-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _resolve(ctype: str, typedefs: dict) -> str:
    ctype = " ".join(ctype.replace("const", " ").split())
    seen = 0
    while ctype in typedefs and seen < 8:
        ctype, seen = typedefs[ctype], seen + 1
    return ctype


def _parse_params(params: str, typedefs: dict) -> list:
    """``[(name, element C type or None, scalar C type or None)]`` of a kernel's
    parameter list."""
    out = []
    for raw in (p.strip() for p in params.split(",")):
        if not raw:
            continue
        m = re.match(r"(.*?)(\w+)\s*$", raw.replace("__restrict__", ""))
        ctype, name = m.group(1).strip(), m.group(2)
        if "*" in ctype:
            out.append((name, _resolve(ctype.replace("*", " "), typedefs), None))
        else:
            out.append((name, None, _resolve(ctype, typedefs)))
    return out


class HostKernel:
    """One ``extern "C" __global__`` kernel of a :class:`HostModule`, called as a
    ``cupy.RawKernel``: ``kernel(grid, block, args)``."""

    def __init__(self, lib, name: str, params: list):
        self.name, self.params, self._lib = name, params, lib
        #: parameters last passed as NULL (an array of another dtype stood in for them)
        self.null_pointers: list = []
        self._fn = getattr(lib, f"emu_launch_{name}")
        self._fn.restype = ctypes.c_int
        argtypes = [ctypes.c_uint32] * 6
        for _, element, scalar in params:
            argtypes.append(ctypes.c_void_p if element is not None else _SCALARS[scalar][0])
        self._fn.argtypes = argtypes

    def __call__(self, grid, block, args, shared_mem: int = 0):
        if shared_mem:
            raise NotImplementedError("dynamic shared memory is not emulated")
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} "
                            f"parameters")
        values, self.null_pointers = [], []
        for (name, element, scalar), arg in zip(self.params, args):
            if element is not None:
                if not isinstance(arg, np.ndarray):
                    raise TypeError(f"{self.name}: {name} is a pointer, got {type(arg)}")
                want = _ELEMENTS.get(element)
                if want is not None and arg.dtype != want:      # a stand-in for an absent
                    self.null_pointers.append(name)             # array: it must not be read
                    values.append(None)
                    continue
                values.append(arg.ctypes.data)
            else:
                want = np.dtype(_SCALARS[scalar][1])
                got = (np.dtype(np.int64) if isinstance(arg, (int, np.integer)) and
                       not isinstance(arg, np.generic) else
                       np.dtype(np.float64) if isinstance(arg, float) and
                       not isinstance(arg, np.generic) else np.asarray(arg).dtype)
                if got != want:
                    raise TypeError(f"{self.name}: {name} is {scalar}, got {got} (CuPy "
                                    f"would pass its {got.itemsize} bytes)")
                values.append(arg.item() if isinstance(arg, np.generic) else arg)
        with _lock:
            self._lib.emu_set_block_order(ctypes.c_uint32(BLOCK_ORDER))
            rc = self._fn(*[int(v) for v in grid], *[int(v) for v in block], *values)
        if rc == 3:
            raise RuntimeError(f"{self.name}: a warp shuffle in a warp of fewer than 32 "
                               f"threads (block {block}): undefined on a GPU")
        if rc == 4:
            raise RuntimeError(f"{self.name}: threads wait at a barrier that others never "
                               f"reach (block {block}): a hang on a GPU")
        if rc:
            raise RuntimeError(f"{self.name}: launch of grid {grid} x block {block} failed "
                               f"(code {rc}: at most 1,024 threads a block)")


class HostModule:
    """CUDA C ``code`` compiled for the host (see the module docstring), as
    ``cupy.RawModule(code=code)``."""

    def __init__(self, code: str, options: tuple = ()):
        compiler = host_compiler()
        if compiler is None:
            raise RuntimeError("no C++ compiler (g++) to emulate CUDA kernels with; "
                               "install g++ or set CXX")
        typedefs = {alias: target.strip() for target, alias in _TYPEDEF.findall(code)}
        self.kernels = {name: _parse_params(params, typedefs)
                        for name, params in _KERNEL.findall(code)}
        wrappers = []
        for name, params in _KERNEL.findall(code):
            names = ", ".join(p[0] for p in self.kernels[name])
            sep = ", " if params.strip() else ""
            wrappers.append(
                f'extern "C" int emu_launch_{name}(unsigned emu_gx, unsigned emu_gy, '
                f"unsigned emu_gz, unsigned emu_bx, unsigned emu_by, unsigned emu_bz"
                f"{sep}{params}) {{\n"
                f"  return emu::launch(dim3{{emu_gx, emu_gy, emu_gz}}, "
                f"dim3{{emu_bx, emu_by, emu_bz}}, [=]() {{ {name}({names}); }});\n}}\n")
        source = SHIM + "\n" + code + "\n" + "".join(wrappers)
        key = hashlib.sha256((source + FP16_HEADER + BF16_HEADER + WMMA_HEADER + " ".join(options))
                             .encode()).hexdigest()[:24]
        lib_path = _cache_dir() / f"{key}.so"
        if not lib_path.exists():
            work = Path(tempfile.mkdtemp(dir=_cache_dir()))
            (work / "cuda_fp16.h").write_text(FP16_HEADER)
            (work / "cuda_bf16.h").write_text(BF16_HEADER)
            (work / "mma.h").write_text(WMMA_HEADER)            # tests/cuda_wmma.py
            (work / "kernels.cpp").write_text(source)
            tmp_lib = work / "kernels.so"
            cmd = [compiler, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread",
                   "-fno-fast-math", "-ffp-contract=off", "-w", f"-I{work}", *options,
                   str(work / "kernels.cpp"), "-o", str(tmp_lib)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"the host compiler rejected the kernels:\n{done.stderr[-4000:]}")
            os.replace(tmp_lib, lib_path)
            shutil.rmtree(work, ignore_errors=True)
        self._lib = ctypes.CDLL(str(lib_path))

    def get_function(self, name: str) -> HostKernel:
        if name not in self.kernels:
            raise KeyError(f"no kernel {name!r} in the module (it has {sorted(self.kernels)})")
        return HostKernel(self._lib, name, self.kernels[name])


_host_modules: dict = {}


def host_raw_function(xp, key: str, source, options: tuple = ()):
    """A stand-in for the GPU kernel set's ``raw_function`` (mpishard/kernels/cuda/launch.py):
    the same module source and kernel name, compiled for the host (one module per source)."""
    code = source()
    if code not in _host_modules:
        _host_modules[code] = HostModule(code)
    return _host_modules[code].get_function(key)


def use_host_kernels(monkeypatch) -> None:
    """Make the GPU kernel set's RawKernels (row kernels, norms, fused attention,
    multi-tensor, cross-entropy, rotary embeddings) run on the host for the rest of a test: skips it where
    there is no compiler."""
    import pytest

    from mpishard.kernels.cuda import attention, loss, multi, norms, ops, rotary
    if host_compiler() is None:
        pytest.skip("no g++ to compile CUDA C for the host")
    for launcher in (ops, norms, attention, multi, loss, rotary):   # each one's raw_function
        monkeypatch.setattr(launcher, "raw_function", host_raw_function)
    # the host modules bring their own <mma.h> (tests/cuda_wmma.py), whatever CUDA
    # headers this machine has
    monkeypatch.setattr(attention, "tensor_core_options", lambda xp: ())


#: an ElementwiseKernel parameter's CuPy type -> its C type (``T`` is not emulated)
_ELEMENTWISE_TYPES = {"float32": "float", "float64": "double", "uint16": "unsigned short",
                      "float16": "__half", "int32": "int", "int64": "long long"}


def host_elementwise(name: str, inputs: str, outputs: str, body: str, preamble: str = ""):
    """A ``cupy.ElementwiseKernel(inputs, outputs, body, name, preamble=preamble)`` of
    explicitly typed parameters (no ``T``), run on the host: a RawKernel with one thread
    per element, each input read as CuPy reads it (``float64`` scalars, as CuPy passes
    Python floats, by value; arrays element by element), each output a reference into
    its array. Called with the inputs (arrays, broadcast together as CuPy does, or
    scalars) it returns the output arrays, as CuPy does."""
    def params(spec):
        out = []
        for item in spec.split(","):
            kind, pname = item.split()
            out.append((_ELEMENTWISE_TYPES[kind], pname, np.dtype(kind)))
        return out
    ins, outs = params(inputs), params(outputs)
    args = [f"{c} {n}_" if c == "double" else f"const {c}* {n}_" for c, n, _ in ins]
    args += [f"{c}* {n}_" for c, n, _ in outs] + ["long long emu_n"]
    loads = [f"const {c} {n} = {n}_[i];" for c, n, _ in ins if c != "double"]
    loads += [f"const {c} {n} = {n}_;" for c, n, _ in ins if c == "double"]
    loads += [f"{c}& {n} = {n}_[i];" for c, n, _ in outs]
    code = (preamble + f'\nextern "C" __global__ void {name}({", ".join(args)}) {{\n'
            f"  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
            f"  if (i >= emu_n) return;\n  {' '.join(loads)}\n  {body}\n}}\n")
    if code not in _host_modules:
        _host_modules[code] = HostModule(code)
    kernel = _host_modules[code].get_function(name)

    def run(*values):
        if len(values) != len(ins):
            raise TypeError(f"{name}: {len(values)} arguments for {len(ins)} inputs")
        shape = np.broadcast_shapes(*(v.shape for v in values if isinstance(v, np.ndarray)))
        n = int(np.prod(shape, dtype=np.int64))
        passed = []
        for (c, pname, dtype), v in zip(ins, values):
            if c == "double":
                passed.append(np.float64(v))
            else:
                if v.dtype != dtype:
                    raise TypeError(f"{name}: {pname} must be {dtype}, got {v.dtype}")
                passed.append(np.ascontiguousarray(np.broadcast_to(v, shape)))  # as CuPy
        results = [np.empty(shape, dtype=dtype) for _, _, dtype in outs]
        if n:
            kernel((-(-n // 256),), (256,), (*passed, *results, np.int64(n)))
        return tuple(results) if len(results) > 1 else results[0]
    return run
