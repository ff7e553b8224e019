// float32 linear layers, y = x W^T (+ b), on the CPU's widest fused multiply-adds: AVX-512 (16
// floats a vector, 32 registers) or AVX2 and FMA (8 floats, 16 registers: AMD Zen 1-3, Intel before
// Skylake-SP, most laptops). Without AVX2 and FMA this file compiles to nothing, and oneDNN or
// F.linear run float32 linears. Built into one library with cpu_ops.cpp.
//
// The shape is the bfloat16 kernel's (cpu_linear.cpp): weights packed once into panels that a tile
// of rows streams through, threads claiming panels one at a time, SiLU-and-multiply applied as a
// gated linear writes. With AVX-512 a thread also asks for the next panel it will take while it
// computes the current one, as the bfloat16 kernel does: a decode step's weights come from memory,
// and oneDNN's float32 kernels wait for them. docs/benchmarks.md has both widths against oneDNN.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "vectors.h"

namespace {

// The packed weight: panels of kPanel output columns (the last one may be narrower, whole vectors),
// or of kGatedPanel / 2 gate and the matching up columns for a gated linear; panel p holds
// [in_features][width], each input's weights for the panel's columns side by side. A tile keeps
// Rows x Vectors accumulators in registers; each weight vector loaded serves every row of the
// tile, each input broadcast serves every vector.
#if defined(__AVX512F__)
// 32 registers: panels of 3 vectors (48 columns) in tiles of 8 rows, 24 accumulators; a gated panel
// 2 gate + 2 up vectors in tiles of 6 rows.
typedef __m512 reg;
constexpr int64_t kWidth = 16;
constexpr int kPanelVectors = 3, kPanelRows = 8, kGatedVectors = 4, kGatedRows = 6;
constexpr bool kPrefetch = true;
constexpr int64_t kRowChunk = 256;  // rows of x that stay in L2 while every panel passes over them
inline reg zero() { return _mm512_setzero_ps(); }
inline reg load_reg(const float* p) { return _mm512_loadu_ps(p); }
inline reg broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
inline reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
inline void store_reg(float* p, reg v) { _mm512_storeu_ps(p, v); }
#else
// 16 registers: panels of 2 vectors (16 columns) in tiles of 6 rows, 12 accumulators; a gated panel
// 1 gate + 1 up vector. Software prefetches measured no faster on AMD Zen: the panels stream in
// order, which the hardware's prefetchers follow.
typedef __m256 reg;
constexpr int64_t kWidth = 8;
constexpr int kPanelVectors = 2, kPanelRows = 6, kGatedVectors = 2, kGatedRows = 6;
constexpr bool kPrefetch = false;
constexpr int64_t kRowChunk = 132;  // 22 tiles
inline reg zero() { return _mm256_setzero_ps(); }
inline reg load_reg(const float* p) { return _mm256_loadu_ps(p); }
inline reg broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
inline reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
inline void store_reg(float* p, reg v) { _mm256_storeu_ps(p, v); }
#endif
static_assert(kWidth == kLanes, "a register is vectors.h's vfloat");
constexpr int64_t kPanel = kPanelVectors * kWidth, kGatedPanel = kGatedVectors * kWidth;

// Where a tile's outputs go: vector v < Vectors / 2 to first + kWidth v, the others to second +
// kWidth (v - Vectors / 2); with silu, silu(vector v) * vector (v + Vectors / 2) to first + kWidth v.
struct Outputs {
  float *first, *second;
  const float *first_bias, *second_bias;  // null without a bias
};

template <int Rows, int Vectors, bool Silu>
__attribute__((always_inline)) inline void tile(const Outputs& out, int64_t out_stride, const float* x,
                                                int64_t x_stride, const float* panel, int64_t in_features,
                                                const char* prefetch, int64_t prefetch_lines) {
  constexpr int Half = Vectors / 2;
  constexpr int64_t width = Vectors * kWidth;
  int64_t due = 0;
  reg acc[Rows][Vectors];
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < Vectors; ++v) acc[r][v] = zero();
  for (int64_t k = 0; k < in_features; ++k) {
    reg weights[Vectors];
    for (int v = 0; v < Vectors; ++v) weights[v] = load_reg(panel + k * width + v * kWidth);
    if constexpr (kPrefetch) {  // this tile's share of the next panel's lines, evenly over its steps
      for (due += prefetch_lines; due >= in_features; due -= in_features, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1);
    }
    for (int r = 0; r < Rows; ++r) {
      const reg input = broadcast(x + r * x_stride + k);
      for (int v = 0; v < Vectors; ++v) acc[r][v] = fmadd(input, weights[v], acc[r][v]);
    }
  }
  reg bias[Vectors];
  for (int v = 0; v < Vectors; ++v)
    bias[v] = out.first_bias == nullptr ? zero()
                                        : load_reg(v < Half ? out.first_bias + v * kWidth : out.second_bias + (v - Half) * kWidth);
  for (int r = 0; r < Rows; ++r) {
    if constexpr (Silu) {
      for (int v = 0; v < Half; ++v)
        store(out.first + r * out_stride + v * kWidth,
              silu_and_mul_lanes<float>((vfloat)add(acc[r][v], bias[v]), (vfloat)add(acc[r][v + Half], bias[v + Half])));
    } else {
      for (int v = 0; v < Vectors; ++v) {
        float* o = v < Half ? out.first + v * kWidth : out.second + (v - Half) * kWidth;
        store_reg(o + r * out_stride, add(acc[r][v], bias[v]));
      }
    }
  }
}

// `rows` rows of one panel in tiles of at most MaxRows, as even as they come (64 rows, 6 at most:
// 6 x 9 + 5 x 2, not 6 x 10 + 4); each tile prefetches its share of the panel the thread takes next
// (`next_bytes` of it), so that the requests spread over the whole panel's time.
template <int MaxRows, int Vectors, bool Silu>
void panel_rows(Outputs out, int64_t out_stride, const float* x, int64_t x_stride, int64_t rows,
                const float* panel, int64_t in_features, const char* next, int64_t next_bytes) {
  const int64_t tiles = (rows + MaxRows - 1) / MaxRows, next_lines = (next_bytes + 63) / 64;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t tile_rows = (rows + tiles - 1 - t) / (tiles - t);  // of the rows left, an even share
    const int64_t first_line = next_lines * t / tiles, lines = next_lines * (t + 1) / tiles - first_line;
    const char* prefetch = next + first_line * 64;
    switch (tile_rows) {
#define TILE(R)                                                                                       \
  case R:                                                                                             \
    if constexpr (R <= MaxRows) tile<R, Vectors, Silu>(out, out_stride, x, x_stride, panel, in_features, prefetch, lines); \
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

// The output features a weight must come in: whole vectors, and for a gated weight whole gate + up
// panels (the Python side checks before packing).
extern "C" int64_t linear_f32_multiple(bool gated) { return gated ? kGatedPanel : kWidth; }

// weight [out_features, in_features] (nn.Linear's layout) -> the panels above, into `packed` (as
// many elements); a gated weight's rows are the gate's, then as many up rows.
extern "C" void pack_linear_f32(float* packed, const float* weight, int64_t out_features, int64_t in_features,
                                bool gated) {
  const int64_t panel_width = gated ? kGatedPanel : kPanel, half = out_features / 2, gate_width = kGatedPanel / 2;
#pragma omp parallel for
  for (int64_t start = 0; start < out_features; start += panel_width) {
    const int64_t width = std::min(panel_width, out_features - start);
    float* panel = packed + start * in_features;
    for (int64_t c = 0; c < width; ++c) {
      const int64_t row = !gated ? start + c : c < gate_width ? start / 2 + c : half + start / 2 + c - gate_width;
      for (int64_t k = 0; k < in_features; ++k) panel[k * width + c] = weight[row * in_features + k];
    }
  }
}

// out = x [rows, in_features] (rows x_stride apart) @ W^T (+ bias): [rows, out_features], or with
// silu (a gated weight) silu(gate) * up, [rows, out_features / 2]. An item is one panel over one
// chunk of rows; a thread claims its next item before computing the current one, so that it knows
// which panel to prefetch, and a thread another process holds up leaves its share to the other
// instead of making it wait at the end.
extern "C" void linear_f32(float* out, const float* x, int64_t x_stride, int64_t rows, int64_t in_features,
                           const float* packed, int64_t out_features, const float* bias, bool gated, bool silu) {
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
      const int64_t next_bytes = kPrefetch && following < items ? width_of(following) * in_features * 4 : 0;
      const float* in = x + chunk * x_stride;
      const float* panel = packed + start * in_features;
      float* o = out + chunk * out_stride;
      if (gated) {  // columns start / 2 + [0, kGatedPanel / 2) of the gate half and of the up half
        const float* b = bias != nullptr ? bias + start / 2 : nullptr;
        const Outputs to{o + start / 2, o + half + start / 2, b, b != nullptr ? b + half : nullptr};
        if (silu) panel_rows<kGatedRows, kGatedVectors, true>(to, out_stride, in, x_stride, chunk_rows, panel, in_features, next, next_bytes);
        else panel_rows<kGatedRows, kGatedVectors, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features, next, next_bytes);
      } else {
        const int64_t vectors = width_of(item) / kWidth;
        const float* b = bias != nullptr ? bias + start : nullptr;
        const int64_t second = vectors / 2 * kWidth;  // where the vectors past the first half go: the next ones
        const Outputs to{o + start, o + start + second, b, b != nullptr ? b + second : nullptr};
        switch (vectors) {
          case 3:
            if constexpr (kPanelVectors == 3) panel_rows<kPanelRows, 3, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features, next, next_bytes);
            break;
          case 2:
            panel_rows<kPanelVectors == 2 ? kPanelRows : 12, 2, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features, next, next_bytes);
            break;
          default: panel_rows<12, 1, false>(to, out_stride, in, x_stride, chunk_rows, panel, in_features, next, next_bytes); break;
        }
      }
      item = following;
    }
  }
}
#endif
