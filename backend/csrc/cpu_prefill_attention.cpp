// Attention for long prefill chunks (backend/ops/attention.py sends them here): a chunk's queries
// over its whole context, cached prefix and its own keys alike (reshape_and_cache has just written
// those), read from the paged cache in place, a tile of keys at a time with an online softmax.
//
// Why not the decode kernel of cpu_ops.cpp: it scores one query token at a time with dot products
// whose lanes run along the head dim, then sums the lanes; a prefill chunk has enough query tokens
// for GEMM tiles instead. Why not torch's flash op: it spends more on the softmax than on its GEMMs
// at head size 64 (an exponential per score, docs/benchmarks.md "Long prompts").
//
// One item of work is a KV head and a tile of kQueryTile query tokens: its G query heads' rows
// (G x kQueryTile of them) sit in the vector lanes, each key a row of scores, so the softmax's
// running max and sum are plain vectors (no horizontal reductions) and every key and value is
// broadcast from its tile in place. Scores are in log2 units (the scale times log2(e) folded into
// them), so the exponential is a polynomial 2^x (`exp2_lanes`). The running max moves only when a
// tile's scores pass it by more than kMaxSlack: the weights then stay below 2^kMaxSlack and the
// output needs no rescale for most tiles. bfloat16 on AVX512-BF16 multiplies bfloat16 pairs into
// float32 sums (vdpbf16ps) for both the scores and the output: the queries, the keys, the values and
// the weights (rounded to bfloat16, as the decode kernel and flash attention round them) in pairs;
// elsewhere everything is widened to float32 first. An 8-bit cache's tiles are widened as they are
// copied out of the cache.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#include "amx.h"
#include "kv_cache.h"
#include "vectors.h"

namespace {

constexpr int64_t kQueryTile = 64;  // query tokens an item takes: G x 64 lanes, whole groups of 4 vectors
constexpr int64_t kKeyTile = 32;    // keys scored, then weighed, at a time (even: bfloat16 pairs them)
constexpr int64_t kAmxKeyTile = 128;  // the same on AMX tiles at most: 8 blocks of 16 keys, 4 tiles of 32 weights
// ...and at head size D: 16 KiB of keys and as much of values (then, with the scores, weights and the
// queries, the tile stays in L1; 128 keys at D = 128 spilled to L2: docs/benchmarks.md).
template <int D>
constexpr int64_t kAmxKeys = std::min<int64_t>(kAmxKeyTile, 8192 / D);
constexpr int64_t kAmxQueryTile = 64;  // query tokens an AMX item takes: its buffers then stay in L1
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kMaxSlack = 8.f;  // log2 units: weights up to 2^8 before the running max moves

// 2^x on each lane: 2^n * 2^f with an integer n and a polynomial for 2^f (fitted here for relative
// error); 0 for -inf (masked scores) and, flushed, below 2^-126. Degree 5 for float32 (at most 1.6e-7
// on AVX-512, 2.4e-7 elsewhere: tests/ops/test_prefill_attention.py measures it), 3 where the weights
// are rounded to bfloat16 next (7.5e-5, under a fiftieth of that rounding; AVX512-BF16 only).
template <int Degree = 5>
__attribute__((always_inline)) inline vfloat exp2_lanes(vfloat x) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  static_assert(Degree == 5 || Degree == 3);
  // n = floor(x), f = x - n in [0, 1): vreduceps takes f in one instruction (0 for -inf), and
  // vscalefps floors its exponent operand itself (-inf gives 0, NaN stays NaN). Results below 2^-126
  // would be subnormal, which costs a microcode assist on some CPUs: the kernel's threads flush them
  // to zero (`FlushToZero`).
  const vfloat f = (vfloat)_mm512_mask_reduce_ps((__m512)x, 0xffff, (__m512)x,  // (masked: GCC 12 warns of
                                                 _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // the plain form)
  vfloat p;
  if constexpr (Degree == 5) {
    p = splat(1.8775678e-3f);
    p = p * f + 8.9893416e-3f;
    p = p * f + 5.5826340e-2f;
    p = p * f + 2.4015360e-1f;
    p = p * f + 6.9315308e-1f;
    p = p * f + 9.9999994e-1f;
  } else {
    p = splat(7.8023434e-2f);
    p = p * f + 2.2606651e-1f;
    p = p * f + 6.9583499e-1f;
    p = p * f + 9.9992496e-1f;
  }
  return (vfloat)_mm512_mask_scalef_ps((__m512)p, 0xffff, (__m512)p, (__m512)x);
#else
  static_assert(Degree == 5, "the bfloat16 pairs (degree 3) imply AVX-512");
  // n = round(x), |f| <= 1/2.
  const vint underflow = x < -125.f;
  x = underflow ? splat(-125.f) : x;
  const vfloat n = (x + 12582912.f) - 12582912.f;  // 1.5 * 2^23: rounds to the nearest integer
  const vfloat f = x - n;
  vfloat p = splat(1.3276471291e-3f);
  p = p * f + 9.6755409613e-3f;
  p = p * f + 5.5507130921e-2f;
  p = p * f + 2.4022120237e-1f;
  p = p * f + 6.9314694405e-1f;
  p = p * f + 1.0000001192e+0f;
  const vint exponent = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat power;
  std::memcpy(&power, &exponent, sizeof power);
  return underflow ? splat(0.f) : p * power;
#endif
}

// Subnormal results flushed to zero on this thread while it lives (MXCSR's FTZ bit), then the bit
// as it was: exp2_lanes leaves its smallest results to it.
class FlushToZero {
#if defined(__SSE__)
 public:
  FlushToZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | _MM_FLUSH_ZERO_ON); }
  ~FlushToZero() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

__attribute__((always_inline)) inline bool any_lane(vint mask) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#else
  for (int i = 0; i < kLanes; ++i)
    if (mask[i]) return true;
  return false;
#endif
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  const uint32_t bits = uint32_t(x.bits) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// x on every lane, one broadcast (splat's 0 + x is an add GCC must keep: -0 + 0 is +0).
__attribute__((always_inline)) inline vfloat broadcast(float x) { return x - vfloat{}; }

// Keeps v in a register: GCC otherwise folds the load of a value the micro-kernels use several times
// into each multiply-add, and then loads it again for each (one load per FMA: the loads were the bound).
#if defined(__x86_64__)
#define IN_REGISTER(v) asm("" : "+v"(v))
#elif defined(__aarch64__)
#define IN_REGISTER(v) asm("" : "+w"(v))
#else
#define IN_REGISTER(v) (void)(v)
#endif

// `dim` elements of the cache's type C as W (float32, or bfloat16 where the pairs are multiplied).
template <typename W, typename C> __attribute__((always_inline)) inline void convert_row(W* dst, const C* src, int64_t dim) {
  if constexpr (std::is_same_v<W, C>) std::memcpy(dst, src, dim * sizeof(W));
  else
    for (int64_t i = 0; i < dim; i += kLanes) store(dst + i, load(src + i));
}

// Zeroed floats on whole cache lines: a load whose rows straddle two lines (an AMX tile's, of a
// std::vector's 16-byte alignment) took 6x as long.
class LineBuffer {
 public:
  explicit LineBuffer(int64_t size)
      : size_(size), data_(static_cast<float*>(std::aligned_alloc(64, (size * sizeof(float) + 63) / 64 * 64))) {
    if (data_ == nullptr) throw std::bad_alloc();
    std::fill(begin(), end(), 0.f);
  }
  float* data() const { return data_.get(); }
  float* begin() const { return data(); }
  float* end() const { return data() + size_; }
  int64_t size() const { return size_; }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  int64_t size_;
  std::unique_ptr<float, Free> data_;
};

// Each thread's buffers for one item (M = G x kQueryTile lanes): the queries transposed (a dim's
// values of all lanes together), the output likewise, a tile's scores and weights [key][lane], its
// keys and values, and the softmax's running max and sum per lane.
struct Scratch {
  LineBuffer queries, output, scores, weights, keys, values, value_rows, max, sum;
  static constexpr int64_t kTile = std::max(kKeyTile, kAmxKeyTile);
  Scratch(int64_t lanes, int64_t dim)
      : queries(dim * lanes), output(dim * lanes), scores(kTile * lanes), weights(kTile * lanes),
        keys(kTile * dim), values(kTile * dim), value_rows(kTile * dim), max(lanes), sum(lanes) {}
};

// Register blocks: key rows (or output dims) x lane vectors. 16 accumulators where there are 32
// vector registers (AVX-512, NEON), 8 where there are 16 (AVX2, SSE).
constexpr int kLaneBlock = 4;
constexpr int kRowBlock = kLanes == 16 ? 4 : 2;

// scores[k][lane] = scale * q[lane] . key[k] for the tile's first `count` keys (rounded up to whole
// row blocks: the rows past `count` are zeros), float32.
template <int D>
__attribute__((optimize("fp-contract=fast")))
void tile_scores(float* scores, const float* queries, const float* keys, int64_t lanes, int64_t count, float scale) {
  for (int64_t j0 = 0; j0 < lanes; j0 += kLaneBlock * kLanes)
    for (int64_t k0 = 0; k0 < count; k0 += kRowBlock) {
      vfloat acc[kRowBlock][kLaneBlock] = {};
      for (int d = 0; d < D; ++d) {
        vfloat q[kLaneBlock];
        for (int j = 0; j < kLaneBlock; ++j) {
          q[j] = load(queries + d * lanes + j0 + j * kLanes);
          IN_REGISTER(q[j]);
        }
        for (int k = 0; k < kRowBlock; ++k) {
          const vfloat key = broadcast(keys[(k0 + k) * D + d]);
          for (int j = 0; j < kLaneBlock; ++j) acc[k][j] += q[j] * key;
        }
      }
      for (int k = 0; k < kRowBlock; ++k)
        for (int j = 0; j < kLaneBlock; ++j) store(scores + (k0 + k) * lanes + j0 + j * kLanes, acc[k][j] * scale);
    }
}

// output[d][lane] += sum over the tile's keys k of weights[k][lane] * values[k][d], float32.
template <int D>
__attribute__((optimize("fp-contract=fast")))
void tile_output(float* output, const float* weights, const float* values, int64_t lanes, int64_t count) {
  for (int64_t j0 = 0; j0 < lanes; j0 += kLaneBlock * kLanes)
    for (int d0 = 0; d0 < D; d0 += kRowBlock) {
      vfloat acc[kRowBlock][kLaneBlock];
      for (int r = 0; r < kRowBlock; ++r)
        for (int j = 0; j < kLaneBlock; ++j) acc[r][j] = load(output + (d0 + r) * lanes + j0 + j * kLanes);
      for (int64_t k = 0; k < count; ++k) {
        vfloat w[kLaneBlock];
        for (int j = 0; j < kLaneBlock; ++j) {
          w[j] = load(weights + k * lanes + j0 + j * kLanes);
          IN_REGISTER(w[j]);
        }
        for (int r = 0; r < kRowBlock; ++r) {
          const vfloat value = broadcast(values[k * D + d0 + r]);
          for (int j = 0; j < kLaneBlock; ++j) acc[r][j] += w[j] * value;
        }
      }
      for (int r = 0; r < kRowBlock; ++r)
        for (int j = 0; j < kLaneBlock; ++j) store(output + (d0 + r) * lanes + j0 + j * kLanes, acc[r][j]);
    }
}

#if defined(__AVX512BF16__)
static_assert(kLanes == 16, "AVX512-BF16 implies AVX-512's 16 float lanes");

// tile_scores on bfloat16 pairs: queries [D / 2][lane] and keys [k][D / 2] hold two consecutive
// dims in 32 bits (the keys as the cache lays them out), and vdpbf16ps adds both products per lane.
template <int D>
__attribute__((optimize("fp-contract=fast")))
void tile_scores_pairs(float* scores, const uint32_t* queries, const uint32_t* keys, int64_t lanes, int64_t count,
                       float scale) {
  constexpr int kRows = 4;
  for (int64_t j0 = 0; j0 < lanes; j0 += kLaneBlock * kLanes)
    for (int64_t k0 = 0; k0 < count; k0 += kRows) {
      __m512 acc[kRows][kLaneBlock];
      for (int k = 0; k < kRows; ++k)
        for (int j = 0; j < kLaneBlock; ++j) acc[k][j] = _mm512_setzero_ps();
      for (int d = 0; d < D / 2; ++d) {
        __m512bh q[kLaneBlock];
        for (int j = 0; j < kLaneBlock; ++j) {
          q[j] = (__m512bh)_mm512_loadu_si512(queries + d * lanes + j0 + j * kLanes);
          IN_REGISTER(q[j]);
        }
        for (int k = 0; k < kRows; ++k) {
          const __m512bh key = (__m512bh)_mm512_set1_epi32(int(keys[(k0 + k) * D / 2 + d]));
          for (int j = 0; j < kLaneBlock; ++j) acc[k][j] = _mm512_dpbf16_ps(acc[k][j], q[j], key);
        }
      }
      for (int k = 0; k < kRows; ++k)
        for (int j = 0; j < kLaneBlock; ++j)
          store(scores + (k0 + k) * lanes + j0 + j * kLanes, (vfloat)acc[k][j] * scale);
    }
}

// tile_output on bfloat16 pairs: weights [k / 2][lane] and values [k / 2][d] hold two consecutive
// keys' in 32 bits.
template <int D>
__attribute__((optimize("fp-contract=fast")))
void tile_output_pairs(float* output, const uint32_t* weights, const uint32_t* values, int64_t lanes, int64_t count) {
  constexpr int kDims = 4;
  for (int64_t j0 = 0; j0 < lanes; j0 += kLaneBlock * kLanes)
    for (int d0 = 0; d0 < D; d0 += kDims) {
      __m512 acc[kDims][kLaneBlock];
      for (int r = 0; r < kDims; ++r)
        for (int j = 0; j < kLaneBlock; ++j) acc[r][j] = _mm512_loadu_ps(output + (d0 + r) * lanes + j0 + j * kLanes);
      for (int64_t k = 0; k < (count + 1) / 2; ++k) {
        __m512bh w[kLaneBlock];
        for (int j = 0; j < kLaneBlock; ++j) {
          w[j] = (__m512bh)_mm512_loadu_si512(weights + k * lanes + j0 + j * kLanes);
          IN_REGISTER(w[j]);
        }
        for (int r = 0; r < kDims; ++r) {
          const __m512bh value = (__m512bh)_mm512_set1_epi32(int(values[k * D + d0 + r]));
          for (int j = 0; j < kLaneBlock; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], value);
        }
      }
      for (int r = 0; r < kDims; ++r)
        for (int j = 0; j < kLaneBlock; ++j) _mm512_storeu_ps(output + (d0 + r) * lanes + j0 + j * kLanes, acc[r][j]);
    }
}
#endif

__attribute__((always_inline)) inline vuint bits_of(vfloat v) {
  vuint u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// The online softmax over a tile's scores (log2 units) for one vector of lanes: the running max moves
// where the tile passes it by more than kMaxSlack (the output and sum scaled down to the new max), then
// each score's weight 2^(score - max) joins the sum. Scores and weights are rows `stride` floats apart
// (one per key, or per pair of keys), the output rows `output_stride`; every pointer is at the lanes'.
// Pairs: the weights rounded to bfloat16, two keys' in 32 bits. Scaled: the scores are plain dot
// products (AMX's), each multiplied by `scale` as it is read.
template <bool Pairs, bool Scaled = false>
__attribute__((optimize("fp-contract=fast"), always_inline))
inline void softmax_lanes(float* weights, const float* scores, int64_t stride, float* max, float* sum, float* output,
                          int64_t output_stride, int64_t dim, int64_t count, float scale) {
  // Scaled: the max is taken of the plain scores (scale > 0) and each weight is 2^(s * scale - max), one FMA.
  const vfloat factor = splat(Scaled ? scale : 1.f);
  const auto weight = [&](int64_t k, vfloat running_max) {
    const vfloat s = load(scores + k * stride);
    return exp2_lanes<Pairs ? 3 : 5>(Scaled ? s * factor - running_max : s - running_max);
  };
  // Four running maxima: one would make a chain of dependent max instructions, one a key.
  vfloat maxima[4] = {splat(-INFINITY), splat(-INFINITY), splat(-INFINITY), splat(-INFINITY)};
  int64_t k = 0;
  for (; k + 4 <= count; k += 4)
    for (int i = 0; i < 4; ++i) {
      const vfloat s = load(scores + (k + i) * stride);
      maxima[i] = s > maxima[i] ? s : maxima[i];
    }
  for (; k < count; ++k) {
    const vfloat s = load(scores + k * stride);
    maxima[0] = s > maxima[0] ? s : maxima[0];
  }
  maxima[0] = maxima[0] > maxima[1] ? maxima[0] : maxima[1];
  maxima[2] = maxima[2] > maxima[3] ? maxima[2] : maxima[3];
  vfloat tile_max = maxima[0] > maxima[2] ? maxima[0] : maxima[2];
  if constexpr (Scaled) tile_max *= factor;
  vfloat running_max = load(max), total = load(sum);
  if (any_lane(tile_max > running_max + kMaxSlack)) {
    const vfloat new_max = tile_max > running_max ? tile_max : running_max;
    const vfloat correction = exp2_lanes(running_max - new_max);
    total *= correction;
    for (int64_t d = 0; d < dim; ++d) store(output + d * output_stride, load(output + d * output_stride) * correction);
    running_max = new_max;
    store(max, running_max);
  }
  if constexpr (Pairs) {
    uint32_t* pairs = reinterpret_cast<uint32_t*>(weights);
    for (int64_t k = 0; k < count; k += 2) {
      const vfloat first = weight(k, running_max);
      const vfloat second = k + 1 < count ? weight(k + 1, running_max) : splat(0.f);
#if defined(__AVX512BF16__)
      // Both rounded to bfloat16 in one instruction ([first's 16 | second's 16]), then interleaved. The
      // sum takes them unrounded, as torch's flash attention does (unpacking the rounded ones took 3 more
      // instructions a pair).
      const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                  23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)second, (__m512)first);
      const __m512i pair_bits = _mm512_permutexvar_epi16(interleave, both);
      vuint pair;
      std::memcpy(&pair, &pair_bits, sizeof pair);
      total += first + second;
#else
      const vfloat first_rounded = round_to<bf16>(first), second_rounded = round_to<bf16>(second);
      total += first_rounded + second_rounded;
      const vuint pair = (bits_of(first_rounded) >> 16) | (bits_of(second_rounded) & 0xffff0000u);
#endif
      std::memcpy(pairs + k / 2 * stride, &pair, sizeof pair);
    }
  } else {
    for (int64_t k = 0; k < count; ++k) {
      const vfloat w = weight(k, running_max);
      total += w;
      store(weights + k * stride, w);
    }
  }
  store(sum, total);
}

// softmax_lanes for every vector of a tile's lanes: scores and weights [key][lane], output [dim][lane].
template <bool Pairs>
void tile_softmax(float* weights, const float* scores, float* max, float* sum, float* output, int64_t lanes,
                  int64_t dim, int64_t count) {
  for (int64_t j = 0; j < lanes; j += kLanes)
    softmax_lanes<Pairs>(weights + j, scores + j, lanes, max + j, sum + j, output + j, lanes, dim, count, 1.f);
}

#if defined(TRITONLLM_AMX)
// AMX (Sapphire Rapids on): eight tile registers of up to 16 rows x 64 bytes, and TDPBF16PS, which adds
// A [16][32 bfloat16] x B [16 pairs][16 x 2 bfloat16] into C [16][16 float32] in one instruction (B
// pairs two consecutive k of each column in 32 bits, as `queries` and `weights` hold them). Both
// products of an item run on it, transposed so that the softmax keeps its layout (lanes in vectors):
// scores^T [key][lane] = keys [key][dim] x queries^T, keys' rows read as the A operand as they lie;
// output^T [dim][lane] += values^T [dim][key] x weights^T, the values transposed once per tile.
// All eight tiles are configured 16 rows x 64 bytes (configure_tiles, amx.h).


// A tile's scores and output run four accumulators (tiles 4-7) at a time, so that consecutive
// TDPBF16PS never wait on each other's result (each takes several times its issue interval), with the
// A operands alternating between tiles 0 and 1 and the B operands between 2 and 3.

// One vector's worth of lanes (16) at a time, scores, softmax and output in turn, so that the scores
// and weights between them stay in L1 (a whole tile's, 128 keys x G x 64 lanes, passed through L2).

// scores[k][16 lanes] = keys[k] . q[lane] for the tile's kAmxKeys<D> keys, 64 at a time (unscaled;
// rows past the tile's keys are left as they come out); queries [D / 2][lane] in pairs (rows `lanes`
// apart, at the 16 lanes' first), keys in groups of 16 rows [16][D] bfloat16.
template <int D>
void amx_lane_scores(float* scores, const uint32_t* queries, const bf16* const* key_groups, int64_t lanes) {
  static_assert((D == 64 || D == 128) && kAmxKeys<D> % 64 == 0);
  const int64_t stride = lanes * 4;
  constexpr int64_t kOut = 16 * 4;  // bytes
  for (int64_t k0 = 0; k0 < kAmxKeys<D>; k0 += 64) {
    float* out = scores + k0 * 16;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int c = 0; c < D / 32; c += 2) {  // 32 dims a step: A [16 keys][32 dims], B [16 dim pairs][16 lanes]
      const bf16* const* group = key_groups + k0 / 16;
      const int dims = c * 32;
      _tile_loadd(2, queries + c * 16 * lanes, stride);
      _tile_loadd(0, group[0] + dims, D * 2);
      _tile_dpbf16ps(4, 0, 2);
      _tile_loadd(1, group[1] + dims, D * 2);
      _tile_dpbf16ps(5, 1, 2);
      _tile_loadd(0, group[2] + dims, D * 2);
      _tile_dpbf16ps(6, 0, 2);
      _tile_loadd(1, group[3] + dims, D * 2);
      _tile_dpbf16ps(7, 1, 2);
      _tile_loadd(3, queries + (c + 1) * 16 * lanes, stride);
      _tile_loadd(0, group[0] + dims + 32, D * 2);
      _tile_dpbf16ps(4, 0, 3);
      _tile_loadd(1, group[1] + dims + 32, D * 2);
      _tile_dpbf16ps(5, 1, 3);
      _tile_loadd(0, group[2] + dims + 32, D * 2);
      _tile_dpbf16ps(6, 0, 3);
      _tile_loadd(1, group[3] + dims + 32, D * 2);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, out, kOut);
    _tile_stored(5, out + 16 * 16, kOut);
    _tile_stored(6, out + 32 * 16, kOut);
    _tile_stored(7, out + 48 * 16, kOut);
  }
}

// output[d][lane] += sum over the tile's kAmxKeys<D> keys k of values_t[d][k] * weights[k][lane] for
// 16 lanes (output rows `lanes` apart, at the lanes' first); values_t [D][kAmxKeys<D>] bfloat16,
// weights [k / 2][16 lanes] in pairs (zeros past the tile's keys). Each accumulator is loaded and
// stored once a tile and takes kAmxKeys<D> / 32 products.
template <int D>
void amx_lane_output(float* output, const uint32_t* weights, const bf16* values_t, int64_t lanes) {
  const int64_t stride = lanes * 4;
  constexpr int64_t kRow = kAmxKeys<D> * 2, kWeights = 16 * 4;  // bytes
  for (int d = 0; d < D; d += 64) {
    float* out = output + d * lanes;
    _tile_loadd(4, out, stride);
    _tile_loadd(5, out + 16 * lanes, stride);
    _tile_loadd(6, out + 32 * lanes, stride);
    _tile_loadd(7, out + 48 * lanes, stride);
    for (int64_t k = 0; k < kAmxKeys<D>; k += 64) {
      const bf16* value = values_t + d * kAmxKeys<D> + k;
      _tile_loadd(2, weights + k / 2 * 16, kWeights);  // 32 keys: A [16 dims][32 keys], B [16 key pairs][16 lanes]
      _tile_loadd(0, value, kRow);
      _tile_dpbf16ps(4, 0, 2);
      _tile_loadd(1, value + 16 * kAmxKeys<D>, kRow);
      _tile_dpbf16ps(5, 1, 2);
      _tile_loadd(0, value + 32 * kAmxKeys<D>, kRow);
      _tile_dpbf16ps(6, 0, 2);
      _tile_loadd(1, value + 48 * kAmxKeys<D>, kRow);
      _tile_dpbf16ps(7, 1, 2);
      _tile_loadd(3, weights + (k / 2 + 16) * 16, kWeights);  // the next 32
      _tile_loadd(0, value + 32, kRow);
      _tile_dpbf16ps(4, 0, 3);
      _tile_loadd(1, value + 16 * kAmxKeys<D> + 32, kRow);
      _tile_dpbf16ps(5, 1, 3);
      _tile_loadd(0, value + 32 * kAmxKeys<D> + 32, kRow);
      _tile_dpbf16ps(6, 0, 3);
      _tile_loadd(1, value + 48 * kAmxKeys<D> + 32, kRow);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, out, stride);
    _tile_stored(5, out + 16 * lanes, stride);
    _tile_stored(6, out + 32 * lanes, stride);
    _tile_stored(7, out + 48 * lanes, stride);
  }
}

// values_t [D][kAmxKeys<D>] from the tile's groups of 16 value rows [16][D]. 16 x 16 blocks of
// 32-bit pairs of dims are transposed in registers, then each row of pairs splits into its two dims' rows.
template <int D>
void transpose_values(bf16* values_t, const bf16* const* value_groups) {
  for (int64_t k0 = 0; k0 < kAmxKeys<D>; k0 += 16)
    for (int d0 = 0; d0 < D; d0 += 32) {
      // (Written as GCC vector shuffles: the intrinsics' undefined pass-through draws GCC 12 warnings.)
      const bf16* rows = value_groups[k0 / 16];
      vuint r[16], t[16];
      for (int i = 0; i < 16; ++i) std::memcpy(&r[i], rows + i * D + d0, sizeof r[i]);  // 16 pairs of dims
      for (int i = 0; i < 16; i += 2) {  // 32-bit unpacks within each 128-bit lane
        t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
        t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
      }
      for (int i = 0; i < 16; i += 4)  // 64-bit unpacks
        for (int h = 0; h < 2; ++h) {
          r[i + h] = __builtin_shufflevector(t[i + h], t[i + 2 + h], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                                             28, 29);
          r[i + 2 + h] = __builtin_shufflevector(t[i + h], t[i + 2 + h], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27,
                                                 14, 15, 30, 31);
        }
      for (int i = 0; i < 16; i += 8)  // 128-bit lanes: even ones, then odd ones
        for (int h = 0; h < 4; ++h) {
          t[i + h] = __builtin_shufflevector(r[i + h], r[i + 4 + h], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                             26, 27);
          t[i + 4 + h] = __builtin_shufflevector(r[i + h], r[i + 4 + h], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23,
                                                 28, 29, 30, 31);
        }
      for (int h = 0; h < 8; ++h) {
        r[h] = __builtin_shufflevector(t[h], t[8 + h], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
        r[8 + h] = __builtin_shufflevector(t[h], t[8 + h], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
      }
      // r[x] now holds one column of pairs for the 16 keys: column (x & 12) + (0, 2, 1, 3)[x & 3] (the
      // 64-bit unpacks leave the middle two swapped); its two dims' rows are written.
      for (int x = 0; x < 16; ++x) {
        const int pair = (x & 12) | (x & 1) << 1 | (x >> 1 & 1);
        const vhalf low = __builtin_convertvector(r[x], vhalf);
        const vhalf high = __builtin_convertvector(r[x] >> 16, vhalf);
        std::memcpy(values_t + (d0 + 2 * pair) * kAmxKeys<D> + k0, &low, sizeof low);
        std::memcpy(values_t + (d0 + 2 * pair + 1) * kAmxKeys<D> + k0, &high, sizeof high);
      }
    }
}
#endif

// Where a chunk's work lies: its queries [tokens, heads, dim] (token rows `query_stride` apart),
// its output [tokens, heads, dim], its block table, and how many positions precede its first token.
template <typename T, typename C>
struct Chunk {
  T* out;
  const T* query;
  int64_t query_stride;
  const C* cache;
  const int32_t* table;
  int64_t tokens, cached, heads, kv_heads, head_cache, block_size;
  float scale, value_scale;  // scale: log2 units, and an 8-bit cache's key factor
};

// The causal mask on one vector of lanes: the scores (rows `stride` apart, one a key from `start`)
// of keys past each lane's position (the first lane's `position`, the next lanes' one after another)
// set to -inf.
inline void mask_lanes(float* scores, int64_t stride, int64_t position, int64_t start, int64_t keys) {
  vint lane_position;
  for (int i = 0; i < kLanes; ++i) lane_position[i] = int32_t(position) + i;
  for (int64_t k = 0; k < keys; ++k) {
    const vfloat s = load(scores + k * stride);
    store(scores + k * stride, int32_t(start + k) > lane_position ? splat(-INFINITY) : s);
  }
}

// What every query tile of a chunk reads alike, prepared once a call where a chunk has several query
// tiles and this fits kPreparedBytes (`prepare_tiles`): each KV head's value tiles transposed, and
// where the cache cannot be read in place, its key tiles as bfloat16 rows. Without it, each item
// prepares its own, tile by tile (the transpose then repeated for every query tile).
struct Prepared {
  const bf16* values_t = nullptr;  // [kv_heads][tiles][D][kAmxKeys<D>], or null: each item's own
  const bf16* keys = nullptr;      // [kv_heads][tiles][kAmxKeys<D>][D], or null: read in place (or each item's own)
  int64_t tiles = 0;
};
constexpr int64_t kPreparedBytes = int64_t(64) << 20;

#if defined(TRITONLLM_AMX)
// A key tile's 16-key groups as AMX reads them: where they lie (a block's rows, for a bfloat16 cache
// in blocks of whole 16s, `in_place`; AMX loads 16 rows at any stride) or copied to `keys` and
// `value_rows` [kAmxKeys<D>][D] (widened from 8 bits, zeros past `end`).
template <typename C, int D>
void tile_groups(const Chunk<bf16, C>& chunk, int64_t kv_head, int64_t start, int64_t end, bool in_place, bf16* keys,
                 bf16* value_rows, const bf16** key_groups, const bf16** value_groups) {
  const C* key_cache = chunk.cache + kv_head * chunk.head_cache;
  const C* value_cache = chunk.cache + (chunk.kv_heads + kv_head) * chunk.head_cache;
  for (int64_t g = 0; g < kAmxKeys<D> / 16; ++g) {
    const int64_t first_key = start + g * 16;
    if (in_place && first_key + 16 <= end) {
      const int64_t row = row_of(chunk.table, first_key, chunk.block_size) * D;
      key_groups[g] = reinterpret_cast<const bf16*>(key_cache + row);
      value_groups[g] = reinterpret_cast<const bf16*>(value_cache + row);
      continue;
    }
    bf16* group_keys = keys + g * 16 * D;
    bf16* group_values = value_rows + g * 16 * D;
    const int64_t rows = std::clamp<int64_t>(end - first_key, 0, 16);
    for (int64_t k = 0; k < rows; ++k) {
      const int64_t row = row_of(chunk.table, first_key + k, chunk.block_size) * D;
      convert_row(group_keys + k * D, key_cache + row, D);
      convert_row(group_values + k * D, value_cache + row, D);
    }
    std::fill(group_keys + rows * D, group_keys + 16 * D, bf16{});
    std::fill(group_values + rows * D, group_values + 16 * D, bf16{});
    key_groups[g] = group_keys;
    value_groups[g] = group_values;
  }
}

// The cache of a bfloat16 chunk in blocks of whole 16s is read in place.
template <typename C>
bool reads_in_place(const Chunk<bf16, C>& chunk) {
  return std::is_same_v<C, bf16> && chunk.block_size % 16 == 0;
}

// Prepared tiles for the chunk's whole context, in the calling thread's buffer (kept for its next
// call: fresh pages each call took ~1 ms of page faults), or none (see Prepared).
template <typename C, int D>
Prepared prepare_tiles(const Chunk<bf16, C>& chunk, int64_t query_tiles) {
  const int64_t end = chunk.cached + chunk.tokens, tiles = (end + kAmxKeys<D> - 1) / kAmxKeys<D>;
  const bool in_place = reads_in_place(chunk);
  const int64_t tile_elements = kAmxKeys<D> * D, parts = in_place ? 1 : 2;
  const int64_t elements = chunk.kv_heads * tiles * tile_elements * parts;
  if (query_tiles < 2 || elements * int64_t(sizeof(bf16)) > kPreparedBytes) return {};
  thread_local std::unique_ptr<LineBuffer> buffer;
  if (!buffer || buffer->size() * 2 < elements) buffer = std::make_unique<LineBuffer>((elements + 1) / 2);
  bf16* values_t = reinterpret_cast<bf16*>(buffer->data());
  bf16* keys = in_place ? nullptr : values_t + chunk.kv_heads * tiles * tile_elements;
#pragma omp parallel
  {
    LineBuffer own_keys(tile_elements / 2), value_rows(tile_elements / 2);
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < chunk.kv_heads * tiles; ++unit) {
      const int64_t kv_head = unit / tiles, start = unit % tiles * kAmxKeys<D>;
      const bf16 *key_groups[kAmxKeys<D> / 16], *value_groups[kAmxKeys<D> / 16];
      tile_groups<C, D>(chunk, kv_head, start, end, in_place,
                        keys ? keys + unit * tile_elements : reinterpret_cast<bf16*>(own_keys.data()),
                        reinterpret_cast<bf16*>(value_rows.data()), key_groups, value_groups);
      transpose_values<D>(values_t + unit * tile_elements, value_groups);
    }
  }
  return {values_t, keys, tiles};
}

// attend_item's key tiles on AMX, kAmxKeys<D> keys at a time, and within a tile 16 lanes at a time
// (the scores, their softmax, the output), so that the scores and weights stay in L1 between them.
// The tiles come prepared (`prepared`) or are prepared here, one at a time, in `scratch`; the
// queries, output, running max and sum are the item's, in `scratch` too.
template <typename C, int D>
__attribute__((optimize("fp-contract=fast")))
void amx_tiles(const Chunk<bf16, C>& chunk, const Prepared& prepared, int64_t kv_head, int64_t first_position,
               int64_t end, int64_t lanes, Scratch& scratch) {
  constexpr int64_t kGroups = kAmxKeys<D> / 16, kTileElements = kAmxKeys<D> * D;
  const bool in_place = reads_in_place(chunk);
  const uint32_t* query_pairs = reinterpret_cast<const uint32_t*>(scratch.queries.data());
  float* output = scratch.output.data();
  float* scores = scratch.scores.data();  // [k][16 lanes]
  uint32_t* weights = reinterpret_cast<uint32_t*>(scratch.weights.data());  // [k / 2][16 lanes]
  for (int64_t start = 0; start < end; start += kAmxKeys<D>) {
    const int64_t keys_here = std::min(kAmxKeys<D>, end - start);
    const int64_t unit = kv_head * prepared.tiles + start / kAmxKeys<D>;  // the tile's place in `prepared`
    const bf16 *key_groups[kGroups], *value_groups[kGroups];
    if (prepared.keys) {
      for (int64_t g = 0; g < kGroups; ++g) key_groups[g] = prepared.keys + unit * kTileElements + g * 16 * D;
    } else {
      tile_groups<C, D>(chunk, kv_head, start, end, in_place, reinterpret_cast<bf16*>(scratch.keys.data()),
                        reinterpret_cast<bf16*>(scratch.value_rows.data()), key_groups, value_groups);
      if (in_place)  // the next tile's rows into L2 meanwhile: they would otherwise come from L3 on demand
        for (int64_t first_key = start + kAmxKeys<D>; first_key < std::min(end, start + 2 * kAmxKeys<D>);
             first_key += 16) {
          const int64_t row = row_of(chunk.table, first_key, chunk.block_size) * D;
          for (int64_t part = 0; part < (prepared.values_t ? 1 : 2); ++part) {  // keys, then values unless prepared
            const char* bytes =
                reinterpret_cast<const char*>(chunk.cache + (part * chunk.kv_heads + kv_head) * chunk.head_cache + row);
            for (int64_t line = 0; line < 16 * D * 2; line += 64) _mm_prefetch(bytes + line, _MM_HINT_T1);
          }
        }
    }
    const bf16* values_t = reinterpret_cast<const bf16*>(scratch.values.data());
    if (prepared.values_t)
      values_t = prepared.values_t + unit * kTileElements;
    else
      transpose_values<D>(reinterpret_cast<bf16*>(scratch.values.data()), value_groups);
    std::fill(weights + (keys_here + 1) / 2 * 16, weights + kAmxKeys<D> / 2 * 16, 0u);  // zeros past the keys
    const bool causal = start + keys_here - 1 > first_position;  // the tile reaches the chunk's tokens
    for (int64_t j = 0; j < lanes; j += 16) {
      amx_lane_scores<D>(scores, query_pairs + j, key_groups, lanes);
      if (causal) mask_lanes(scores, 16, first_position + j % kAmxQueryTile, start, keys_here);
      softmax_lanes<true, true>(scratch.weights.data(), scores, 16, scratch.max.data() + j, scratch.sum.data() + j,
                                output + j, lanes, D, keys_here, chunk.scale);
      amx_lane_output<D>(output + j, weights, values_t, lanes);
    }
  }
}
#endif

// One item: query tokens [first, first + count) of KV head `kv_head`'s G query heads, over
// positions [0, cached + first + count) of the cache, causal for the tiles that reach the tokens.
// Amx (bfloat16 pairs only): both products on AMX tiles (`amx_tiles`).
template <typename T, typename C, bool Pairs, int D, bool Amx = false>
__attribute__((optimize("fp-contract=fast")))
void attend_item(const Chunk<T, C>& chunk, const Prepared& prepared, int64_t kv_head, int64_t first,
                 Scratch& scratch) {
  static_assert(!Amx || Pairs);
  using W = std::conditional_t<Pairs, bf16, float>;  // what the tiles hold
  constexpr int64_t kTile = kKeyTile, kRows = 4;  // keys; rows filled (vectors: AMX tiles take their own)
  constexpr int64_t kTokens = Amx ? kAmxQueryTile : kQueryTile;
  const int64_t group = chunk.heads / chunk.kv_heads, lanes = group * kTokens;
  const int64_t count = std::min(kTokens, chunk.tokens - first);
  const int64_t first_position = chunk.cached + first, end = first_position + count;
  float* queries = scratch.queries.data();
  uint32_t* query_pairs = reinterpret_cast<uint32_t*>(queries);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t t = 0; t < kTokens; ++t) {
      const int64_t lane = g * kTokens + t;
      const T* row = chunk.query + (first + t) * chunk.query_stride + (kv_head * group + g) * D;
      if constexpr (Pairs) {
        uint32_t pairs[D / 2] = {};
        if (t < count) std::memcpy(pairs, row, sizeof pairs);
        for (int d = 0; d < D / 2; ++d) query_pairs[d * lanes + lane] = pairs[d];
      } else {
        for (int d = 0; d < D; ++d) queries[d * lanes + lane] = t < count ? to_float(row[d]) : 0.f;
      }
    }
  float* output = scratch.output.data();
  std::fill(output, output + D * lanes, 0.f);
  std::fill(scratch.max.begin(), scratch.max.end(), -INFINITY);
  std::fill(scratch.sum.begin(), scratch.sum.end(), 0.f);
  W* keys = reinterpret_cast<W*>(scratch.keys.data());
  W* value_rows = reinterpret_cast<W*>(Pairs ? scratch.value_rows.data() : scratch.values.data());
  const C* key_cache = chunk.cache + kv_head * chunk.head_cache;
  const C* value_cache = chunk.cache + (chunk.kv_heads + kv_head) * chunk.head_cache;
  float* scores = scratch.scores.data();
#if defined(TRITONLLM_AMX)
  if constexpr (Amx) amx_tiles<C, D>(chunk, prepared, kv_head, first_position, end, lanes, scratch);
#endif
  for (int64_t start = 0; start < end && !Amx; start += kTile) {
    const int64_t keys_here = std::min(kTile, end - start);
    for (int64_t k = 0; k < keys_here; ++k) {
      const int64_t row = row_of(chunk.table, start + k, chunk.block_size) * D;
      convert_row(keys + k * D, key_cache + row, D);
      convert_row(value_rows + k * D, value_cache + row, D);
    }
    const int64_t filled = std::min(kTile, (keys_here + kRows - 1) / kRows * kRows);  // whole row blocks
    std::fill(keys + keys_here * D, keys + filled * D, W{});
    std::fill(value_rows + keys_here * D, value_rows + filled * D, W{});
#if defined(__AVX512BF16__)
    if constexpr (Pairs && !Amx) {
      uint32_t* values = reinterpret_cast<uint32_t*>(scratch.values.data());  // [k / 2][d]: keys 2i, 2i + 1
      for (int64_t k = 0; k < keys_here; k += 2)
        for (int d = 0; d < D; d += kLanes) {
          vhalf low, high;
          std::memcpy(&low, value_rows + k * D + d, sizeof low);
          std::memcpy(&high, value_rows + (k + 1) * D + d, sizeof high);
          const vuint pair = __builtin_convertvector(low, vuint) | (__builtin_convertvector(high, vuint) << 16);
          std::memcpy(values + k / 2 * D + d, &pair, sizeof pair);
        }
      tile_scores_pairs<D>(scores, query_pairs, reinterpret_cast<const uint32_t*>(keys), lanes, keys_here, chunk.scale);
    }
#endif
    if constexpr (!Pairs) tile_scores<D>(scores, queries, keys, lanes, keys_here, chunk.scale);
    if (start + keys_here - 1 > first_position)  // the tile reaches the chunk's tokens
      for (int64_t j = 0; j < lanes; j += kLanes)
        mask_lanes(scores + j, lanes, first_position + j % kTokens, start, keys_here);
    tile_softmax<Pairs>(scratch.weights.data(), scores, scratch.max.data(), scratch.sum.data(), output, lanes, D,
                        keys_here);
#if defined(__AVX512BF16__)
    if constexpr (Pairs && !Amx)
      tile_output_pairs<D>(output, reinterpret_cast<const uint32_t*>(scratch.weights.data()),
                           reinterpret_cast<const uint32_t*>(scratch.values.data()), lanes, keys_here);
#endif
    if constexpr (!Pairs) tile_output<D>(output, scratch.weights.data(), scratch.values.data(), lanes, keys_here);
  }
  alignas(64) float row[D];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t t = 0; t < count; ++t) {
      const int64_t lane = g * kTokens + t;
      const float factor = chunk.value_scale / scratch.sum.data()[lane];
      for (int d = 0; d < D; ++d) row[d] = output[d * lanes + lane] * factor;
      T* out = chunk.out + ((first + t) * chunk.heads + kv_head * group + g) * D;
      for (int d = 0; d < D; d += kLanes) store(out + d, load(row + d));
    }
}

// A chunk of `tokens` queries [tokens, heads, dim] (token rows query_stride apart, heads packed)
// at positions [context_len - tokens, context_len) of the sequence whose blocks `table` lists,
// attending causally to every position up to their own; cache [2, kv_heads, num_blocks,
// block_size, dim] of T or 8-bit C; out [tokens, heads, dim]. dim 64 or 128 (the Python side
// checks). Items are taken from the last query tile down (the most keys first), one at a time.
AmxSwitch prefill_amx;  // bfloat16 chunks on AMX tiles

template <typename T, typename C = T>
void prefill_attention(T* out, const T* query, int64_t query_stride, const C* cache, const int32_t* table,
                       int64_t tokens, int64_t context_len, int64_t heads, int64_t kv_heads, int64_t dim,
                       int64_t num_blocks, int64_t block_size, float scale, float value_scale = 1.f) {
  const Chunk<T, C> chunk{out, query, query_stride, cache, table, tokens, context_len - tokens, heads, kv_heads,
                          num_blocks * block_size * dim, block_size, scale * kLog2e, value_scale};
#if defined(__AVX512BF16__)
  constexpr bool pairs = std::is_same_v<T, bf16>;
#else
  constexpr bool pairs = false;
#endif
  auto item = dim == 64 ? attend_item<T, C, pairs, 64> : attend_item<T, C, pairs, 128>;
  bool amx = false;
#if defined(TRITONLLM_AMX)
  if constexpr (pairs) {
    amx = prefill_amx.on();
    if (amx) item = dim == 64 ? attend_item<T, C, true, 64, true> : attend_item<T, C, true, 128, true>;
  }
#endif
  const int64_t query_tile = amx ? kAmxQueryTile : kQueryTile;
  const int64_t query_tiles = (tokens + query_tile - 1) / query_tile, items = query_tiles * kv_heads;
  Prepared prepared;
#if defined(TRITONLLM_AMX)
  if constexpr (pairs)
    if (amx) prepared = dim == 64 ? prepare_tiles<C, 64>(chunk, query_tiles) : prepare_tiles<C, 128>(chunk, query_tiles);
#endif
  std::atomic<int64_t> claimed{0};
#pragma omp parallel if (items > 1)
  {
#if defined(TRITONLLM_AMX)
    if (amx) configure_tiles();  // each thread's own tile registers
#endif
    [[maybe_unused]] const FlushToZero flush_to_zero;
    Scratch scratch(heads / kv_heads * query_tile, dim);
    for (int64_t i = claimed++; i < items; i = claimed++)
      item(chunk, prepared, i % kv_heads, (query_tiles - 1 - i / kv_heads) * query_tile, scratch);
#if defined(TRITONLLM_AMX)
    if (amx) _tile_release();
#endif
  }
  (void)amx;
}

}  // namespace

#define EXPORT_PREFILL(T, SUFFIX)                                                                         \
  extern "C" void prefill_attention_##SUFFIX(void* out, const void* query, int64_t query_stride,          \
                                             const void* cache, const int32_t* table, int64_t tokens,     \
                                             int64_t context_len, int64_t heads, int64_t kv_heads,        \
                                             int64_t dim, int64_t num_blocks, int64_t block_size,         \
                                             float scale) {                                               \
    prefill_attention<T>((T*)out, (const T*)query, query_stride, (const T*)cache, table, tokens,          \
                         context_len, heads, kv_heads, dim, num_blocks, block_size, scale);               \
  }                                                                                                       \
  extern "C" void prefill_attention_fp8_##SUFFIX(void* out, const void* query, int64_t query_stride,      \
                                                 const void* cache, const int32_t* table, int64_t tokens, \
                                                 int64_t context_len, int64_t heads, int64_t kv_heads,    \
                                                 int64_t dim, int64_t num_blocks, int64_t block_size,     \
                                                 float scale, int64_t e5m2_codes, float k_scale,          \
                                                 float v_scale) {                                         \
    if (e5m2_codes)                                                                                       \
      prefill_attention<T, e5m2>((T*)out, (const T*)query, query_stride, (const e5m2*)cache, table,       \
                                 tokens, context_len, heads, kv_heads, dim, num_blocks, block_size,       \
                                 scale * k_scale, v_scale);                                               \
    else                                                                                                  \
      prefill_attention<T, e4m3>((T*)out, (const T*)query, query_stride, (const e4m3*)cache, table,       \
                                 tokens, context_len, heads, kv_heads, dim, num_blocks, block_size,       \
                                 scale * k_scale * Fp8Format<e4m3>::kUnit,                                \
                                 v_scale * Fp8Format<e4m3>::kUnit);                                       \
  }

EXPORT_PREFILL(float, f32)
EXPORT_PREFILL(bf16, bf16)

// Whether bfloat16 chunks run on AMX tiles: built for them, the kernel asked for them by `enable`
// (1 on, 0 off, -1 as it is) and the OS lending them.
extern "C" int64_t prefill_attention_amx(int64_t enable) { return prefill_amx.set(enable); }
