// The CPU path's hot ops in plain C++: no torch headers, so the library builds in about a second
// with the system compiler (backend/cpu_ops.py builds, caches and loads it through ctypes).
//
// Every op matches its torch reference in backend/kernels/reference.py: float32 arithmetic, each
// product rounded to the activation type where Hugging Face rounds it. Rows may be strided (views
// of the fused QKV projection); heads within a row are packed. OpenMP here resolves to the runtime
// torch already loaded (same soname), so kernels share torch's threads rather than adding more.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__AVX512BF16__) || defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "kv_cache.h"
#include "vectors.h"

namespace {

// Lane i ^ H of v in lane i: a constant mask once GCC unrolls the loop.
template <int H> __attribute__((always_inline)) inline vint swap_mask() {
  vint mask;
  for (int i = 0; i < kLanes; ++i) mask[i] = i ^ H;
  return mask;
}

// Horizontal reductions in log2(kLanes) shuffle steps (lane i meets lane i ^ kLanes / 2, ..., ^ 1).
template <int H = kLanes / 2, typename Op> __attribute__((always_inline)) inline float reduce_lanes(vfloat v, Op op) {
  v = op(v, __builtin_shuffle(v, swap_mask<H>()));
  if constexpr (H == 1) return v[0];
  else return reduce_lanes<H / 2>(v, op);
}
inline float sum_lanes(vfloat v) { return reduce_lanes(v, [](vfloat a, vfloat b) { return a + b; }); }
inline float max_lanes(vfloat v) { return reduce_lanes(v, [](vfloat a, vfloat b) { return a > b ? a : b; }); }
// Whether any lane of a comparison's result is set: one instruction on AVX and AVX-512, lanes ORed elsewhere.
__attribute__((always_inline)) inline bool any_lane(vint mask) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask(reinterpret_cast<__m512i>(mask), reinterpret_cast<__m512i>(mask)) != 0;
#elif defined(__AVX__)
  return _mm256_movemask_ps(reinterpret_cast<__m256>(mask)) != 0;
#else
  int32_t bits = 0;
  for (int i = 0; i < kLanes; ++i) bits |= mask[i];
  return bits != 0;
#endif
}

// The online softmax's step for a chunk's scores: where a lane passes the running max, the max moves
// to the chunk's and the denominator kept in lanes is rescaled; returns the factor for what else was
// summed so far (1 where the max stayed, as it mostly does after the start).
__attribute__((always_inline)) inline float move_max(vfloat scores, float& max, vfloat& sums) {
  if (!any_lane(scores > max)) return 1.f;
  const float new_max = max_lanes(scores);
  const float correction = std::exp(max - new_max);
  max = new_max;
  sums *= correction;
  return correction;
}

constexpr int64_t kParallelElements = 1 << 16;  // smaller ops run on one thread: forking costs more
// An item whose keys and values pass this is not prefetched while the one before it computes: a
// quarter of the smallest L2 we run on (1 MiB a core: AMD Zen 4, older Xeons; 2 MiB: Sapphire Rapids).
constexpr int64_t kMaxPrefetchBytes = 256 << 10;
// An item past kMaxPrefetchBytes asks for its own rows this many chunks ahead (into L2) as it goes
// (`prefetch_after_jump`): nothing prefetched it, and an 8-bit cache's one cache line a position left
// each chunk waiting on memory (docs/benchmarks.md, "8-bit KV cache"). 2, 8 and 16 chunks measured
// the same there.
constexpr int64_t kAheadChunks = 4;

// norm(x) * weight; with a residual, residual_out = x + residual first and the norm of that.
template <typename T>
void rms_norm(T* out, T* residual_out, const T* x, int64_t x_stride, const T* residual,
              const T* weight, int64_t rows, int64_t size, float eps) {
#pragma omp parallel for if (rows * size >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = x + r * x_stride;
    const T* source = in;
    if (residual != nullptr) {
      for (int64_t i = 0; i < size; i += kLanes)
        store(residual_out + r * size + i, load(in + i) + load(residual + r * size + i));
      source = residual_out + r * size;
    }
    vfloat squares{};
    for (int64_t i = 0; i < size; i += kLanes) {
      vfloat v = load(source + i);
      squares += v * v;
    }
    vfloat inv = splat(1.f / std::sqrt(sum_lanes(squares) / float(size) + eps));
    for (int64_t i = 0; i < size; i += kLanes)
      store(out + r * size + i, load(weight + i) * round_to<T>(load(source + i) * inv));
  }
}

// x * cos + rotate_half(x) * sin, each product rounded to T (HF's rotate_half form).
template <typename T>
inline void rotate_row(T* out, const T* in, const T* cos, const T* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    vfloat low = load(in + i), high = load(in + half + i);
    store(out + i, round_to<T>(low * load(cos + i)) + round_to<T>(-high * load(sin + i)));
    store(out + half + i, round_to<T>(high * load(cos + half + i)) + round_to<T>(low * load(sin + half + i)));
  }
}

template <typename T>
void rotary(T* q_out, T* k_out, const T* q, int64_t q_stride, const T* k, int64_t k_stride,
            const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim) {
#pragma omp parallel for if (tokens * (heads + kv_heads) * dim >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h)
      rotate_row(q_out + (t * heads + h) * dim, q + t * q_stride + h * dim, cos + t * dim, sin + t * dim, dim);
    for (int64_t h = 0; h < kv_heads; ++h)
      rotate_row(k_out + (t * kv_heads + h) * dim, k + t * k_stride + h * dim, cos + t * dim, sin + t * dim, dim);
  }
}

// key/value [tokens, kv_heads, dim] (rows strided) into the layer's cache
// [2, kv_heads, num_slots, dim] at slot_mapping; negative slots are padding.
template <typename T>
void reshape_and_cache(T* cache, const T* key, int64_t key_stride, const T* value, int64_t value_stride,
                       const int64_t* slot_mapping, int64_t tokens, int64_t kv_heads, int64_t dim,
                       int64_t num_slots) {
  T* value_cache = cache + kv_heads * num_slots * dim;
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(cache + (h * num_slots + slot) * dim, key + t * key_stride + h * dim, dim * sizeof(T));
      std::memcpy(value_cache + (h * num_slots + slot) * dim, value + t * value_stride + h * dim, dim * sizeof(T));
    }
  }
}

// kLanes floats -> codes, as torch's float32 -> float8 conversion after a clamp to the largest
// value: rounded to nearest even. Normal values round their float32 bits to the code's mantissa;
// subnormal ones (below kMinNormal) are rounded to a multiple of the smallest step by adding a
// power of two whose float32 ulp is that step.
template <typename C> inline void store_fp8(C* p, vfloat x) {
  using F = Fp8Format<C>;
  constexpr int shift = 23 - F::kMantissa;
  constexpr float magic = float(1 << (23 + 1 - F::kBias - F::kMantissa));
  constexpr uint32_t magic_bits = uint32_t(127 + 23 + 1 - F::kBias - F::kMantissa) << 23;
  vuint bits;
  std::memcpy(&bits, &x, sizeof bits);
  const vuint sign = (bits >> 24) & 0x80u;
  vuint magnitude_bits = bits & 0x7fffffffu;
  vfloat magnitude;
  std::memcpy(&magnitude, &magnitude_bits, sizeof magnitude);
  magnitude = magnitude < F::kMax ? magnitude : splat(F::kMax);  // NaN too: saturated
  std::memcpy(&magnitude_bits, &magnitude, sizeof magnitude_bits);
  const vuint normal = ((magnitude_bits + ((1u << (shift - 1)) - 1u) + ((magnitude_bits >> shift) & 1u)) >> shift)
                       - uint32_t((127 - F::kBias) << F::kMantissa);
  const vfloat rounded = magnitude + magic;
  vuint subnormal;
  std::memcpy(&subnormal, &rounded, sizeof subnormal);
  subnormal -= magic_bits;
  const vuint small = (vuint)(magnitude < F::kMinNormal);
  const vuint code = (small & subnormal) | (~small & normal);
  vbyte out = __builtin_convertvector(sign | code, vbyte);
  std::memcpy(p, &out, sizeof out);
}

// reshape_and_cache into an 8-bit cache: each key / k_scale and value / v_scale, rounded to C.
template <typename T, typename C>
void reshape_and_cache_fp8(C* cache, const T* key, int64_t key_stride, const T* value, int64_t value_stride,
                           const int64_t* slot_mapping, int64_t tokens, int64_t kv_heads, int64_t dim,
                           int64_t num_slots, float k_scale, float v_scale) {
  C* value_cache = cache + kv_heads * num_slots * dim;
#pragma omp parallel for if (tokens * kv_heads * dim >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i = 0; i < dim; i += kLanes) {
        store_fp8(cache + (h * num_slots + slot) * dim + i, load(key + t * key_stride + h * dim + i) / k_scale);
        store_fp8(value_cache + (h * num_slots + slot) * dim + i, load(value + t * value_stride + h * dim + i) / v_scale);
      }
  }
}

// Sums of kLanes vectors at once: lane i of the result is the sum of the lanes of parts[reversed(i)]
// (i's log2(kLanes) bits reversed). log2(kLanes) rounds of pairwise shuffles and adds instead of
// kLanes separate horizontal sums.
constexpr int reversed(int i) {
  int r = 0;
  for (int bit = 1; bit < kLanes; bit <<= 1) r = (r << 1) | ((i & bit) ? 1 : 0);
  return r;
}

// Per 2W-lane segment: [x's low W lanes + x's high W lanes, the same of y]. `low` picks
// the low halves; adding W picks the high ones.
template <int W> __attribute__((always_inline)) inline vfloat fold(vfloat x, vfloat y) {
  vint low;
  for (int i = 0; i < kLanes; ++i) low[i] = i / (2 * W) * (2 * W) + i % W + (i % (2 * W) >= W ? kLanes : 0);
  return __builtin_shuffle(x, y, low) + __builtin_shuffle(x, y, low + W);
}

template <int W = kLanes / 2> __attribute__((always_inline)) inline vfloat sum_each(vfloat p[]) {
  if constexpr (W == 1) {
    return fold<1>(p[0], p[1]);
  } else {
    for (int i = 0; i < W; ++i) p[i] = fold<W>(p[2 * i], p[2 * i + 1]);
    return sum_each<W / 2>(p);
  }
}

// x [rows, 2 * size] (gate, then up) -> silu(gate) * up, silu rounded to T first as torch does.
template <typename T>
void silu_and_mul(T* out, const T* x, int64_t rows, int64_t size) {
#pragma omp parallel for if (rows * size >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * size;
    for (int64_t i = 0; i < size; i += kLanes) {
      store(out + r * size + i, silu_and_mul_lanes<T>(load(gate + i), load(gate + size + i)));
    }
  }
}

// One item of attention work, a (token, KV head): where its keys and values are, its sequence's
// block table and the positions [begin, len) it attends to (begin > 0 under a sliding window: the
// positions, and whole blocks, before it are never read).
template <typename T>
struct Item {
  const T* keys = nullptr;
  const T* values = nullptr;
  const int32_t* table = nullptr;
  int64_t len = 0;
  int64_t begin = 0;
  float value_scale = 1.f;  // an 8-bit cache's: the output's factor (unused for a float cache)

  // Whether its keys and values pass kMaxPrefetchBytes (at `dim` elements a row).
  bool is_long(int64_t dim) const { return (len - begin) * 2 * dim * int64_t(sizeof(T)) > kMaxPrefetchBytes; }
};

// A logit soft cap (Gemma 2's): scores become cap * tanh(scores / cap), with tanh(x) as
// 1 - 2 / (exp(2x) + 1) on the lanes (exp overflowing to inf gives 1, to 0 gives -1).
__attribute__((always_inline)) inline vfloat soft_cap(vfloat scores, float cap) {
  return cap - (2.f * cap) / (exp_lanes(scores * (2.f / cap)) + 1.f);
}

// Ask for the keys and values of an item's positions [start, start + kLanes) into the cache level
// `Locality` names (__builtin_prefetch's: 3 = L1, 2 = L2).
template <int Locality, typename T>
__attribute__((always_inline)) inline void prefetch_rows(const Item<T>& item, int64_t start, int64_t block_size,
                                                         int64_t dim) {
  if (start < item.begin) return;
  for (int64_t pos = start; pos < std::min(item.len, start + kLanes); ++pos) {
    const int64_t row = row_of(item.table, pos, block_size) * dim;
    for (int64_t byte = 0; byte < dim * int64_t(sizeof(T)); byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(item.keys + row) + byte, 0, Locality);
      __builtin_prefetch(reinterpret_cast<const char*>(item.values + row) + byte, 0, Locality);
    }
  }
}

// Where the kLanes positions from `next` do not follow the ones before them in memory (another block,
// anywhere in the cache), ask for their keys and values now: the hardware prefetcher cannot jump
// there, and each row would otherwise wait on memory. Contiguous blocks are left to it (asking for
// those too, or asking 2-3 chunks ahead, measured slower, with either attention kernel). 64 decodes
// of 192 positions, random blocks over 136 MB: 1.6-1.7 -> 1.3-1.5 ms a layer (float32-widening
// kernel); consecutive blocks unchanged. The exception: a long item (past kMaxPrefetchBytes) also
// asks kAheadChunks ahead (L2), as the hardware does not stream it fast enough alone: an 8-bit
// cache's, which reads too few bytes a position, and with the AVX-512 kernels (`AheadWide`) a 16- or
// 32-bit cache's. 30 layers of 8 decodes over 2,064 positions in ascending blocks (bfloat16, 365 MB):
// 0.85-0.86 -> 0.74-0.77 ms a layer; float32 1.40-1.43 -> 1.23; other block orders the same. AVX2's
// kernel streams those at 1.0 ms without, 1.27 with (docs/benchmarks.md, "Decode attention from memory").
template <bool AheadWide, typename T>
__attribute__((always_inline)) inline void prefetch_after_jump(const Item<T>& item, int64_t next, int64_t block_size,
                                                               int64_t dim) {
  if constexpr (AheadWide || sizeof(T) == 1) {
    if (item.is_long(dim))
      prefetch_rows<2>(item, next + kAheadChunks * kLanes, block_size, dim);
  }
  if (next >= item.len || row_of(item.table, next, block_size) == row_of(item.table, next - 1, block_size) + 1) return;
  prefetch_rows<3>(item, next, block_size, dim);
}

// One (token, KV head) of attention over the first `len` positions of a sequence: its G query
// heads share each key and value row while it is in cache. One pass with an online softmax over kLanes
// positions at a time, whose scores form one vector. G and V (= dim / kLanes) are template arguments
// so everything lives in registers.
template <typename T, typename C, int G, int V>
__attribute__((optimize("fp-contract=fast")))  // FMAs: attention need not match torch bit for bit
void attend_one(T* out, const T* query, const Item<C>& item, const Item<C>& next, int64_t block_size, float scale,
                float cap) {
  constexpr int64_t dim = V * kLanes;
  const C *key_cache = item.keys, *value_cache = item.values;
  const int64_t len = item.len;
  vfloat q[G][V], acc[G][V] = {}, dots[G][kLanes], sums[G] = {};
  float max[G];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < V; ++j) q[g][j] = load(query + g * dim + j * kLanes);
    max[g] = -INFINITY;
  }
  const C* keys[kLanes];
  // The next item's positions run `shift` behind (or ahead of) this one's, chunk by chunk.
  const int64_t shift = next.begin - item.begin;
  for (int64_t start = item.begin; start < len; start += kLanes) {
    const int64_t count = std::min<int64_t>(len - start, kLanes);
    for (int64_t p = 0; p < count; ++p) keys[p] = key_cache + row_of(item.table, start + p, block_size) * dim;
    prefetch_after_jump<true>(item, start + kLanes, block_size, dim);
    prefetch_rows<2>(next, start + shift, block_size, dim);
    for (int64_t p = 0; p < kLanes; ++p) {  // each query head's kLanes partial dot products per position
      vfloat partial[G] = {};
      if (p < count)
        for (int j = 0; j < V; ++j) {
          vfloat key = load(keys[p] + j * kLanes);
          for (int g = 0; g < G; ++g) partial[g] += q[g][j] * key;
        }
      for (int g = 0; g < G; ++g) dots[g][reversed(p)] = partial[g];
    }
    vfloat probs[G];
    for (int g = 0; g < G; ++g) {
      vfloat scores = sum_each(dots[g]) * scale;
      if (cap > 0.f) scores = soft_cap(scores, cap);
      for (int64_t p = count; p < kLanes; ++p) scores[p] = -INFINITY;
      const float correction = move_max(scores, max[g], sums[g]);
      if (correction != 1.f)
        for (int j = 0; j < V; ++j) acc[g][j] *= correction;
      probs[g] = exp_lanes(scores - max[g]);  // e^-87 past `count`: nothing beside the max's 1
      sums[g] += probs[g];  // summed across lanes once, at the end
    }
    for (int64_t p = 0; p < count; ++p) {
      const C* value = value_cache + (keys[p] - key_cache);
      for (int j = 0; j < V; ++j) {
        vfloat row = load(value + j * kLanes);
        for (int g = 0; g < G; ++g) acc[g][j] += probs[g][p] * row;
      }
    }
  }
  for (int64_t start = len + shift; start < next.len; start += kLanes) prefetch_rows<2>(next, start, block_size, dim);
  for (int g = 0; g < G; ++g) {
    float inverse = 1.f / sum_lanes(sums[g]);
    if constexpr (!std::is_same_v<T, C>) inverse *= item.value_scale;
    for (int j = 0; j < V; ++j) store(out + g * dim + j * kLanes, acc[g][j] * inverse);
  }
}

// attend_one for targets with 16 vector registers of 8 or 4 floats (AVX2, SSE; NEON has 32): the
// same algorithm and prefetches, its loops ordered so that what each keeps fits in registers.
// attend_one holds G x V query vectors, G x V accumulators and G x kLanes partial dots at once (72
// vectors for 3 query heads of 64 on AVX2), which GCC spills to the stack and reloads per position;
// here one query head at a time takes a chunk's kLanes positions with 4 of its query vectors and
// kLanes dot products in registers (13), then its output in slices of 8 vectors with one
// probability broadcast (10), the chunk's keys and values staying in L1 between heads. The lanes
// past a short chunk read its first position again (valid memory) and get probability 0. The
// queries are scaled once up front. docs/benchmarks.md ("Attention on AVX2") has what it gained.
template <typename T, typename C, int G, int V>
__attribute__((optimize("fp-contract=fast")))
void attend_one_narrow(T* out, const T* query, const Item<C>& item, const Item<C>& next, int64_t block_size,
                       float scale, float cap) {
  constexpr int64_t dim = V * kLanes;
  constexpr int QBlock = V < 4 ? V : 4, OutBlock = V < 8 ? V : 8;
  static_assert(V % QBlock == 0 && V % OutBlock == 0, "dim must be whole blocks of vectors");
  const C *key_cache = item.keys, *value_cache = item.values;
  const int64_t len = item.len;
  // An 8-bit cache's chunk is widened once into float rows in L1 (4 KiB at 64 dims) that every query
  // head then reads: read in place, each code was widened once per query head, G times. Where
  // widening reorders a row's dims (kWidenInterleaves), the query is put in that order and the
  // output back in the dims' (`plain`).
  constexpr bool kStage = sizeof(C) == 1, kPermute = kStage && kWidenInterleaves<dim>;
  alignas(64) float q[G][dim], acc[G][dim] = {}, plain[kPermute ? dim : 1];
  float max[G];
  vfloat sums[G] = {};
  for (int g = 0; g < G; ++g) {
    float* scaled = kPermute ? plain : q[g];
    for (int j = 0; j < V; ++j) store(scaled + j * kLanes, load(query + g * dim + j * kLanes) * scale);
    if constexpr (kPermute)
      for (int64_t k = 0; k < dim; ++k) q[g][k] = plain[widened_dim(k)];
    max[g] = -INFINITY;
  }
  using K = std::conditional_t<kStage, float, C>;
  alignas(64) float staged[kStage ? 2 * kLanes * dim : 1];
  const C* rows[kLanes];
  const K* keys[kLanes];
  const K* values[kLanes];
  const int64_t shift = next.begin - item.begin;
  for (int64_t start = item.begin; start < len; start += kLanes) {
    const int64_t count = std::min<int64_t>(len - start, kLanes);
    if ((start & (block_size - 1)) + count <= block_size) {  // the chunk in one block (as usual)
      const C* first = key_cache + row_of(item.table, start, block_size) * dim;
      for (int64_t p = 0; p < count; ++p) rows[p] = first + p * dim;
    } else {
      for (int64_t p = 0; p < count; ++p) rows[p] = key_cache + row_of(item.table, start + p, block_size) * dim;
    }
    prefetch_after_jump<false>(item, start + kLanes, block_size, dim);
    prefetch_rows<2>(next, start + shift, block_size, dim);
    if constexpr (kStage) {
      for (int64_t p = 0; p < count; ++p) {
        widen_row<C, dim>(staged + p * dim, rows[p]);
        widen_row<C, dim>(staged + (kLanes + p) * dim, value_cache + (rows[p] - key_cache));
        keys[p] = staged + p * dim;
        values[p] = staged + (kLanes + p) * dim;
      }
    } else {
      for (int64_t p = 0; p < count; ++p) {
        keys[p] = rows[p];
        values[p] = value_cache + (rows[p] - key_cache);
      }
    }
    for (int64_t p = count; p < kLanes; ++p) keys[p] = keys[0];
    // The query heads' scores first, then their softmax updates side by side, then their outputs:
    // each head's update is a chain of dependent steps (sums across lanes, max, exp) that the heads'
    // FMAs could not hide when each head's update sat between its own dots and outputs.
    alignas(64) float scores[G][kLanes], probs[G][kLanes];
    for (int g = 0; g < G; ++g) {
      vfloat dots[kLanes] = {};
      for (int j0 = 0; j0 < V; j0 += QBlock) {
        vfloat qs[QBlock];
        for (int j = 0; j < QBlock; ++j) qs[j] = load(q[g] + (j0 + j) * kLanes);
#pragma GCC unroll 16
        for (int p = 0; p < kLanes; ++p)
#pragma GCC unroll 4
          for (int j = 0; j < QBlock; ++j) dots[reversed(p)] += qs[j] * load(keys[p] + (j0 + j) * kLanes);
      }
      store(scores[g], sum_each(dots));
    }
    float correction[G];
    for (int g = 0; g < G; ++g) {
      vfloat lanes = load(scores[g]);
      if (cap > 0.f) lanes = soft_cap(lanes, cap);
      for (int64_t p = count; p < kLanes; ++p) lanes[p] = -INFINITY;
      correction[g] = move_max(lanes, max[g], sums[g]);
      const vfloat weights = exp_lanes(lanes - max[g]);
      store(probs[g], weights);
      sums[g] += weights;  // summed across lanes once, at the end
    }
    for (int g = 0; g < G; ++g) {
      for (int j0 = 0; j0 < V; j0 += OutBlock) {
        vfloat a[OutBlock];
        for (int j = 0; j < OutBlock; ++j) a[j] = load(acc[g] + (j0 + j) * kLanes);
        if (correction[g] != 1.f)
          for (int j = 0; j < OutBlock; ++j) a[j] *= correction[g];
        for (int64_t p = 0; p < count; ++p) {
          const vfloat w = splat(probs[g][p]);
#pragma GCC unroll 8
          for (int j = 0; j < OutBlock; ++j) a[j] += w * load(values[p] + (j0 + j) * kLanes);
        }
        for (int j = 0; j < OutBlock; ++j) store(acc[g] + (j0 + j) * kLanes, a[j]);
      }
    }
  }
  for (int64_t start = len + shift; start < next.len; start += kLanes) prefetch_rows<2>(next, start, block_size, dim);
  for (int g = 0; g < G; ++g) {
    float inverse = 1.f / sum_lanes(sums[g]);
    if constexpr (!std::is_same_v<T, C>) inverse *= item.value_scale;
    const float* dims = acc[g];
    if constexpr (kPermute) {
      for (int64_t k = 0; k < dim; ++k) plain[widened_dim(k)] = acc[g][k];
      dims = plain;
    }
    for (int j = 0; j < V; ++j) store(out + g * dim + j * kLanes, load(dims + j * kLanes) * inverse);
  }
}

#if defined(__AVX512BF16__)
// bfloat16 attention on AVX512-BF16's dot-product instruction (vdpbf16ps: 32 pairs of bf16 into 16
// float32 lanes, each lane adding two exact products): the algorithm of attend_one without widening
// either operand to float32 first, which was most of its work. q.k multiplies bf16 by bf16 as
// before; p.v rounds each probability to bf16 (as flash attention does) and sums the rounded ones
// for the softmax's denominator, so the weights still add up to 1. unpacklo/hi interleave two
// value rows so that a 32-bit lane holds one dim of two positions; the accumulators then hold the
// dims in the unpacks' order, put back in place at the end.
// 64 decodes of 192 positions, 9 heads over 3 KV heads of 64, ms a layer: keys in cache (the work
// alone) 0.37-0.38 -> 0.24-0.28; from memory, random blocks 1.00-1.08 -> 0.83-0.87; the whole offline
// bench run 464-476 -> 541-555 out tok/s.
// An 8-bit cache takes the same kernel: its codes are widened to bfloat16 (exactly: 3 or 2 mantissa
// bits) by table lookups instead of to float32 through float16 for float32 FMAs; the widening,
// not memory, bounds the kernel. With AVX512-VBMI, 64 codes at a time (ByteWidener: a
// vpermi2b into each of two byte tables, the sign ORed in, two unpacks; ~6 instructions where the
// word tables below take ~16); the unpacks leave the dims in an order within 128-bit lanes, so
// the query is permuted alike once a call and the output put back at the end, and the keys' loop
// over a chunk's positions is unrolled (each one's dots then go to a constant place: half the
// gain). Without VBMI (Cooper Lake), 32 at a time from word tables (load_bf16x32). One layer, 4
// decodes at 8,192 positions, 9 heads over 3 KV heads of 64 (tools/bench_kv_cache.py kernel), ms,
// on AMD Zen 5 (2 cores): bfloat16 cache 0.68-0.74; E4M3 0.55 (word tables) -> 0.46-0.47 (bytes).
// The engine's own calls (4 x 8,000 positions) replayed: 0.59 vs E4M3 0.51 -> 0.42. head_dim 128
// with 8 heads a KV head gains nothing (1.18 either way: bound by its 8 x 4 dot products).
static_assert(kLanes == 16, "AVX512-BF16 implies AVX-512's 16 float lanes");

// The bfloat16 bits of each code's magnitude (its low 7 bits) as load(const C*) reads it (the
// value / kUnit), in four vpermi2w tables of 32 entries. Subnormal codes become normal bfloat16s.
template <typename C> struct Bf16Table {
  alignas(64) uint16_t bits[128] = {};
  constexpr Bf16Table() {
    using F = Fp8Format<C>;
    const int unit_shift = F::kUnit == 256.f ? 8 : 0;
    for (int code = 1; code < 128; ++code) {
      const int exponent = code >> F::kMantissa, mantissa = code & ((1 << F::kMantissa) - 1);
      int power = 0, fraction = 0;  // value = (1 + fraction / 128) * 2^power
      if (exponent > 0) {
        power = exponent - F::kBias - unit_shift;
        fraction = mantissa << (7 - F::kMantissa);
      } else {  // mantissa * 2^(1 - bias - mantissa bits): normalised at its highest bit
        int high = 0;
        while (mantissa >> (high + 1)) ++high;
        power = high + 1 - F::kBias - F::kMantissa - unit_shift;
        fraction = (mantissa - (1 << high)) << (7 - high);
      }
      bits[code] = uint16_t(((power + 127) << 7) | fraction);
    }
  }
};
template <typename C> constexpr Bf16Table<C> kBf16Table{};

// 32 cache elements as 32 bfloat16 in order: a load for a bfloat16 cache, for an 8-bit one the
// codes' magnitudes looked up (two vpermi2w of 64 entries each, picked by bit 6) and the sign put back.
template <typename C> __attribute__((always_inline)) inline __m512i load_bf16x32(const C* p) {
  if constexpr (std::is_same_v<C, bf16>) {
    return _mm512_loadu_si512(p);
  } else {
    const uint16_t* table = kBf16Table<C>.bits;
    const __m512i code = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i low = _mm512_permutex2var_epi16(_mm512_load_si512(table), code, _mm512_load_si512(table + 32));
    const __m512i high = _mm512_permutex2var_epi16(_mm512_load_si512(table + 64), code, _mm512_load_si512(table + 96));
    const __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(code, _mm512_set1_epi16(0x40)), low, high);
    return _mm512_or_si512(magnitude, _mm512_and_si512(_mm512_slli_epi16(code, 8), _mm512_set1_epi16(-0x8000)));
  }
}

#if defined(__AVX512VBMI__)
// The same bits as two tables of 128 bytes, each in two registers: a code's bfloat16 low byte and
// high byte, for vpermi2b (which reads an index byte's low 7 bits: the code's magnitude).
template <typename C> struct Bf16ByteTables {
  alignas(64) uint8_t low[128] = {}, high[128] = {};
  constexpr Bf16ByteTables() {
    for (int code = 0; code < 128; ++code) {
      low[code] = uint8_t(kBf16Table<C>.bits[code] & 0xff);
      high[code] = uint8_t(kBf16Table<C>.bits[code] >> 8);
    }
  }
};
template <typename C> constexpr Bf16ByteTables<C> kBf16ByteTables{};

// 64 codes at a time: both bytes of each code's bfloat16 looked up, its sign ORed into the high
// byte, the bytes interleaved into words. The unpacks work within 128-bit lanes, so `front` gets
// codes 0-7 of each 16 (dims 16l + 0..7 in its lane l) and `back` codes 8-15 (16l + 8..15): the
// query is put in that order once (permute_query) and the output put back at the end.
template <typename C> struct ByteWidener {
  __m512i low0, low1, high0, high1;
  __attribute__((always_inline)) ByteWidener()
      : low0(_mm512_load_si512(kBf16ByteTables<C>.low)), low1(_mm512_load_si512(kBf16ByteTables<C>.low + 64)),
        high0(_mm512_load_si512(kBf16ByteTables<C>.high)), high1(_mm512_load_si512(kBf16ByteTables<C>.high + 64)) {}
  struct Words {
    __m512i front, back;
  };
  __attribute__((always_inline)) Words load(const C* p) const {
    const __m512i code = _mm512_loadu_si512(p);
    const __m512i low = _mm512_permutex2var_epi8(low0, code, low1);
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high0, code, high1), code,
                                                   _mm512_set1_epi8(char(0x80)), 0xF8);  // high | (code & 0x80)
    return {_mm512_unpacklo_epi8(low, high), _mm512_unpackhi_epi8(low, high)};
  }
};

// 64 bfloat16 query elements in ByteWidener's order: `front` dims 16l + 0..7, `back` 16l + 8..15.
__attribute__((always_inline)) inline void permute_query(const bf16* q, __m512bh& front, __m512bh& back) {
  alignas(64) int16_t front_index[32], back_index[32];
  for (int m = 0; m < 32; ++m) {
    front_index[m] = int16_t(m / 8 * 16 + m % 8);
    back_index[m] = int16_t(m / 8 * 16 + 8 + m % 8);
  }
  const __m512i first = _mm512_loadu_si512(q), second = _mm512_loadu_si512(q + 32);
  front = (__m512bh)_mm512_permutex2var_epi16(first, _mm512_load_si512(front_index), second);
  back = (__m512bh)_mm512_permutex2var_epi16(first, _mm512_load_si512(back_index), second);
}

struct NoWidener {};
template <typename C> constexpr bool kByteTables = !std::is_same_v<C, bf16>;  // an 8-bit cache
#endif

#if defined(TRITONLLM_AMX)
// A chunk's scores on AMX (attend_one_bf16_dot<..., Amx>): scores [16 keys][16 heads] = keys [16][dim]
// x queries^T, the keys' rows the A operands as they lie in their block (or copied, or widened from an
// 8-bit cache, into `staged`), the G query heads' pairs the B operands, loaded once an item (zeros
// past G). dim / 32 TDPBF16PS a chunk instead of G x dim / 32 x 16 vdpbf16ps and their sums across
// lanes; each head's scores are then its column, gathered into a vector. Tiles: A 0 and 1, B 2, 3
// (and 5, 6 at dim 128), C 4; `Lean` (an 8-bit cache at dim 64): A 0, B 1 (the queries reloaded
// each time), C 2, leaving tiles 3-7 to the output (AmxOutput). A chunk is scored while the one
// before takes its softmax and output (two slots of scores): scored in turn, the tiles' latency
// left the chunk 228 ns (from 256 on vectors), ahead 187 (one thread, 9 heads over 3 KV heads of
// 64, keys in L2). From memory (tools/bench_kv_cache.py kernel --layers 30 --layout ascending), ms
// a layer, vectors -> AMX scores: 8 x 2,064 positions bfloat16 0.72 -> 0.65, E4M3 0.47 -> 0.40;
// 4 x 8,192 bfloat16 1.35 -> 1.17, E4M3 0.87 -> 0.75.
template <int W, bool Lean = false> struct AmxScores {
  static_assert(W == 2 || W == 4);
  static_assert(!Lean || W == 2, "lean: the queries reloaded each chunk, tiles 0-2 only");
  alignas(64) uint32_t queries[W][16][16];  // [32 dims][dim pair][head]
  alignas(64) float scores[2][kLanes][16];  // [key][head] of two chunks (slots)
  alignas(64) bf16 staged[kLanes][32 * W];  // keys not read in place

  template <int G> __attribute__((always_inline)) void load_queries(const __m512bh (&q)[G][W]) {
    alignas(64) uint32_t pairs[G][W][16];
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) _mm512_store_si512(pairs[g][w], (__m512i)q[g][w]);
    for (int w = 0; w < W; ++w)
      for (int k = 0; k < 16; ++k) {  // a masked gather: GCC made scattered stores of the plain loop
        const __m512i heads = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i index = _mm512_add_epi32(_mm512_mullo_epi32(heads, _mm512_set1_epi32(W * 16)),
                                               _mm512_set1_epi32(w * 16 + k));
        _mm512_store_si512(queries[w][k], _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (1 << G) - 1, index,
                                                                       &pairs[0][0][0], 4));
      }
    if constexpr (Lean) return;
    _tile_loadd(2, queries[0], 64);
    _tile_loadd(3, queries[1], 64);
    if constexpr (W == 4) {
      _tile_loadd(5, queries[2], 64);
      _tile_loadd(6, queries[3], 64);
    }
  }
  // rows: 16 keys, 32 * W bfloat16 apart.
  __attribute__((always_inline)) void score(const bf16* rows, int slot) {
    constexpr int64_t stride = 32 * W * sizeof(bf16);
    if constexpr (Lean) {
      _tile_zero(2);
      _tile_loadd(0, rows, stride);
      _tile_loadd(1, queries[0], 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(0, rows + 32, stride);
      _tile_loadd(1, queries[1], 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_stored(2, scores[slot], 16 * sizeof(float));
      return;
    }
    _tile_zero(4);
    _tile_loadd(0, rows, stride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(1, rows + 32, stride);
    _tile_dpbf16ps(4, 1, 3);
    if constexpr (W == 4) {
      _tile_loadd(0, rows + 64, stride);
      _tile_dpbf16ps(4, 0, 5);
      _tile_loadd(1, rows + 96, stride);
      _tile_dpbf16ps(4, 1, 6);
    }
    _tile_stored(4, scores[slot], 16 * sizeof(float));
  }
  // Head g's scores of the chunk in `slot` (masked: GCC 12 warns of the plain gather).
  __attribute__((always_inline)) vfloat column(int g, int slot) const {
    const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    return (vfloat)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xffff, rows, &scores[slot][0][g], 4);
  }
};

// The output on AMX too, at dim 64 (its four accumulators and lean scores' three tiles, with the
// probabilities' one, are the eight there are): out [heads][16 dims] += probabilities [heads][32
// positions] x values [16 position pairs][16 dims x 2], two chunks at a time. A B operand's row is
// what the vector path's unpacks make of two positions' value rows (one accumulator per unpack and
// 32 dims, so the accumulators hold the dims in the vector path's order). Tiles: A 3, B 0 and 1,
// C 4-7. E4M3 from memory, 30 layers of 4 x 8,192 positions: 0.78-0.84 -> 0.66-0.68 ms a layer.
struct AmxOutput {
  alignas(64) uint16_t probs[16][32];      // bfloat16 bits, [head][position] (rows past G stay 0)
  alignas(64) uint32_t values[4][16][16];  // per accumulator: [position pair][dim] two bfloat16
  alignas(64) float spill[4][16][16];      // the accumulators when rescaled, and at the end

  __attribute__((always_inline)) void start() {
    std::memset(probs, 0, sizeof probs);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
  }
  __attribute__((always_inline)) void multiply() {
    _tile_loadd(3, probs, 64);
    _tile_loadd(0, values[0], 64);
    _tile_dpbf16ps(4, 3, 0);
    _tile_loadd(1, values[1], 64);
    _tile_dpbf16ps(5, 3, 1);
    _tile_loadd(0, values[2], 64);
    _tile_dpbf16ps(6, 3, 0);
    _tile_loadd(1, values[3], 64);
    _tile_dpbf16ps(7, 3, 1);
  }
  __attribute__((always_inline)) void store() {
    _tile_stored(4, spill[0], 64);
    _tile_stored(5, spill[1], 64);
    _tile_stored(6, spill[2], 64);
    _tile_stored(7, spill[3], 64);
  }
  __attribute__((always_inline)) void load() {
    _tile_loadd(4, spill[0], 64);
    _tile_loadd(5, spill[1], 64);
    _tile_loadd(6, spill[2], 64);
    _tile_loadd(7, spill[3], 64);
  }
  // Row `pair` of each accumulator's B operand from two positions' rows (zeros for a missing one).
  __attribute__((always_inline)) void put(int pair, __m512i a0, __m512i b0, __m512i a1, __m512i b1) {
    _mm512_store_si512(values[0][pair], _mm512_unpacklo_epi16(a0, b0));
    _mm512_store_si512(values[1][pair], _mm512_unpackhi_epi16(a0, b0));
    _mm512_store_si512(values[2][pair], _mm512_unpacklo_epi16(a1, b1));
    _mm512_store_si512(values[3][pair], _mm512_unpackhi_epi16(a1, b1));
  }
  __attribute__((always_inline)) void clear(int pair) {
    for (int t = 0; t < 4; ++t) _mm512_store_si512(values[t][pair], _mm512_setzero_si512());
  }
};
#endif

struct NoOutput {};

// Amx: the scores on AMX tiles (AmxScores), and for an 8-bit cache at dim 64 the output too (AmxOutput).
template <typename C, int G, int W, bool Amx = false>
__attribute__((optimize("fp-contract=fast")))
void attend_one_bf16_dot(bf16* out, const bf16* query, const Item<C>& item, const Item<C>& next,
                         int64_t block_size, float scale, float cap) {
  constexpr int64_t dim = 32 * W;
#if defined(TRITONLLM_AMX)
  // The output on AMX for an 8-bit cache only: a bfloat16 cache's decodes from memory were 2-8%
  // slower with it (reading at ~20 GB/s, they wait on memory more than on this work).
  constexpr bool AmxOut = Amx && W == 2 && !std::is_same_v<C, bf16>;
#endif
  const C *key_cache = item.keys, *value_cache = item.values;
  const int64_t len = item.len;
  __m512bh q[G][W];
  __m512 low[G][W], high[G][W];  // 16 dims each per 32: per 128-bit lane, dims 0-3 and 4-7 of its 8
  vfloat dots[G][kLanes];
  float max[G];
  vfloat sums[G] = {};
  alignas(64) uint32_t pairs[G][kLanes / 2];  // the chunk's probabilities, two bf16 per position pair
#if defined(__AVX512VBMI__)
  [[maybe_unused]] const std::conditional_t<kByteTables<C>, ByteWidener<C>, NoWidener> widen{};
#endif
  for (int g = 0; g < G; ++g) {
    for (int w = 0; w < W; ++w) {
      q[g][w] = (__m512bh)_mm512_loadu_si512(query + g * dim + w * 32);
      low[g][w] = high[g][w] = _mm512_setzero_ps();
    }
#if defined(__AVX512VBMI__)
    if constexpr (kByteTables<C>)
      for (int w = 0; w < W; w += 2) permute_query(query + g * dim + w * 32, q[g][w], q[g][w + 1]);
#endif
    max[g] = -INFINITY;
  }
  const C* key_rows[2][kLanes];  // a chunk's keys; on AMX the next chunk's too
  auto find_keys = [&](int64_t start, const C** keys) {
    for (int64_t p = 0; p < std::min<int64_t>(len - start, kLanes); ++p)
      keys[p] = key_cache + row_of(item.table, start + p, block_size) * dim;
  };
#if defined(TRITONLLM_AMX)
  // On AMX a chunk's scores are asked for one chunk ahead, so that the tiles' latency passes while
  // the chunk before takes its softmax and output.
  [[maybe_unused]] AmxScores<W, AmxOut> amx;
  [[maybe_unused]] std::conditional_t<AmxOut, AmxOutput, NoOutput> amx_out;
  [[maybe_unused]] float factor[G];  // AmxOut: what the accumulators owe each head's running max's moves
  [[maybe_unused]] vfloat pending[G] = {};  // AmxOut: the first of two chunks' probabilities
  // A chunk's 16 key rows lie one after another in one block when it starts a block's 16s.
  [[maybe_unused]] const bool in_place = std::is_same_v<C, bf16> && block_size >= kLanes && item.begin % kLanes == 0;
  [[maybe_unused]] auto score_on_amx = [&](int64_t start, const C* const* keys, int slot) {
    const int64_t count = std::min<int64_t>(len - start, kLanes);
    const bf16* rows = nullptr;
    if constexpr (std::is_same_v<C, bf16>) {
      if (in_place) rows = keys[0];
    }
    if (rows == nullptr) {
      for (int64_t p = 0; p < count; ++p) {
#if defined(__AVX512VBMI__)
        if constexpr (kByteTables<C>) {
          for (int w = 0; w < W; w += 2) {
            const auto key = widen.load(keys[p] + w * 32);
            _mm512_store_si512(amx.staged[p] + w * 32, key.front);
            _mm512_store_si512(amx.staged[p] + w * 32 + 32, key.back);
          }
          continue;
        }
#endif
        for (int w = 0; w < W; ++w) _mm512_store_si512(amx.staged[p] + w * 32, load_bf16x32(keys[p] + w * 32));
      }
      for (int64_t p = count; p < kLanes; ++p) std::memset(amx.staged[p], 0, sizeof amx.staged[p]);
      rows = amx.staged[0];
    }
    amx.score(rows, slot);
  };
  if constexpr (AmxOut) {
    amx_out.start();
    for (int g = 0; g < G; ++g) factor[g] = 1.f;
  }
  if constexpr (Amx) {
    amx.load_queries(q);
    if (item.begin < len) {
      find_keys(item.begin, key_rows[0]);
      score_on_amx(item.begin, key_rows[0], 0);
    }
  }
#endif
  // The next item's positions run `shift` behind (or ahead of) this one's, chunk by chunk.
  const int64_t shift = next.begin - item.begin;
  int slot = 0;
  for (int64_t start = item.begin; start < len; start += kLanes, slot ^= 1) {
    const int64_t count = std::min<int64_t>(len - start, kLanes);
    const C* const* keys = key_rows[slot];
    if constexpr (!Amx) find_keys(start, key_rows[slot]);
    prefetch_after_jump<true>(item, start + kLanes, block_size, dim);
    prefetch_rows<2>(next, start + shift, block_size, dim);
    vfloat chunk_scores[G];
#if defined(TRITONLLM_AMX)
    if constexpr (Amx) {
      for (int g = 0; g < G; ++g) chunk_scores[g] = amx.column(g, slot);
      if (start + kLanes < len) {
        find_keys(start + kLanes, key_rows[slot ^ 1]);
        score_on_amx(start + kLanes, key_rows[slot ^ 1], slot ^ 1);
      }
    } else
#endif
    {
#if defined(__AVX512VBMI__)
    if constexpr (kByteTables<C>) {
#pragma GCC unroll 16
      for (int p = 0; p < kLanes; ++p) {  // unrolled: dots' places are constants
        __m512 partial[G];
        for (int g = 0; g < G; ++g) partial[g] = _mm512_setzero_ps();
        if (p < count)
          for (int w = 0; w < W; w += 2) {
            const auto key = widen.load(keys[p] + w * 32);
            for (int g = 0; g < G; ++g) {
              partial[g] = _mm512_dpbf16_ps(partial[g], q[g][w], (__m512bh)key.front);
              partial[g] = _mm512_dpbf16_ps(partial[g], q[g][w + 1], (__m512bh)key.back);
            }
          }
        for (int g = 0; g < G; ++g) dots[g][reversed(p)] = (vfloat)partial[g];
      }
    } else
#endif
    for (int64_t p = 0; p < kLanes; ++p) {
      __m512 partial[G];
      for (int g = 0; g < G; ++g) partial[g] = _mm512_setzero_ps();
      if (p < count)
        for (int w = 0; w < W; ++w) {
          const __m512bh key = (__m512bh)load_bf16x32(keys[p] + w * 32);
          for (int g = 0; g < G; ++g) partial[g] = _mm512_dpbf16_ps(partial[g], q[g][w], key);
        }
      for (int g = 0; g < G; ++g) dots[g][reversed(p)] = (vfloat)partial[g];
    }
    for (int g = 0; g < G; ++g) chunk_scores[g] = sum_each(dots[g]);
    }
#if defined(TRITONLLM_AMX)
    if constexpr (AmxOut) {
      // Chunks in twos (`half` 0, 1): the first's probabilities wait in float for the second's max.
      const int half = int((start - item.begin) / kLanes) & 1;
      const bool multiply = half == 1 || start + kLanes >= len;
      for (int g = 0; g < G; ++g) {
        vfloat scores = chunk_scores[g] * scale;
        if (cap > 0.f) scores = soft_cap(scores, cap);
        for (int64_t p = count; p < kLanes; ++p) scores[p] = -INFINITY;
        const float correction = move_max(scores, max[g], sums[g]);
        if (correction != 1.f) {
          factor[g] *= correction;
          if (half == 1) pending[g] *= correction;
        }
        vfloat probs = exp_lanes(scores - max[g]);
        for (int64_t p = count; p < kLanes; ++p) probs[p] = 0.f;
        if (half == 0) pending[g] = probs;
        if (multiply)
          for (int h = 0; h < 2; ++h) {
            const vfloat rounded = h > half ? splat(0.f) : round_to<bf16>(h == half ? probs : pending[g]);
            sums[g] += rounded;
            _mm256_store_si256(reinterpret_cast<__m256i*>(&amx_out.probs[g][h * 16]),
                               (__m256i)_mm512_cvtneps_pbh((__m512)rounded));
          }
      }
      for (int64_t p = 0; p < kLanes; p += 2) {
        const int pair = half * 8 + int(p / 2);
        if (p >= count) {
          amx_out.clear(pair);
          continue;
        }
        const C* first = value_cache + (keys[p] - key_cache);
        const C* second = p + 1 < count ? value_cache + (keys[p + 1] - key_cache) : nullptr;
#if defined(__AVX512VBMI__)
        if constexpr (kByteTables<C>) {
          using Words = typename decltype(widen)::Words;
          const Words a = widen.load(first);
          const Words b =
              second != nullptr ? widen.load(second) : Words{_mm512_setzero_si512(), _mm512_setzero_si512()};
          amx_out.put(pair, a.front, b.front, a.back, b.back);
          continue;
        }
#endif
        const __m512i a0 = load_bf16x32(first), a1 = load_bf16x32(first + 32);
        const __m512i b0 = second != nullptr ? load_bf16x32(second) : _mm512_setzero_si512();
        const __m512i b1 = second != nullptr ? load_bf16x32(second + 32) : _mm512_setzero_si512();
        amx_out.put(pair, a0, b0, a1, b1);
      }
      if (multiply) {
        if (half == 0)
          for (int pair = 8; pair < 16; ++pair) amx_out.clear(pair);
        bool rescale = false;
        for (int g = 0; g < G; ++g) rescale |= factor[g] != 1.f;
        if (rescale) {
          amx_out.store();
          for (int g = 0; g < G; ++g) {
            for (int t = 0; t < 4; ++t) store(amx_out.spill[t][g], load(amx_out.spill[t][g]) * factor[g]);
            factor[g] = 1.f;
          }
          amx_out.load();
        }
        amx_out.multiply();
      }
      continue;
    }
#endif
    for (int g = 0; g < G; ++g) {
      vfloat scores = chunk_scores[g] * scale;
      if (cap > 0.f) scores = soft_cap(scores, cap);
      for (int64_t p = count; p < kLanes; ++p) scores[p] = -INFINITY;
      const float correction = move_max(scores, max[g], sums[g]);
      if (correction != 1.f)
        for (int w = 0; w < W; ++w) {
          low[g][w] = _mm512_mul_ps(low[g][w], _mm512_set1_ps(correction));
          high[g][w] = _mm512_mul_ps(high[g][w], _mm512_set1_ps(correction));
        }
      vfloat probs = round_to<bf16>(exp_lanes(scores - max[g]));
      for (int64_t p = count; p < kLanes; ++p) probs[p] = 0.f;
      sums[g] += probs;  // summed across lanes once, at the end
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[g]), (__m256i)_mm512_cvtneps_pbh((__m512)probs));
    }
    for (int64_t p = 0; p < count; p += 2) {
      const C* first = value_cache + (keys[p] - key_cache);
      const C* second = p + 1 < count ? value_cache + (keys[p + 1] - key_cache) : nullptr;
#if defined(__AVX512VBMI__)
      if constexpr (kByteTables<C>) {
        for (int w = 0; w < W; w += 2) {
          using Words = typename decltype(widen)::Words;
          const Words a = widen.load(first + w * 32);
          const Words b = second != nullptr ? widen.load(second + w * 32)
                                            : Words{_mm512_setzero_si512(), _mm512_setzero_si512()};
          const __m512bh lo[2] = {(__m512bh)_mm512_unpacklo_epi16(a.front, b.front),
                                  (__m512bh)_mm512_unpacklo_epi16(a.back, b.back)};
          const __m512bh hi[2] = {(__m512bh)_mm512_unpackhi_epi16(a.front, b.front),
                                  (__m512bh)_mm512_unpackhi_epi16(a.back, b.back)};
          for (int g = 0; g < G; ++g) {
            const __m512bh weights = (__m512bh)_mm512_set1_epi32(int(pairs[g][p / 2]));
            for (int h = 0; h < 2; ++h) {
              low[g][w + h] = _mm512_dpbf16_ps(low[g][w + h], lo[h], weights);
              high[g][w + h] = _mm512_dpbf16_ps(high[g][w + h], hi[h], weights);
            }
          }
        }
      } else
#endif
      for (int w = 0; w < W; ++w) {
        const __m512i a = load_bf16x32(first + w * 32);
        const __m512i b = second != nullptr ? load_bf16x32(second + w * 32) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < G; ++g) {
          const __m512bh weights = (__m512bh)_mm512_set1_epi32(int(pairs[g][p / 2]));
          low[g][w] = _mm512_dpbf16_ps(low[g][w], lo, weights);
          high[g][w] = _mm512_dpbf16_ps(high[g][w], hi, weights);
        }
      }
    }
  }
  for (int64_t start = len + shift; start < next.len; start += kLanes) prefetch_rows<2>(next, start, block_size, dim);
#if defined(TRITONLLM_AMX)
  if constexpr (AmxOut) {
    amx_out.store();
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) {
        low[g][w] = (__m512)load(amx_out.spill[2 * w][g]);
        high[g][w] = (__m512)load(amx_out.spill[2 * w + 1][g]);
      }
  }
#endif
#if defined(__AVX512VBMI__)
  if constexpr (kByteTables<C>) {
    // Dims 16l..16l + 15 are lane l of low and high of the front words (16l + 0..3, 4..7) and of
    // the back ones (8..11, 12..15): a 4 x 4 transpose of 128-bit lanes per 64 dims.
    const __m512i lanes_01 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i lanes_23 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512i halves_0 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i halves_1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int g = 0; g < G; ++g) {
      const vfloat inverse = splat(item.value_scale / sum_lanes(sums[g]));
      for (int w = 0; w < W; w += 2) {
        bf16* dims = out + g * dim + w * 32;
        for (int half = 0; half < 2; ++half) {  // dims 0-31, then 32-63
          const __m512i lanes = half == 0 ? lanes_01 : lanes_23;
          const __m512 front = _mm512_permutex2var_ps(low[g][w], lanes, high[g][w]);
          const __m512 back = _mm512_permutex2var_ps(low[g][w + 1], lanes, high[g][w + 1]);
          store(dims + half * 32, (vfloat)_mm512_permutex2var_ps(front, halves_0, back) * inverse);
          store(dims + half * 32 + 16, (vfloat)_mm512_permutex2var_ps(front, halves_1, back) * inverse);
        }
      }
    }
    return;
  }
#endif
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < G; ++g) {
    const float sum = sum_lanes(sums[g]);
    const vfloat inverse = splat(std::is_same_v<C, bf16> ? 1.f / sum : item.value_scale / sum);
    for (int w = 0; w < W; ++w) {
      store(out + g * dim + w * 32, (vfloat)_mm512_permutex2var_ps(low[g][w], first_half, high[g][w]) * inverse);
      store(out + g * dim + w * 32 + 16, (vfloat)_mm512_permutex2var_ps(low[g][w], second_half, high[g][w]) * inverse);
    }
  }
}
#endif

// T: the query's and output's type; C: the cache's (T, or an 8-bit type).
template <typename T, typename C = T>
using AttendOne = void (*)(T*, const T*, const Item<C>&, const Item<C>&, int64_t, float, float);

// attend_one where vectors are 16 floats (32 registers), attend_one_narrow where they are 8 or 4.
template <typename T, typename C, int G, int V>
constexpr AttendOne<T, C> attend_for() {
  if constexpr (kLanes == 16) return attend_one<T, C, G, V>;
  else return attend_one_narrow<T, C, G, V>;
}

template <typename T, typename C, int V>
AttendOne<T, C> pick_group(int64_t group) {
  switch (group) {
    case 1: return attend_for<T, C, 1, V>();
    case 2: return attend_for<T, C, 2, V>();
    case 3: return attend_for<T, C, 3, V>();
    case 4: return attend_for<T, C, 4, V>();
    case 5: return attend_for<T, C, 5, V>();
    case 6: return attend_for<T, C, 6, V>();
    case 7: return attend_for<T, C, 7, V>();
    case 8: return attend_for<T, C, 8, V>();
    default: return nullptr;
  }
}

#if defined(__AVX512BF16__)
template <typename C, int W, bool Amx = false>
AttendOne<bf16, C> pick_group_bf16_dot(int64_t group) {
  switch (group) {
    case 1: return attend_one_bf16_dot<C, 1, W, Amx>;
    case 2: return attend_one_bf16_dot<C, 2, W, Amx>;
    case 3: return attend_one_bf16_dot<C, 3, W, Amx>;
    case 4: return attend_one_bf16_dot<C, 4, W, Amx>;
    case 5: return attend_one_bf16_dot<C, 5, W, Amx>;
    case 6: return attend_one_bf16_dot<C, 6, W, Amx>;
    case 7: return attend_one_bf16_dot<C, 7, W, Amx>;
    case 8: return attend_one_bf16_dot<C, 8, W, Amx>;
    default: return nullptr;
  }
}
#endif
AmxSwitch decode_amx;  // paged_attention's bfloat16 decodes on AMX tiles

// query [tokens, heads, dim] packed; cache [2, kv_heads, num_blocks, block_size, dim]. Each token
// attends to positions [0, context_lens[t]) of the sequence whose blocks are row token_rows[t] of
// block_tables: a decode token to its whole sequence, a prefill token to the positions up to its
// own (causal, cached prefix included). One kernel for the step's decodes and prefill chunks; a
// prefill chunk's keys and values stay in cache while its tokens, taken in order, read them. The
// Python side only calls with dim 64 or 128 and at most 8 query heads per KV head. A sliding
// `window` > 0 starts each token at position max(0, context_lens[t] - window) (it sees keys j with
// position - window < j <= position); a soft `cap` > 0 caps the scaled scores before the softmax.
// A cache of 8-bit elements C holds what the scores and the output are scaled by: `scale` and
// `value_scale` include the cache's scales (and E4M3's 2^8, see load(const e4m3*)).
template <typename T, typename C = T>
void paged_attention(T* out, const T* query, const C* cache, const int32_t* block_tables,
                     int64_t table_width, const int32_t* token_rows, const int32_t* context_lens,
                     int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_blocks,
                     int64_t block_size, float scale, int64_t window, float cap, float value_scale = 1.f) {
  const int64_t group = heads / kv_heads, head_cache = num_blocks * block_size * dim;
  AttendOne<T, C> one = dim == 64 ? pick_group<T, C, 64 / kLanes>(group) : pick_group<T, C, 128 / kLanes>(group);
  bool amx = false;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>)
    one = dim == 64 ? pick_group_bf16_dot<C, 2>(group) : pick_group_bf16_dot<C, 4>(group);
#endif
#if defined(TRITONLLM_AMX)
  if constexpr (std::is_same_v<T, bf16>) {
    amx = decode_amx.on();
    if (amx) one = dim == 64 ? pick_group_bf16_dot<C, 2, true>(group) : pick_group_bf16_dot<C, 4, true>(group);
  }
#endif
  const int64_t items = tokens * kv_heads;  // item i: token i / kv_heads, KV head i % kv_heads
  auto item_at = [&](int64_t item) {
    const int64_t t = item / kv_heads, kvh = item % kv_heads;
    const int64_t len = context_lens[t];
    return Item<C>{cache + kvh * head_cache, cache + (kv_heads + kvh) * head_cache,
                   block_tables + token_rows[t] * table_width, len,
                   window > 0 ? std::max<int64_t>(0, len - window) : 0, value_scale};
  };
  // The item a thread takes after the current one is asked for into L2 a chunk at a time while the
  // current one computes: a decode's blocks are in no cache, and the kernel otherwise waits on
  // memory and computes in turn. 64 decodes over ~205 positions (blocks as the engine lays them
  // out), 30 layers: 0.53-0.56 -> 0.42-0.43 ms a layer, against 0.37 to only read those blocks;
  // into L1 instead: 0.63. Nothing to prefetch past the last item, nor for a prefill token after
  // the first of its chunk: the token before it has just read the same blocks (prefetching them
  // anyway: prefill 2-3% slower). Nor for an item with more than kMaxPrefetchBytes of keys and
  // values: the current item and the next must fit in L2 together, or the next's evict the
  // current's before they are read (long contexts; docs/benchmarks.md, "Long prompts").
  auto to_prefetch = [&](int64_t item) {
    const int64_t t = item / kv_heads;
    if (item >= items || (t > 0 && token_rows[t] == token_rows[t - 1])) return Item<C>{};
    const Item<C> next = item_at(item);
    return next.is_long(dim) ? Item<C>{} : next;
  };
  // Dynamic scheduling by hand: a thread claims its next item before computing the current one,
  // so that it knows what to prefetch.
  std::atomic<int64_t> claimed{0};
#pragma omp parallel
  {
#if defined(TRITONLLM_AMX)
    if (amx) configure_tiles();  // each thread's own tile registers
#endif
    int64_t item = claimed++;
    while (item < items) {
      const int64_t following = claimed++;
      const int64_t offset = (item / kv_heads * heads + item % kv_heads * group) * dim;
      one(out + offset, query + offset, item_at(item), to_prefetch(following), block_size, scale, cap);
      item = following;
    }
#if defined(TRITONLLM_AMX)
    if (amx) _tile_release();
#endif
  }
  (void)amx;
}


// One token per row of float32 logits [rows, vocab] (rows `stride` apart). Temperature 0: the first
// index of the largest logit, as torch's argmax. Otherwise the first token whose running sum of
// exp((logit - max) / T) passes uniform * total: inverse-CDF sampling from softmax(logits / T),
// as Sampler's torch path, in three vectorised passes over the row instead of softmax + cumsum.
// A logit of -inf has probability exactly 0 and is never drawn.
void sample_rows(int64_t* out, const float* logits, int64_t stride, int64_t rows, int64_t vocab,
                 const float* temperatures, const float* uniforms) {
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * stride;
    const int64_t whole = vocab / kLanes * kLanes;
    vfloat lanes = splat(-INFINITY);
    for (int64_t i = 0; i < whole; i += kLanes) {
      vfloat v = load(x + i);
      lanes = v > lanes ? v : lanes;
    }
    float max = max_lanes(lanes);
    for (int64_t i = whole; i < vocab; ++i) max = std::max(max, x[i]);
    if (temperatures[r] <= 0.f || max == -INFINITY) {  // greedy (or nothing allowed: token 0)
      int64_t first = 0;
      while (first < vocab && !(x[first] == max)) ++first;
      out[r] = first < vocab ? first : 0;
      continue;
    }
    const float inverse = 1.f / temperatures[r];
    auto probs = [&](int64_t i) {  // kLanes unnormalised probabilities from position i
      vfloat v = load(x + i);
      vfloat p = exp_lanes((v - max) * inverse);
      return v > -INFINITY ? p : splat(0.f);
    };
    auto prob = [&](int64_t i) { return x[i] > -INFINITY ? std::exp((x[i] - max) * inverse) : 0.f; };
    vfloat sums = {};
    for (int64_t i = 0; i < whole; i += kLanes) sums += probs(i);
    float total = sum_lanes(sums);
    for (int64_t i = whole; i < vocab; ++i) total += prob(i);
    const float target = uniforms[r] * total;
    float running = 0.f;
    int64_t chosen = -1, last_possible = 0;
    for (int64_t i = 0; i < whole && chosen < 0; i += kLanes) {
      vfloat p = probs(i);
      const float chunk = sum_lanes(p);
      if (chunk > 0.f) {
        if (running + chunk > target) {
          for (int64_t j = 0; j < kLanes && chosen < 0; ++j) {
            running += p[j];
            if (p[j] > 0.f && running > target) chosen = i + j;
          }
        } else {
          running += chunk;
        }
        for (int64_t j = kLanes - 1; j >= 0; --j)
          if (p[j] > 0.f) { last_possible = i + j; break; }
      }
    }
    for (int64_t i = whole; i < vocab && chosen < 0; ++i) {
      const float p = prob(i);
      running += p;
      if (p > 0.f) last_possible = i;
      if (p > 0.f && running > target) chosen = i;
    }
    out[r] = chosen >= 0 ? chosen : last_possible;  // rounding left the target past the end
  }
}

// The fused multiply-adds this CPU retires a second: each thread runs kChains independent chains of
// vector FMAs (enough to cover the instruction's latency on every pipe), `rounds` times. Returns the
// float operations done (2 per lane per FMA); the caller times the call. What "% of the FMA peak"
// in docs/benchmarks.md divides by: clocks are not reported inside VMs, so the peak is measured.
volatile float sink;

__attribute__((optimize("fp-contract=fast"))) int64_t fma_peak(int64_t rounds) {
  constexpr int kChains = 12;
  int64_t threads = 1;
  float checksum = 0.f;
#pragma omp parallel
  {
#pragma omp single
    threads = omp_get_num_threads();
    vfloat acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = splat(1.f + c * 1e-3f);
    const vfloat a = splat(0.999999f), b = splat(1e-7f);
    for (int64_t r = 0; r < rounds; ++r) {
#pragma GCC unroll 12
      for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * a + b;
    }
    float total = 0.f;
    for (int c = 0; c < kChains; ++c) total += sum_lanes(acc[c]);
#pragma omp atomic
    checksum += total;
  }
  sink = checksum;  // the chains' results are used, so they are computed
  return threads * rounds * kChains * kLanes * 2;
}

}  // namespace

// The C entry points: one per op and element type (f32, bf16), pointers in, nothing returned.
#define EXPORT(T, SUFFIX)                                                                            \
  extern "C" void rms_norm_##SUFFIX(void* out, const void* x, int64_t x_stride, const void* weight,   \
                                    int64_t rows, int64_t size, float eps) {                          \
    rms_norm<T>((T*)out, nullptr, (const T*)x, x_stride, nullptr, (const T*)weight, rows, size, eps); \
  }                                                                                                  \
  extern "C" void add_rms_norm_##SUFFIX(void* out, void* residual_out, const void* x,                \
                                        int64_t x_stride, const void* residual, const void* weight,  \
                                        int64_t rows, int64_t size, float eps) {                      \
    rms_norm<T>((T*)out, (T*)residual_out, (const T*)x, x_stride, (const T*)residual,               \
                (const T*)weight, rows, size, eps);                                                  \
  }                                                                                                  \
  extern "C" void rotary_##SUFFIX(void* q_out, void* k_out, const void* q, int64_t q_stride,         \
                                  const void* k, int64_t k_stride, const void* cos, const void* sin, \
                                  int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim) {    \
    rotary<T>((T*)q_out, (T*)k_out, (const T*)q, q_stride, (const T*)k, k_stride, (const T*)cos,     \
              (const T*)sin, tokens, heads, kv_heads, dim);                                          \
  }                                                                                                  \
  extern "C" void silu_and_mul_##SUFFIX(void* out, const void* x, int64_t rows, int64_t size) {      \
    silu_and_mul<T>((T*)out, (const T*)x, rows, size);                                               \
  }                                                                                                  \
  extern "C" void reshape_and_cache_##SUFFIX(void* cache, const void* key, int64_t key_stride,       \
                                             const void* value, int64_t value_stride,                \
                                             const int64_t* slot_mapping, int64_t tokens,            \
                                             int64_t kv_heads, int64_t dim, int64_t num_slots) {     \
    reshape_and_cache<T>((T*)cache, (const T*)key, key_stride, (const T*)value, value_stride,        \
                         slot_mapping, tokens, kv_heads, dim, num_slots);                            \
  }                                                                                                  \
  extern "C" void paged_attention_##SUFFIX(                                                          \
      void* out, const void* query, const void* cache, const int32_t* block_tables,                  \
      int64_t table_width, const int32_t* token_rows, const int32_t* context_lens, int64_t tokens,    \
      int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_blocks, int64_t block_size,          \
      float scale, int64_t window, float cap) {                                                      \
    paged_attention<T>((T*)out, (const T*)query, (const T*)cache, block_tables, table_width,        \
                       token_rows, context_lens, tokens, heads, kv_heads, dim, num_blocks,           \
                       block_size, scale, window, cap);                                              \
  }

// The 8-bit cache's entry points: `e5m2` picks the code (E4M3 when 0); k_scale and v_scale are the
// layer's (what each stored key and value was divided by).
#define EXPORT_FP8(T, SUFFIX)                                                                        \
  extern "C" void reshape_and_cache_fp8_##SUFFIX(                                                    \
      void* cache, const void* key, int64_t key_stride, const void* value, int64_t value_stride,     \
      const int64_t* slot_mapping, int64_t tokens, int64_t kv_heads, int64_t dim, int64_t num_slots,  \
      int64_t e5m2_codes, float k_scale, float v_scale) {                                             \
    if (e5m2_codes)                                                                                  \
      reshape_and_cache_fp8<T, e5m2>((e5m2*)cache, (const T*)key, key_stride, (const T*)value,      \
                                     value_stride, slot_mapping, tokens, kv_heads, dim, num_slots,  \
                                     k_scale, v_scale);                                             \
    else                                                                                             \
      reshape_and_cache_fp8<T, e4m3>((e4m3*)cache, (const T*)key, key_stride, (const T*)value,      \
                                     value_stride, slot_mapping, tokens, kv_heads, dim, num_slots,  \
                                     k_scale, v_scale);                                             \
  }                                                                                                  \
  extern "C" void paged_attention_fp8_##SUFFIX(                                                      \
      void* out, const void* query, const void* cache, const int32_t* block_tables,                  \
      int64_t table_width, const int32_t* token_rows, const int32_t* context_lens, int64_t tokens,    \
      int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_blocks, int64_t block_size,          \
      float scale, int64_t window, float cap, int64_t e5m2_codes, float k_scale, float v_scale) {    \
    if (e5m2_codes)                                                                                  \
      paged_attention<T, e5m2>((T*)out, (const T*)query, (const e5m2*)cache, block_tables,           \
                               table_width, token_rows, context_lens, tokens, heads, kv_heads, dim,  \
                               num_blocks, block_size, scale * k_scale, window, cap, v_scale);       \
    else                                                                                             \
      paged_attention<T, e4m3>((T*)out, (const T*)query, (const e4m3*)cache, block_tables,           \
                               table_width, token_rows, context_lens, tokens, heads, kv_heads, dim,  \
                               num_blocks, block_size, scale * k_scale * Fp8Format<e4m3>::kUnit,     \
                               window, cap, v_scale * Fp8Format<e4m3>::kUnit);                       \
  }

// Whether bfloat16 decodes score on AMX tiles: built for them, asked for them by `enable` (1 on, 0
// off, -1 as it is) and the OS lending them.
extern "C" int64_t paged_attention_amx(int64_t enable) { return decode_amx.set(enable); }

extern "C" int64_t fma_peak_flop(int64_t rounds) { return fma_peak(rounds); }

extern "C" void sample_rows_f32(int64_t* out, const float* logits, int64_t stride, int64_t rows,
                                int64_t vocab, const float* temperatures, const float* uniforms) {
  sample_rows(out, logits, stride, rows, vocab, temperatures, uniforms);
}

EXPORT(float, f32)
EXPORT(bf16, bf16)
EXPORT_FP8(float, f32)
EXPORT_FP8(bf16, bf16)
