// bfloat16 linear layers, y = x W^T (+ b), on AVX512-BF16's dot products: for a CPU whose best bf16
// instruction that is (without AMX; backend/cpu_ops.py keeps oneDNN where the CPU has AMX, and where
// it lacks AVX512-BF16 this file compiles to nothing). Built into one library with cpu_ops.cpp.
//
// Why not oneDNN, which uses the same instruction here: a decode step's weights (SmolLM2-135M: 270 MB)
// come from memory on every step, and oneDNN's kernel waits for them and computes in turn. This one
// asks for the next panel of weights while it computes the current one, as the attention kernel does
// for its next item. Measured with the weights coming from memory as in a step, 2 threads, 64 rows
// (SmolLM2's qkv / o / gate_up / down / lm_head): oneDNN 211 / 153 / 343 / 286 / 355 GFLOP/s, this
// kernel 352 / 311 / 402 / 372 / 375; at 2,048 rows 407-425 against 436-452.
//
// A gated linear (an MLP's gate and up projections, stacked) can also apply SiLU-and-multiply as it
// writes: its panels hold 32 gate and the 32 matching up outputs side by side.
#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "vectors.h"

namespace {

// The packed weight: panels of 48 output columns (the last one may be narrower, a multiple of 16),
// or of 32 gate + 32 up columns for a gated linear; panel p holds [in_features / 2][width][2]: for
// each pair of inputs, each column's two weights side by side, which is the operand layout of
// vdpbf16ps. A tile keeps 24 float32 accumulators in registers (of 32): 8 rows x 3 vectors of 16
// columns, 6 x 4 for a gated panel; each weight vector loaded is used for every row of the tile.
constexpr int64_t kPanel = 48, kGatedPanel = 64;
constexpr int64_t kRowChunk = 512;  // rows of x that stay in L2 while every panel passes over them

// Where a tile's outputs go: vector v < Vectors / 2 to first + 16 v, the others to second +
// 16 (v - Vectors / 2); with silu, silu(vector v) * vector (v + Vectors / 2) to first + 16 v.
struct Outputs {
  uint16_t *first, *second;
  const uint16_t *first_bias, *second_bias;  // null without a bias
};

template <int Rows, int Vectors, bool Silu>
__attribute__((always_inline)) inline void tile(const Outputs& out, int64_t out_stride, const uint16_t* x,
                                                int64_t x_stride, const uint16_t* panel, int64_t in_features,
                                                const char* prefetch, int64_t prefetch_bytes) {
  constexpr int Half = Vectors / 2;
  constexpr int64_t width = Vectors * 16;
  __m512 acc[Rows][Vectors];
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < Vectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < in_features / 2; ++pair) {
    __m512bh weights[Vectors];
    for (int v = 0; v < Vectors; ++v)
      weights[v] = (__m512bh)_mm512_loadu_si512(panel + (pair * width + v * 16) * 2);
    // As much of the next panel as this one reads in an input pair: all of it by the tile's end.
    for (int v = 0; v < Vectors; ++v) {
      const int64_t offset = (pair * Vectors + v) * 64;
      if (offset < prefetch_bytes) _mm_prefetch(prefetch + offset, _MM_HINT_T1);
    }
    for (int r = 0; r < Rows; ++r) {
      int32_t inputs;
      std::memcpy(&inputs, x + r * x_stride + 2 * pair, sizeof inputs);
      const __m512bh both = (__m512bh)_mm512_set1_epi32(inputs);
      for (int v = 0; v < Vectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], both, weights[v]);
    }
  }
  vfloat bias[Vectors] = {};
  if (out.first_bias != nullptr)
    for (int v = 0; v < Vectors; ++v)
      bias[v] = load(reinterpret_cast<const bf16*>(v < Half ? out.first_bias + v * 16 : out.second_bias + (v - Half) * 16));
  for (int r = 0; r < Rows; ++r) {
    if constexpr (Silu) {  // on the linear's outputs as stored (rounded to bf16), as the op alone reads them
      for (int v = 0; v < Half; ++v)
        store(reinterpret_cast<bf16*>(out.first + r * out_stride + v * 16),
              silu_and_mul_lanes<bf16>(round_to<bf16>((vfloat)acc[r][v] + bias[v]),
                                       round_to<bf16>((vfloat)acc[r][v + Half] + bias[v + Half])));
    } else {
      for (int v = 0; v < Vectors; ++v) {
        uint16_t* o = v < Half ? out.first + v * 16 : out.second + (v - Half) * 16;
        store(reinterpret_cast<bf16*>(o + r * out_stride), (vfloat)acc[r][v] + bias[v]);  // store rounds
      }
    }
  }
}

// `rows` rows of one panel in tiles of at most MaxRows, as even as they come (64 rows, 6 at most:
// 6 x 9 + 5 x 2, not 6 x 10 + 4); the first tile prefetches the panel the thread takes next.
template <int MaxRows, int Vectors, bool Silu>
void panel_rows(Outputs out, int64_t out_stride, const uint16_t* x, int64_t x_stride, int64_t rows,
                const uint16_t* panel, int64_t in_features, const char* next, int64_t next_bytes) {
  const int64_t tiles = (rows + MaxRows - 1) / MaxRows;
  for (int64_t t = 0; t < tiles; ++t, next_bytes = 0) {
    const int64_t tile_rows = (rows + tiles - 1 - t) / (tiles - t);  // of the rows left, an even share
    switch (tile_rows) {
#define TILE(R)                                                                                       \
  case R:                                                                                             \
    if constexpr (R <= MaxRows) tile<R, Vectors, Silu>(out, out_stride, x, x_stride, panel, in_features, next, next_bytes); \
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
// many elements). out_features a multiple of 16 (of 64 when gated: gate rows, then as many up
// rows), in_features even (the Python side checks).
extern "C" void pack_linear_bf16(uint16_t* packed, const uint16_t* weight, int64_t out_features,
                                 int64_t in_features, bool gated) {
  const int64_t panel_width = gated ? kGatedPanel : kPanel, half = out_features / 2;
#pragma omp parallel for
  for (int64_t start = 0; start < out_features; start += panel_width) {
    const int64_t width = std::min(panel_width, out_features - start);
    uint16_t* panel = packed + start * in_features;
    for (int64_t c = 0; c < width; ++c) {
      const int64_t row = !gated ? start + c : c < 32 ? start / 2 + c : half + start / 2 + c - 32;
      for (int64_t k = 0; k < in_features; ++k) panel[(k / 2 * width + c) * 2 + k % 2] = weight[row * in_features + k];
    }
  }
}

// out = x [rows, in_features] (rows x_stride apart) @ W^T (+ bias): [rows, out_features], or with
// silu (a gated weight) silu(gate) * up, [rows, out_features / 2]. An item is one panel over one
// chunk of rows; a thread claims its next item before computing the current one, so that it knows
// which panel to prefetch, and a thread another process holds up leaves its share to the other
// instead of making it wait at the end.
extern "C" void linear_bf16(uint16_t* out, const uint16_t* x, int64_t x_stride, int64_t rows,
                            int64_t in_features, const uint16_t* packed, int64_t out_features,
                            const uint16_t* bias, bool gated, bool silu) {
  const int64_t panel_width = gated ? kGatedPanel : kPanel, half = out_features / 2;
  const int64_t panels = (out_features + panel_width - 1) / panel_width;
  const int64_t items = (rows + kRowChunk - 1) / kRowChunk * panels;
  const int64_t out_stride = silu ? half : out_features;
  auto width_of = [&](int64_t item) { return std::min(panel_width, out_features - item % panels * panel_width); };
  std::atomic<int64_t> claimed{0};
#pragma omp parallel
  {
    int64_t item = claimed++;
    while (item < items) {
      const int64_t following = claimed++;
      const int64_t chunk = item / panels * kRowChunk, start = item % panels * panel_width;
      const int64_t chunk_rows = std::min(kRowChunk, rows - chunk);
      const char* next = reinterpret_cast<const char*>(packed + following % panels * panel_width * in_features);
      const int64_t next_bytes = following < items ? width_of(following) * in_features * 2 : 0;
      const uint16_t* in = x + chunk * x_stride;
      const uint16_t* panel = packed + start * in_features;
      uint16_t* o = out + chunk * out_stride;
      if (gated) {  // columns start / 2 + [0, 32) of the gate half and of the up half
        const uint16_t* b = bias != nullptr ? bias + start / 2 : nullptr;
        const Outputs to{o + start / 2, o + half + start / 2, b, b != nullptr ? b + half : nullptr};
        if (silu) panel_rows<6, 4, true>(to, out_stride, in, x_stride, chunk_rows, panel, in_features, next, next_bytes);
        else panel_rows<6, 4, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features, next, next_bytes);
      } else {
        const int64_t vectors = width_of(item) / 16;
        const uint16_t* b = bias != nullptr ? bias + start : nullptr;
        const int64_t second = vectors / 2 * 16;  // where the vectors past the first half go: the next ones
        const Outputs to{o + start, o + start + second, b, b != nullptr ? b + second : nullptr};
        switch (vectors) {
          case 3: panel_rows<8, 3, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features, next, next_bytes); break;
          case 2: panel_rows<12, 2, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features, next, next_bytes); break;
          default: panel_rows<12, 1, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features, next, next_bytes); break;
        }
      }
      item = following;
    }
  }
}
#endif
