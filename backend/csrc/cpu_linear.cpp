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
#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace {

// The packed weight: panels of kPanel output columns (the last one may be narrower, a multiple of
// 16); panel p holds [in_features / 2][width][2]: for each pair of inputs, each column's two weights
// side by side, which is the operand layout of vdpbf16ps. A tile of 8 rows x 48 columns keeps 24
// float32 accumulators in registers (of 32), loads three weight vectors per input pair and uses each
// for 8 rows.
constexpr int64_t kPanel = 48;
constexpr int kTileRows = 8;
constexpr int64_t kRowChunk = 512;  // rows of x that stay in L2 while every panel passes over them

template <int Rows, int Vectors>
__attribute__((always_inline)) inline void tile(uint16_t* out, int64_t out_stride, const uint16_t* x,
                                                int64_t x_stride, const uint16_t* panel, int64_t in_features,
                                                const uint16_t* bias, const char* prefetch, int64_t prefetch_bytes) {
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
  for (int v = 0; v < Vectors; ++v) {
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr)
      b = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + v * 16))), 16));
    for (int r = 0; r < Rows; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + v * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][v], b)));
  }
}

// All rows of one panel, 8 at a time; the first tile prefetches the panel the thread takes next.
template <int Vectors>
void panel_rows(uint16_t* out, int64_t out_stride, const uint16_t* x, int64_t x_stride, int64_t rows,
                const uint16_t* panel, int64_t in_features, const uint16_t* bias, const char* next,
                int64_t next_bytes) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows, next_bytes = 0)
    tile<kTileRows, Vectors>(out + r * out_stride, out_stride, x + r * x_stride, x_stride, panel, in_features,
                             bias, next, next_bytes);
  switch (rows - r) {
#define TAIL(R)                                                                                       \
  case R:                                                                                             \
    tile<R, Vectors>(out + r * out_stride, out_stride, x + r * x_stride, x_stride, panel, in_features, \
                     bias, next, next_bytes);                                                         \
    break;
    TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#undef TAIL
    default: break;
  }
}

}  // namespace

// weight [out_features, in_features] (nn.Linear's layout) -> the panels above, into `packed` (as
// many elements). out_features a multiple of 16, in_features even (the Python side checks).
extern "C" void pack_linear_bf16(uint16_t* packed, const uint16_t* weight, int64_t out_features,
                                 int64_t in_features) {
#pragma omp parallel for
  for (int64_t start = 0; start < out_features; start += kPanel) {
    const int64_t width = std::min(kPanel, out_features - start);
    uint16_t* panel = packed + start * in_features;
    for (int64_t pair = 0; pair < in_features / 2; ++pair)
      for (int64_t c = 0; c < width; ++c)
        for (int64_t half = 0; half < 2; ++half)
          panel[(pair * width + c) * 2 + half] = weight[(start + c) * in_features + 2 * pair + half];
  }
}

// out [rows, out_features] = x [rows, in_features] (rows x_stride apart) @ W^T (+ bias). An item is
// one panel over one chunk of rows; a thread claims its next item before computing the current one,
// so that it knows which panel to prefetch, and a thread another process holds up leaves its share
// to the other instead of making it wait at the end.
extern "C" void linear_bf16(uint16_t* out, const uint16_t* x, int64_t x_stride, int64_t rows,
                            int64_t in_features, const uint16_t* packed, int64_t out_features,
                            const uint16_t* bias) {
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  const int64_t items = (rows + kRowChunk - 1) / kRowChunk * panels;
  auto width_of = [&](int64_t item) { return std::min(kPanel, out_features - item % panels * kPanel); };
  std::atomic<int64_t> claimed{0};
#pragma omp parallel
  {
    int64_t item = claimed++;
    while (item < items) {
      const int64_t following = claimed++;
      const int64_t chunk = item / panels * kRowChunk, start = item % panels * kPanel, width = width_of(item);
      const int64_t chunk_rows = std::min(kRowChunk, rows - chunk);
      const char* next = reinterpret_cast<const char*>(packed + following % panels * kPanel * in_features);
      const int64_t next_bytes = following < items ? width_of(following) * in_features * 2 : 0;
      uint16_t* o = out + chunk * out_features + start;
      const uint16_t* in = x + chunk * x_stride;
      const uint16_t* panel = packed + start * in_features;
      const uint16_t* b = bias != nullptr ? bias + start : nullptr;
      switch (width / 16) {
        case 3: panel_rows<3>(o, out_features, in, x_stride, chunk_rows, panel, in_features, b, next, next_bytes); break;
        case 2: panel_rows<2>(o, out_features, in, x_stride, chunk_rows, panel, in_features, b, next, next_bytes); break;
        default: panel_rows<1>(o, out_features, in, x_stride, chunk_rows, panel, in_features, b, next, next_bytes); break;
      }
      item = following;
    }
  }
}
#endif
