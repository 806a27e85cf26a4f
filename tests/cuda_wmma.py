"""CUDA's warp matrix functions (``<mma.h>``, ``nvcuda::wmma``) for kernels run on the
host by tests/cuda_host.py, which writes :data:`WMMA_HEADER` as the ``mma.h`` a
kernel includes.

Only the 16 x 16 x 16 shape, with 16-bit inputs (``__half``, ``__nv_bfloat16``) and
float accumulators: ``fragment<matrix_a | matrix_b | accumulator, 16, 16, 16, T,
row_major | col_major>``, ``load_matrix_sync``, ``store_matrix_sync``, ``mma_sync``,
``fill_fragment``, ``mem_row_major`` / ``mem_col_major``, ``num_elements`` and ``x[]``.

On a GPU a fragment is spread over the 32 lanes of a warp in a mapping CUDA leaves
unspecified. Here every lane holds the whole tile (``num_elements`` is 256, element
``(r, c)`` at ``x[r * 16 + c]``) and does every load, store and product itself,
identically: a kernel that reads the same results whichever lane holds which element
(the only thing portable WMMA code may assume) computes the same here as there. A
product is ``d = c + a b`` in float, the products of 16-bit inputs exact (as on tensor
cores), summed in the order of ``k``; a GPU's tensor cores sum in an order (and with
an intermediate rounding) of their own, so results agree to float rounding, not bit
for bit. A pointer that is not 32-byte aligned or a leading dimension that is not a
multiple of 16 bytes (undefined on a GPU) stops the process with a message.
"""
from __future__ import annotations

__all__ = ["WMMA_HEADER"]

WMMA_HEADER = r"""
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

/* rows and columns of a fragment: a is M x K, b is K x N, the accumulator M x N */
template <class Use, int M, int N, int K> struct emu_shape;
template <int M, int N, int K> struct emu_shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K> struct emu_shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K> struct emu_shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

/* the whole tile, in every lane: element (r, c) at x[r * cols + c] */
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulation has the 16x16x16 shape only");
  static constexpr int rows = emu_shape<Use, M, N, K>::rows;
  static constexpr int cols = emu_shape<Use, M, N, K>::cols;
  enum { num_elements = rows * cols };
  T x[num_elements];
};

template <class T> inline void emu_check(const T* p, unsigned ldm, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || (ldm * sizeof(T)) % 16 != 0) {
    std::fprintf(stderr, "wmma::%s: pointer %p must be 32-byte aligned and ldm %u a "
                 "multiple of %zu elements (undefined on a GPU)\n", what, (const void*)p, ldm,
                 16 / sizeof(T));
    std::abort();
  }
}

template <class Use, int M, int N, int K, class T, class Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const T& v) {
  for (int e = 0; e < f.num_elements; ++e) f.x[e] = v;
}

/* a or b: the tile at p, its rows ldm elements apart (row_major) or its columns */
template <class Use, int M, int N, int K, class T, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
  emu_check(p, ldm, "load_matrix_sync");
  constexpr int R = fragment<Use, M, N, K, T, Layout>::rows;
  constexpr int C = fragment<Use, M, N, K, T, Layout>::cols;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      f.x[r * C + c] = std::is_same<Layout, row_major>::value ? p[(size_t)r * ldm + c]
                                                             : p[(size_t)c * ldm + r];
}

/* the accumulator: the layout is an argument */
template <int M, int N, int K, class T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm,
                             layout_t layout) {
  emu_check(p, ldm, "load_matrix_sync");
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      f.x[r * N + c] = layout == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}

template <int M, int N, int K, class T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                              layout_t layout) {
  emu_check(p, ldm, "store_matrix_sync");
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      (layout == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r]) =
          f.x[r * N + c];
}

/* d = a b + c, in float: a 16-bit product is exact in float, the sum over k in order */
template <int M, int N, int K, class A, class B, class LA, class LB>
inline void mma_sync(fragment<accumulator, M, N, K, float>& d,
                     const fragment<matrix_a, M, N, K, A, LA>& a,
                     const fragment<matrix_b, M, N, K, B, LB>& b,
                     const fragment<accumulator, M, N, K, float>& c) {
  float a32[M * K], b32[K * N], out[M * N];      /* each input converted once */
  for (int e = 0; e < M * K; ++e) a32[e] = (float)a.x[e];
  for (int e = 0; e < K * N; ++e) b32[e] = (float)b.x[e];
  for (int r = 0; r < M; ++r)
    for (int n = 0; n < N; ++n) {
      float acc = c.x[r * N + n];
      for (int k = 0; k < K; ++k) acc += a32[r * K + k] * b32[k * N + n];
      out[r * N + n] = acc;
    }
  for (int e = 0; e < M * N; ++e) d.x[e] = out[e];
}
}  // namespace wmma
}  // namespace nvcuda
"""
