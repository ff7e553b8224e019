// float32 linear layers, y = x W^T (+ b), on AVX2's fused multiply-adds: for CPUs whose widest
// vectors are 8 floats (AMD Zen 1-3, Intel before Skylake-SP, most laptops). backend/cpu_ops.py
// keeps oneDNN where the build targets AVX-512; without AVX2 and FMA this file compiles to
// nothing. Built into one library with cpu_ops.cpp.
//
// The shape is the bfloat16 kernel's (cpu_linear.cpp): weights packed once into panels that a tile
// of rows streams through, threads claiming panels one at a time, SiLU-and-multiply applied as a
// gated linear writes. docs/benchmarks.md ("An AVX2-only host") has it against oneDNN's float32
// kernels: faster at decode batch sizes, a little slower at prefill sizes.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "vectors.h"

namespace {

// The packed weight: panels of 16 output columns (the last one may hold 8), or of 8 gate and the 8
// matching up columns for a gated linear; panel p holds [in_features][width], each input's weights
// for the panel's columns side by side. A tile keeps 12 accumulators in registers (of 16): 6 rows x
// 2 vectors of 8 columns; each weight vector loaded serves every row of the tile, each input
// broadcast serves both vectors. The panels stream from memory in order, which the hardware's
// prefetchers follow (software prefetches as the bfloat16 kernel issues them measured no faster here).
constexpr int64_t kPanel = 16;
constexpr int64_t kRowChunk = 132;  // rows of x that stay in L2 while every panel passes over them (22 tiles)

// Where a tile's outputs go: vector 0 to first, vector 1 to second; with silu, silu(vector 0) *
// vector 1 to first.
struct Outputs {
  float *first, *second;
  const float *first_bias, *second_bias;  // null without a bias
};

template <int Rows, int Vectors, bool Silu>
__attribute__((always_inline)) inline void tile(const Outputs& out, int64_t out_stride, const float* x,
                                                int64_t x_stride, const float* panel, int64_t in_features) {
  constexpr int64_t width = Vectors * 8;
  __m256 acc[Rows][Vectors];
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < Vectors; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in_features; ++k) {
    __m256 weights[Vectors];
    for (int v = 0; v < Vectors; ++v) weights[v] = _mm256_loadu_ps(panel + k * width + v * 8);
    for (int r = 0; r < Rows; ++r) {
      const __m256 input = _mm256_broadcast_ss(x + r * x_stride + k);
      for (int v = 0; v < Vectors; ++v) acc[r][v] = _mm256_fmadd_ps(input, weights[v], acc[r][v]);
    }
  }
  __m256 bias[Vectors];
  for (int v = 0; v < Vectors; ++v)
    bias[v] = out.first_bias == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(v == 0 ? out.first_bias : out.second_bias);
  for (int r = 0; r < Rows; ++r) {
    if constexpr (Silu) {
      const vfloat gate = (vfloat)_mm256_add_ps(acc[r][0], bias[0]), up = (vfloat)_mm256_add_ps(acc[r][1], bias[1]);
      store(out.first + r * out_stride, silu_and_mul_lanes<float>(gate, up));
    } else {
      for (int v = 0; v < Vectors; ++v)
        _mm256_storeu_ps((v == 0 ? out.first : out.second) + r * out_stride, _mm256_add_ps(acc[r][v], bias[v]));
    }
  }
}

// `rows` rows of one panel in tiles of at most MaxRows, as even as they come (64 rows: 6 x 9 + 5 x
// 2, not 6 x 10 + 4).
template <int MaxRows, int Vectors, bool Silu>
void panel_rows(Outputs out, int64_t out_stride, const float* x, int64_t x_stride, int64_t rows,
                const float* panel, int64_t in_features) {
  const int64_t tiles = (rows + MaxRows - 1) / MaxRows;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t tile_rows = (rows + tiles - 1 - t) / (tiles - t);  // of the rows left, an even share
    switch (tile_rows) {
#define TILE(R)                                                                                      \
  case R:                                                                                            \
    if constexpr (R <= MaxRows) tile<R, Vectors, Silu>(out, out_stride, x, x_stride, panel, in_features); \
    break;
      TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
#undef TILE
    }
    rows -= tile_rows;
    x += tile_rows * x_stride;
    out.first += tile_rows * out_stride;
    out.second += tile_rows * out_stride;
  }
}

}  // namespace

// weight [out_features, in_features] (nn.Linear's layout) -> the panels above, into `packed` (as
// many elements). out_features a multiple of 8 (of 16 when gated: gate rows, then as many up rows).
extern "C" void pack_linear_f32(float* packed, const float* weight, int64_t out_features, int64_t in_features,
                                bool gated) {
  const int64_t half = out_features / 2;
#pragma omp parallel for
  for (int64_t start = 0; start < out_features; start += kPanel) {
    const int64_t width = std::min(kPanel, out_features - start);
    float* panel = packed + start * in_features;
    for (int64_t c = 0; c < width; ++c) {
      const int64_t row = !gated ? start + c : c < 8 ? start / 2 + c : half + start / 2 + c - 8;
      for (int64_t k = 0; k < in_features; ++k) panel[k * width + c] = weight[row * in_features + k];
    }
  }
}

// out = x [rows, in_features] (rows x_stride apart) @ W^T (+ bias): [rows, out_features], or with
// silu (a gated weight) silu(gate) * up, [rows, out_features / 2]. An item is one panel over one
// chunk of rows, claimed by whichever thread is free: a thread another process holds up leaves
// its share to the other instead of making it wait at the end.
extern "C" void linear_f32(float* out, const float* x, int64_t x_stride, int64_t rows, int64_t in_features,
                           const float* packed, int64_t out_features, const float* bias, bool gated, bool silu) {
  const int64_t half = out_features / 2, panels = (out_features + kPanel - 1) / kPanel;
  const int64_t items = (rows + kRowChunk - 1) / kRowChunk * panels;
  const int64_t out_stride = silu ? half : out_features;
  std::atomic<int64_t> claimed{0};
#pragma omp parallel
  for (int64_t item = claimed++; item < items; item = claimed++) {
    const int64_t chunk = item / panels * kRowChunk, start = item % panels * kPanel;
    const int64_t chunk_rows = std::min(kRowChunk, rows - chunk);
    const float* in = x + chunk * x_stride;
    const float* panel = packed + start * in_features;
    float* o = out + chunk * out_stride;
    if (gated) {  // columns start / 2 + [0, 8) of the gate half and of the up half
      const float* b = bias != nullptr ? bias + start / 2 : nullptr;
      const Outputs to{o + start / 2, o + half + start / 2, b, b != nullptr ? b + half : nullptr};
      if (silu) panel_rows<6, 2, true>(to, out_stride, in, x_stride, chunk_rows, panel, in_features);
      else panel_rows<6, 2, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features);
    } else {
      const float* b = bias != nullptr ? bias + start : nullptr;
      const Outputs to{o + start, o + start + 8, b, b != nullptr ? b + 8 : nullptr};
      if (out_features - start >= 16) panel_rows<6, 2, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features);
      else panel_rows<12, 1, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features);
    }
  }
}
#endif
