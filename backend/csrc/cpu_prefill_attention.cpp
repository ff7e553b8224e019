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
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kv_cache.h"
#include "vectors.h"

namespace {

constexpr int64_t kQueryTile = 64;  // query tokens an item takes: G x 64 lanes, whole groups of 4 vectors
constexpr int64_t kKeyTile = 32;    // keys scored, then weighed, at a time (even: bfloat16 pairs them)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kMaxSlack = 8.f;  // log2 units: weights up to 2^8 before the running max moves

// 2^x on each lane: 2^n * 2^f with n = round(x), |f| <= 1/2, and a degree-5 polynomial for 2^f
// (fitted here for relative error: at most 2.4e-7 in float32, tests/ops/test_prefill_attention.py
// measures it); 0 below 2^-125 (masked scores are -inf).
__attribute__((always_inline)) inline vfloat exp2_lanes(vfloat x) {
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
}

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

// Each thread's buffers for one item (M = G x kQueryTile lanes): the queries transposed (a dim's
// values of all lanes together), the output likewise, a tile's scores and weights [key][lane], its
// keys and values, and the softmax's running max and sum per lane.
struct Scratch {
  std::vector<float> queries, output, scores, weights, keys, values, value_rows, max, sum;
  Scratch(int64_t lanes, int64_t dim)
      : queries(dim * lanes), output(dim * lanes), scores(kKeyTile * lanes), weights(kKeyTile * lanes),
        keys(kKeyTile * dim), values(kKeyTile * dim), value_rows(kKeyTile * dim), max(lanes), sum(lanes) {}
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

// The online softmax over a tile's scores (log2 units): the running max moves where the tile passes
// it by more than kMaxSlack (the output and sum scaled down to the new max), then each score's
// weight 2^(score - max) joins the sum. Pairs: the weights rounded to bfloat16, two keys' in 32 bits.
template <bool Pairs>
__attribute__((optimize("fp-contract=fast")))
void tile_softmax(float* weights, const float* scores, float* max, float* sum, float* output, int64_t lanes,
                  int64_t dim, int64_t count) {
  for (int64_t j = 0; j < lanes; j += kLanes) {
    vfloat tile_max = splat(-INFINITY);
    for (int64_t k = 0; k < count; ++k) {
      const vfloat s = load(scores + k * lanes + j);
      tile_max = s > tile_max ? s : tile_max;
    }
    vfloat running_max = load(max + j), total = load(sum + j);
    if (any_lane(tile_max > running_max + kMaxSlack)) {
      const vfloat new_max = tile_max > running_max ? tile_max : running_max;
      const vfloat correction = exp2_lanes(running_max - new_max);
      total *= correction;
      for (int64_t d = 0; d < dim; ++d) store(output + d * lanes + j, load(output + d * lanes + j) * correction);
      running_max = new_max;
      store(max + j, running_max);
    }
    if constexpr (Pairs) {
      uint32_t* pairs = reinterpret_cast<uint32_t*>(weights);
      for (int64_t k = 0; k < count; k += 2) {
        const vfloat first = round_to<bf16>(exp2_lanes(load(scores + k * lanes + j) - running_max));
        const vfloat second =
            k + 1 < count ? round_to<bf16>(exp2_lanes(load(scores + (k + 1) * lanes + j) - running_max)) : splat(0.f);
        total += first + second;
        const vuint pair = (bits_of(first) >> 16) | (bits_of(second) & 0xffff0000u);
        std::memcpy(pairs + k / 2 * lanes + j, &pair, sizeof pair);
      }
    } else {
      for (int64_t k = 0; k < count; ++k) {
        const vfloat weight = exp2_lanes(load(scores + k * lanes + j) - running_max);
        total += weight;
        store(weights + k * lanes + j, weight);
      }
    }
    store(sum + j, total);
  }
}

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

// One item: query tokens [first, first + count) of KV head `kv_head`'s G query heads, over
// positions [0, cached + first + count) of the cache, causal for the tiles that reach the tokens.
template <typename T, typename C, bool Pairs, int D>
__attribute__((optimize("fp-contract=fast")))
void attend_item(const Chunk<T, C>& chunk, int64_t kv_head, int64_t first, Scratch& scratch) {
  using W = std::conditional_t<Pairs, bf16, float>;  // what the tiles hold
  const int64_t group = chunk.heads / chunk.kv_heads, lanes = group * kQueryTile;
  const int64_t count = std::min(kQueryTile, chunk.tokens - first);
  const int64_t first_position = chunk.cached + first, end = first_position + count;
  float* queries = scratch.queries.data();
  uint32_t* query_pairs = reinterpret_cast<uint32_t*>(queries);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t t = 0; t < kQueryTile; ++t) {
      const int64_t lane = g * kQueryTile + t;
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
  for (int64_t start = 0; start < end; start += kKeyTile) {
    const int64_t keys_here = std::min(kKeyTile, end - start);
    for (int64_t k = 0; k < keys_here; ++k) {
      const int64_t row = row_of(chunk.table, start + k, chunk.block_size) * D;
      convert_row(keys + k * D, key_cache + row, D);
      convert_row(value_rows + k * D, value_cache + row, D);
    }
    const int64_t filled = std::min(kKeyTile, (keys_here + 3) / 4 * 4);  // whole row blocks
    std::fill(keys + keys_here * D, keys + filled * D, W{});
    std::fill(value_rows + keys_here * D, value_rows + filled * D, W{});
    float* scores = scratch.scores.data();
#if defined(__AVX512BF16__)
    if constexpr (Pairs) {
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
    if (start + keys_here - 1 > first_position) {  // the tile reaches the chunk's tokens: causal mask
      vint lane_token;
      for (int i = 0; i < kLanes; ++i) lane_token[i] = i;
      for (int64_t j = 0; j < lanes; j += kLanes) {
        const vint position = lane_token + int32_t(first_position + j % kQueryTile);
        for (int64_t k = 0; k < keys_here; ++k) {
          const vfloat s = load(scores + k * lanes + j);
          store(scores + k * lanes + j, int32_t(start + k) > position ? splat(-INFINITY) : s);
        }
      }
    }
    tile_softmax<Pairs>(scratch.weights.data(), scores, scratch.max.data(), scratch.sum.data(), output, lanes, D,
                        keys_here);
#if defined(__AVX512BF16__)
    if constexpr (Pairs)
      tile_output_pairs<D>(output, reinterpret_cast<const uint32_t*>(scratch.weights.data()),
                           reinterpret_cast<const uint32_t*>(scratch.values.data()), lanes, keys_here);
#endif
    if constexpr (!Pairs) tile_output<D>(output, scratch.weights.data(), scratch.values.data(), lanes, keys_here);
  }
  alignas(64) float row[D];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t t = 0; t < count; ++t) {
      const int64_t lane = g * kQueryTile + t;
      const float factor = chunk.value_scale / scratch.sum[lane];
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
  const int64_t query_tiles = (tokens + kQueryTile - 1) / kQueryTile, items = query_tiles * kv_heads;
  std::atomic<int64_t> claimed{0};
#pragma omp parallel if (items > 1)
  {
    Scratch scratch(heads / kv_heads * kQueryTile, dim);
    for (int64_t i = claimed++; i < items; i = claimed++)
      item(chunk, i % kv_heads, (query_tiles - 1 - i / kv_heads) * kQueryTile, scratch);
  }
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
