// A mixture-of-experts layer's routed experts in one call, for the few tokens of a decode step:
// out[t] = sum over t's k chosen experts e of weight[t, e] * down_e(silu(gate_e(x[t])) * up_e(x[t])),
// in bfloat16, on AVX512-BF16's dot products (this file compiles to nothing without them). Built into
// one library with cpu_ops.cpp (backend/cpu_ops.py; backend/models/layers/moe.py picks it).
//
// Why: at a few tokens an expert has one or two rows, and the grouped path's torch ops (a sort, a
// gather, per expert a gate_up GEMM, silu_and_mul and a down GEMM, then a weighted index_add) cost
// 10-40 us of dispatch each against a few us of arithmetic. Here the (token, expert) pairs are
// sorted by expert, each chosen expert's weights stream through once for all its rows, and the
// weighted sum over k is done as the outputs are written.
//
// The weights are the experts' nn.Linear weights stacked as they are, w13 [E, 2I, H] (gate rows, then
// up rows) and w2 [E, H, I]: no second, packed copy, so the large-batch path can still run oneDNN's
// GEMMs on the same memory. A tile computes 16 dot products at once (rows x weight rows: 1 x 16,
// 2 x 8 or 4 x 4), 32 inputs per vdpbf16ps, and folds the 16 accumulators into one vector of sums.
//
// Rounding follows the torch ops it replaces: gate and up rounded to bfloat16, silu rounded, the
// product rounded (the CPU silu_and_mul, bit for bit); the down output rounded, times the routing
// weight rounded to bfloat16, rounded; then a token's pairs summed in ascending expert order, each
// sum rounded (index_add_ over expert-sorted pairs). Only the order of the dot products' float32
// sums differs from oneDNN's.
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vectors.h"

namespace {

constexpr int64_t kGateBlock = 8;   // gate columns (and as many up columns) per work item
constexpr int64_t kDownBlock = 16;  // output columns of the down projection per work item
constexpr int64_t kParallelMacs = 1 << 21;  // less work than this runs on one thread: forking costs more

// The 16 accumulators' horizontal sums, in accumulator order: pairs of vectors are added half to
// half (16 -> 8 vectors), then quarter to quarter, then within 128-bit lanes twice; lane 4q + i
// then holds accumulator q + 4i, which one permutation puts in order.
__attribute__((always_inline)) inline __m512 sums_of(const __m512 (&acc)[16]) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xEE));
  const __m512 folded = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                                      _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), folded);
}

// sums[r * Cols + c] = x_r . w_c over `size` inputs (bfloat16 rows; the last partial step masked).
// With `ahead` (elements; 0: none), each weight row's line that far on is prefetched as the row's
// line is read: the next tile's weights, which a decode step streams from L3 or memory and which
// come in rows too short (1-2 KB) for the hardware prefetcher to catch on.
template <int Rows, int Cols>
__attribute__((always_inline)) inline void dots(float* sums, const uint16_t* const* xs, const uint16_t* const* ws,
                                                int64_t size, int64_t ahead) {
  static_assert(Rows * Cols == 16, "a tile is 16 dot products");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __mmask32 mask) {
    __m512bh x[Rows], w[Cols];
    for (int r = 0; r < Rows; ++r) x[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs[r] + k);
    for (int c = 0; c < Cols; ++c) w[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, ws[c] + k);
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) acc[r * Cols + c] = _mm512_dpbf16_ps(acc[r * Cols + c], x[r], w[c]);
  };
  int64_t k = 0;
  if (ahead != 0)
    for (; k + 32 <= size; k += 32) {
      for (int c = 0; c < Cols; ++c) _mm_prefetch(reinterpret_cast<const char*>(ws[c] + ahead + k), _MM_HINT_T0);
      step(k, ~__mmask32(0));
    }
  for (; k + 32 <= size; k += 32) step(k, ~__mmask32(0));
  if (k < size) step(k, __mmask32((1u << (size - k)) - 1));
  _mm512_storeu_ps(sums, sums_of(acc));
}

inline float bf16_value(float v) {  // v rounded to bfloat16 (nearest even), as a float
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &u, sizeof r);
  return v != v ? v : r;
}
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if (v != v) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct Problem {
  const uint16_t *x, *w13, *w2;
  int64_t hidden, intermediate;
  std::vector<int64_t> token_of;     // sorted position -> token
  std::vector<float> weight_of;      // sorted position -> routing weight rounded to bfloat16
  std::vector<int64_t> first;        // expert e's pairs are sorted positions [first[e], first[e + 1])
  std::vector<uint16_t> activation;  // [pairs, intermediate]: silu(gate) * up
  std::vector<float> weighted;       // [pairs, hidden]: weight * down(activation), rounded as torch
};

// silu(gate) * up for `Rows` pairs of expert e (sorted positions from `pair`) and the gate columns
// [column, column + Cols / 2) (those past the end computed on a valid row and dropped).
template <int Rows, int Cols>
void gate_up_tile(Problem& p, int64_t e, int64_t pair, int64_t column, bool prefetch) {
  constexpr int Half = Cols / 2;
  const int64_t H = p.hidden, I = p.intermediate;
  const uint16_t* xs[Rows];
  const uint16_t* ws[Cols];
  for (int r = 0; r < Rows; ++r) xs[r] = p.x + p.token_of[pair + r] * H;
  const uint16_t* w = p.w13 + e * 2 * I * H;
  for (int c = 0; c < Half; ++c) {
    const int64_t j = std::min(column + c, I - 1);
    ws[c] = w + j * H;
    ws[Half + c] = w + (I + j) * H;
  }
  alignas(64) float sums[16];
  dots<Rows, Cols>(sums, xs, ws, H, prefetch ? Half * H : 0);
  vfloat gate{}, up{};
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Half; ++c) {
      gate[r * Half + c] = sums[r * Cols + c];
      up[r * Half + c] = sums[r * Cols + Half + c];
    }
  const vfloat act = silu_and_mul_lanes<bf16>(round_to<bf16>(gate), round_to<bf16>(up));
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Half && column + c < I; ++c)
      p.activation[(pair + r) * I + column + c] = bf16_bits(act[r * Half + c]);
}

// weight * down(activation) for `Rows` pairs of expert e and the output columns [column, column + Cols).
template <int Rows, int Cols>
void down_tile(Problem& p, int64_t e, int64_t pair, int64_t column, bool prefetch) {
  const int64_t H = p.hidden, I = p.intermediate;
  const uint16_t* xs[Rows];
  const uint16_t* ws[Cols];
  for (int r = 0; r < Rows; ++r) xs[r] = p.activation.data() + (pair + r) * I;
  for (int c = 0; c < Cols; ++c) ws[c] = p.w2 + (e * H + std::min(column + c, H - 1)) * I;
  alignas(64) float sums[16];
  dots<Rows, Cols>(sums, xs, ws, I, prefetch ? Cols * I : 0);
  vfloat weights;
  for (int i = 0; i < 16; ++i) weights[i] = p.weight_of[pair + i / Cols];
  const vfloat weighted = round_to<bf16>(round_to<bf16>(load(sums)) * weights);
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols && column + c < H; ++c) p.weighted[(pair + r) * H + column + c] = weighted[r * Cols + c];
}

template <int Rows_, int Cols>
struct GateUp {
  static void run(Problem& p, int64_t e, int64_t pair, int64_t column, bool prefetch) {
    gate_up_tile<Rows_, Cols>(p, e, pair, column, prefetch);
  }
};
template <int Rows_, int Cols>
struct Down {
  static void run(Problem& p, int64_t e, int64_t pair, int64_t column, bool prefetch) {
    down_tile<Rows_, Cols>(p, e, pair, column, prefetch);
  }
};

// Tile<R, C>::run over expert e's pairs and `block` columns from `column`: 4 rows at a time, then 2,
// then 1, a tile as many columns wide as make 16 dot products; `per_row` weight rows per output
// column (2 for gate_up: its gate and its up row). The block's weight rows stay in L1 across tiles.
template <template <int, int> class Tile>
void block(Problem& p, int64_t e, int64_t column, int64_t block, int64_t per_row) {
  const int64_t begin = p.first[e], end = p.first[e + 1];
  int64_t pair = begin;  // the first tiles over the block fetch it (and prefetch on), the others find it in L1
  for (; pair + 4 <= end; pair += 4)
    for (int64_t c = 0; c < block; c += 4 / per_row) Tile<4, 4>::run(p, e, pair, column + c, pair == begin);
  for (; pair + 2 <= end; pair += 2)
    for (int64_t c = 0; c < block; c += 8 / per_row) Tile<2, 8>::run(p, e, pair, column + c, pair == begin);
  for (; pair < end; ++pair)
    for (int64_t c = 0; c < block; c += 16 / per_row) Tile<1, 16>::run(p, e, pair, column + c, pair == begin);
}

}  // namespace

// out [tokens, hidden] = the routed experts' weighted sum (above); x [tokens, hidden] packed rows;
// topk_weights [tokens, top_k] float32, topk_ids [tokens, top_k] int64 in [0, experts).
extern "C" void moe_experts_bf16(uint16_t* out, const uint16_t* x, int64_t tokens, int64_t hidden,
                                 const uint16_t* w13, const uint16_t* w2, int64_t experts, int64_t intermediate,
                                 const float* topk_weights, const int64_t* topk_ids, int64_t top_k) {
  const int64_t pairs = tokens * top_k;
  Problem p{x, w13, w2, hidden, intermediate, std::vector<int64_t>(pairs), std::vector<float>(pairs),
            std::vector<int64_t>(experts + 1, 0), std::vector<uint16_t>(pairs * intermediate),
            std::vector<float>(pairs * hidden)};
  // A stable counting sort of the pairs by expert; position_of[t * top_k + slot] = sorted position.
  for (int64_t i = 0; i < pairs; ++i) ++p.first[topk_ids[i] + 1];
  for (int64_t e = 0; e < experts; ++e) p.first[e + 1] += p.first[e];
  std::vector<int64_t> cursor(p.first.begin(), p.first.end() - 1), position_of(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t at = cursor[topk_ids[i]]++;
    position_of[i] = at;
    p.token_of[at] = i / top_k;
    p.weight_of[at] = bf16_value(topk_weights[i]);
  }
  // Work items: (expert with pairs, block of columns), for each projection.
  std::vector<int64_t> busy;
  for (int64_t e = 0; e < experts; ++e)
    if (p.first[e + 1] > p.first[e]) busy.push_back(e);
  const int64_t gate_blocks = (intermediate + kGateBlock - 1) / kGateBlock;
  const int64_t down_blocks = (hidden + kDownBlock - 1) / kDownBlock;
  const int64_t gate_items = int64_t(busy.size()) * gate_blocks, down_items = int64_t(busy.size()) * down_blocks;
  const bool parallel = pairs * 3 * intermediate * hidden >= kParallelMacs;
#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < gate_items; ++item)
      block<GateUp>(p, busy[item / gate_blocks], item % gate_blocks * kGateBlock, kGateBlock, 2);
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < down_items; ++item)
      block<Down>(p, busy[item / down_blocks], item % down_blocks * kDownBlock, kDownBlock, 1);
    // Each token's pairs in ascending expert order (their sorted positions ascending), each sum rounded.
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int64_t> positions(position_of.begin() + t * top_k, position_of.begin() + (t + 1) * top_k);
      std::sort(positions.begin(), positions.end());
      for (int64_t i = 0; i < hidden; i += kLanes) {
        vfloat sum{};
        for (int64_t at : positions) {
          if (i + kLanes <= hidden) {
            sum = round_to<bf16>(sum + load(p.weighted.data() + at * hidden + i));
          } else {
            for (int64_t j = 0; j < hidden - i; ++j) sum[j] = bf16_value(sum[j] + p.weighted[at * hidden + i + j]);
          }
        }
        if (i + kLanes <= hidden) {
          store(reinterpret_cast<bf16*>(out + t * hidden + i), sum);
        } else {
          for (int64_t j = 0; j < hidden - i; ++j) out[t * hidden + i + j] = bf16_bits(sum[j]);
        }
      }
    }
  }
}
#endif
