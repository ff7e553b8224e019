// Multi-LoRA deltas for a step's small batches: out[t] += (x[t] A_s^T) B_s^T for each token t of a
// segment on slot s, in one call for every segment of the step. Built into one library with
// cpu_ops.cpp (backend/cpu_ops.py); backend/ops.py calls it on decode-sized steps and keeps torch's
// GEMMs for prefills, where the deltas are large enough for oneDNN's GEMMs.
//
// Why not two torch GEMMs per layer: at a decode step the deltas are a few MFLOP and the adapters'
// weights a few hundred kB a projection, while each oneDNN bfloat16 call costs 30-40 us of its own;
// two batched calls per projection took ~230 us a projection in a step of 64 tokens (SmolLM2, 4
// adapters of rank 16 on all 7 projections: ~30 ms a step, as long as the base model's linears).
//
// Layouts (the CPU copies backend/lora/layers.py keeps): at [slots][in][width] (A^T) and bt
// [slots][width][out] (B^T, the scaling folded in); only the first `ranks` of the `width` rank
// columns are read. ranks and out are multiples of 16. The shrink keeps float32 (it is not rounded to
// the activation type between the two products); the delta is added to out in float32 and rounded
// once.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vectors.h"

namespace {

inline float scalar(const float* p) { return *p; }
inline float scalar(const bf16* p) {
  const uint32_t bits = uint32_t(p->bits) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

constexpr int64_t kRows = 6;     // token rows per tile: Rows x Vectors accumulators <= 24 registers
constexpr int64_t kVectors = 4;  // 64 rank or output columns per tile

// shrink[r][c] (float, ranks wide) = sum_i x[r][i] at[i][c] for Rows rows, columns [c0, c0 + 16 V).
template <typename T, int Rows, int Vectors>
void shrink_tile(float* shrink, int64_t ranks, const T* x, int64_t x_stride, const T* at, int64_t width,
                 int64_t in_features) {
  vfloat acc[Rows][Vectors] = {};
  for (int64_t i = 0; i < in_features; ++i) {
    vfloat w[Vectors];
    for (int v = 0; v < Vectors; ++v) w[v] = load(at + i * width + v * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const vfloat input = splat(scalar(x + r * x_stride + i));
      for (int v = 0; v < Vectors; ++v) acc[r][v] += input * w[v];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < Vectors; ++v) store(shrink + r * ranks + v * kLanes, acc[r][v]);
}

// out[r][c] += sum_k shrink[r][k] bt[k][c] for Rows rows, columns [c0, c0 + 16 V).
template <typename T, int Rows, int Vectors>
void expand_tile(T* out, int64_t out_stride, const float* shrink, int64_t ranks, const T* bt, int64_t out_features) {
  vfloat acc[Rows][Vectors] = {};
  for (int64_t k = 0; k < ranks; ++k) {
    vfloat w[Vectors];
    for (int v = 0; v < Vectors; ++v) w[v] = load(bt + k * out_features + v * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const vfloat s = splat(shrink[r * ranks + k]);
      for (int v = 0; v < Vectors; ++v) acc[r][v] += s * w[v];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < Vectors; ++v) {
      T* o = out + r * out_stride + v * kLanes;
      store(o, load(o) + acc[r][v]);
    }
}

// The tile of `rows` <= kRows rows and `vectors` <= kVectors vectors, dispatched to its template.
template <typename T, bool Shrink>
void tile(int64_t rows, int64_t vectors, T* out, int64_t out_stride, float* shrink, int64_t ranks, const T* x,
          int64_t x_stride, const T* weights, int64_t row_width, int64_t depth) {
#define TILE(R, V)                                                                                  \
  if (rows == R && vectors == V) {                                                                  \
    if constexpr (Shrink) shrink_tile<T, R, V>(shrink, ranks, x, x_stride, weights, row_width, depth); \
    else expand_tile<T, R, V>(out, out_stride, shrink, ranks, weights, row_width);                  \
    return;                                                                                         \
  }
#define TILES(R) TILE(R, 1) TILE(R, 2) TILE(R, 3) TILE(R, 4)
  TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
#undef TILES
#undef TILE
}

// Work items: (segment, tile of rows, block of columns); a step's segments, each `rows` tokens long.
struct Item {
  int64_t segment, row, column;
};

std::vector<Item> items_of(const int64_t* segments, int64_t num_segments, int64_t columns) {
  std::vector<Item> items;
  for (int64_t s = 0; s < num_segments; ++s)
    for (int64_t row = 0; row < segments[3 * s + 1]; row += kRows)
      for (int64_t column = 0; column < columns; column += kVectors * kLanes) items.push_back({s, row, column});
  return items;
}

// Runs shrink(item, shrink rows, rows, vectors) over every (segment, row tile, rank block), then
// expand(item, shrink rows, rows, vectors) over every (segment, row tile, output block), with the
// shrink rows (`tokens` x `ranks`, the segments' tokens back to back) in between.
template <typename Shrunk, typename Shrink, typename Expand>
void run(const int64_t* segments, int64_t num_segments, int64_t in_features, int64_t ranks, int64_t out_features,
         Shrink shrink, Expand expand) {
  int64_t tokens = 0;
  std::vector<int64_t> first(num_segments);
  for (int64_t s = 0; s < num_segments; ++s) first[s] = tokens, tokens += segments[3 * s + 1];
  std::vector<Shrunk> shrunk(tokens * ranks);
  const std::vector<Item> shrinks = items_of(segments, num_segments, ranks);
  const std::vector<Item> expands = items_of(segments, num_segments, out_features);
  const int64_t flops = tokens * ranks * (in_features + out_features);
  auto bounds = [&](const Item& item, int64_t columns) {
    return std::pair<int64_t, int64_t>{std::min(kRows, segments[3 * item.segment + 1] - item.row),
                                       std::min(kVectors * kLanes, columns - item.column) / kLanes};
  };
#pragma omp parallel if (flops >= (1 << 20))
  {
#pragma omp for schedule(static)
    for (size_t n = 0; n < shrinks.size(); ++n) {
      const auto [rows, vectors] = bounds(shrinks[n], ranks);
      shrink(shrinks[n], shrunk.data() + (first[shrinks[n].segment] + shrinks[n].row) * ranks, rows, vectors);
    }
#pragma omp for schedule(static)
    for (size_t n = 0; n < expands.size(); ++n) {
      const auto [rows, vectors] = bounds(expands[n], out_features);
      expand(expands[n], shrunk.data() + (first[expands[n].segment] + expands[n].row) * ranks, rows, vectors);
    }
  }
}

template <typename T>
void lora(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* at, const T* bt,
          const int64_t* segments, int64_t num_segments, int64_t in_features, int64_t width, int64_t ranks,
          int64_t out_features) {
  run<float>(
      segments, num_segments, in_features, ranks, out_features,
      [&](const Item& item, float* shrunk, int64_t rows, int64_t vectors) {
        const int64_t start = segments[3 * item.segment], slot = segments[3 * item.segment + 2];
        tile<T, true>(rows, vectors, nullptr, 0, shrunk + item.column, ranks, x + (start + item.row) * x_stride,
                      x_stride, at + slot * in_features * width + item.column, width, in_features);
      },
      [&](const Item& item, float* shrunk, int64_t rows, int64_t vectors) {
        const int64_t start = segments[3 * item.segment], slot = segments[3 * item.segment + 2];
        tile<T, false>(rows, vectors, out + (start + item.row) * out_stride + item.column, out_stride, shrunk, ranks,
                       nullptr, 0, bt + slot * width * out_features + item.column, out_features, 0);
      });
}

#if defined(__AVX512BF16__)
// The bfloat16 path on vdpbf16ps, two products a lane per instruction: A^T and B^T in pairs along
// the sum (atp [slots][in / 2][width][2], btp [slots][width / 2][out][2], the linear kernel's
// panel layout), the shrink rounded to bfloat16 in between as torch's two GEMMs round it.
// out[r][c] (=, or += with Accumulate) sum_p in[r][2p, 2p + 1] . w[p][c][0, 1] for Rows rows and
// columns [0, 16 Vectors) of w (row_width columns a pair row): the shrink (in = x, w = atp, out = the
// bf16 shrink rows) and the expand (in = the shrink rows, w = btp, out += ) alike.
template <int Rows, int Vectors, bool Accumulate>
void pairs_product(uint16_t* out, int64_t out_stride, const uint16_t* in, int64_t in_stride, const uint16_t* w_pairs,
                   int64_t row_width, int64_t depth) {
  __m512 acc[Rows][Vectors];
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < Vectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < depth / 2; ++pair) {
    __m512bh w[Vectors];
    for (int v = 0; v < Vectors; ++v) w[v] = (__m512bh)_mm512_loadu_si512(w_pairs + (pair * row_width + v * kLanes) * 2);
    for (int r = 0; r < Rows; ++r) {
      int32_t inputs;
      std::memcpy(&inputs, in + r * in_stride + 2 * pair, sizeof inputs);
      const __m512bh both = (__m512bh)_mm512_set1_epi32(inputs);
      for (int v = 0; v < Vectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], both, w[v]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < Vectors; ++v) {
      bf16* o = reinterpret_cast<bf16*>(out + r * out_stride + v * kLanes);
      store(o, Accumulate ? load(o) + (vfloat)acc[r][v] : (vfloat)acc[r][v]);  // store rounds to bf16
    }
}

template <bool Accumulate>
void pairs_tile(int64_t rows, int64_t vectors, uint16_t* out, int64_t out_stride, const uint16_t* in,
                int64_t in_stride, const uint16_t* w_pairs, int64_t row_width, int64_t depth) {
#define TILE(R, V)                                                                                    \
  if (rows == R && vectors == V) {                                                                    \
    pairs_product<R, V, Accumulate>(out, out_stride, in, in_stride, w_pairs, row_width, depth);       \
    return;                                                                                           \
  }
#define TILES(R) TILE(R, 1) TILE(R, 2) TILE(R, 3) TILE(R, 4)
  TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
#undef TILES
#undef TILE
}
#endif

}  // namespace

// segments: [num_segments][3] int64 (first token, tokens, slot). See the top of the file.
#if defined(__AVX512BF16__)
// The bfloat16 kernel on pair-packed weights (see pairs_product): atp [slots][in / 2][width][2],
// btp [slots][width / 2][out][2]; in even.
extern "C" void lora_pairs_bf16(uint16_t* out, int64_t out_stride, const uint16_t* x, int64_t x_stride,
                                const uint16_t* atp, const uint16_t* btp, const int64_t* segments, int64_t num_segments,
                                int64_t in_features, int64_t width, int64_t ranks, int64_t out_features) {
  run<uint16_t>(
      segments, num_segments, in_features, ranks, out_features,
      [&](const Item& item, uint16_t* shrunk, int64_t rows, int64_t vectors) {
        const int64_t start = segments[3 * item.segment], slot = segments[3 * item.segment + 2];
        pairs_tile<false>(rows, vectors, shrunk + item.column, ranks, x + (start + item.row) * x_stride, x_stride,
                          atp + slot * in_features * width + item.column * 2, width, in_features);
      },
      [&](const Item& item, uint16_t* shrunk, int64_t rows, int64_t vectors) {
        const int64_t start = segments[3 * item.segment], slot = segments[3 * item.segment + 2];
        pairs_tile<true>(rows, vectors, out + (start + item.row) * out_stride + item.column, out_stride, shrunk, ranks,
                         btp + slot * width * out_features + item.column * 2, out_features, ranks);
      });
}
#endif

#define LORA(suffix, T)                                                                                      \
  extern "C" void lora_##suffix(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* at,       \
                                const T* bt, const int64_t* segments, int64_t num_segments, int64_t in_features, \
                                int64_t width, int64_t ranks, int64_t out_features) {                        \
    lora<T>(out, out_stride, x, x_stride, at, bt, segments, num_segments, in_features, width, ranks, out_features); \
  }
LORA(f32, float)
LORA(bf16, bf16)
