// The KV cache's element types and addressing, shared by the attention kernels that read it in place
// (cpu_ops.cpp: decodes and short prefill chunks; cpu_prefill_attention.cpp: long prefill chunks).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "vectors.h"

namespace {

// The cache row (block * block_size + offset) holding a sequence's position. block_size is a power
// of two (EngineConfig checks): shifts, not a division per position. always_inline here and in the kernels:
// GCC does not inline into the attention kernels otherwise (their fp-contract attribute differs),
// and a call per position cost random-block attention 0.78 -> 0.99 ms a layer.
__attribute__((always_inline)) inline int64_t row_of(const int32_t* table, int64_t pos, int64_t block_size) {
  const int shift = __builtin_ctzll(block_size);
  return (int64_t(table[pos >> shift]) << shift) + (pos & (block_size - 1));
}

// 8-bit KV caches (kv_cache_dtype fp8): float8 E4M3 (the "fn" variant: no infinities, 448 its
// largest value) or E5M2, each code x / scale for its layer's key or value scale.
struct e4m3 {
  uint8_t bits;
};
struct e5m2 {
  uint8_t bits;
};
template <typename C> struct Fp8Format;
template <> struct Fp8Format<e4m3> {
  static constexpr int kMantissa = 3, kBias = 7;
  static constexpr float kMax = 448.f, kMinNormal = 0x1p-6f;
  static constexpr float kUnit = 256.f;  // what load() leaves out of each value (below)
};
template <> struct Fp8Format<e5m2> {
  static constexpr int kMantissa = 2, kBias = 15;
  static constexpr float kMax = 57344.f, kMinNormal = 0x1p-14f;
  static constexpr float kUnit = 1.f;
};

typedef uint8_t vbyte __attribute__((vector_size(kLanes)));
typedef int8_t vsbyte __attribute__((vector_size(kLanes)));
typedef int16_t vshort __attribute__((vector_size(kLanes * 2)));

// kLanes codes -> float32, as the value / kUnit: an E5M2 code is a float16's top byte and an E4M3
// code's exponent and mantissa sit one bit lower, where they read as the value / 2^8 (subnormals
// included); the callers fold kUnit into the attention's scales, never per element. Where there is
// no float16 conversion instruction, the code's bits go into a float32's places instead (a float32
// subnormal for a subnormal code) and one multiply by 2^112 rebiases both types' exponents.
template <typename C> __attribute__((always_inline)) inline vfloat load_fp8(const C* p) {
  vbyte bytes;
  std::memcpy(&bytes, p, sizeof bytes);
#if defined(__AVX512F__) || defined(__F16C__)
  vhalf code;
  if constexpr (std::is_same_v<C, e4m3>) {
    // E4M3: the code sign-extended (vpmovsxbw) and moved up 7 bits puts its sign at bit 15 and at
    // bit 14 and its exponent and mantissa one bit below a float16's; the mask clears bit 14. Three
    // instructions, where zero-extending, moving up 8 and back 1 and selecting the sign took five
    // on AVX2 (no vpternlog): the fp8 kernel widens every code before its FMAs.
    const vshort wide = __builtin_convertvector((vsbyte)bytes, vshort);
    code = ((vhalf)wide << 7) & 0xbf80;
  } else {
    code = __builtin_convertvector(bytes, vhalf) << 8;
  }
#if defined(__AVX512F__)
  return (vfloat)_mm512_maskz_cvtph_ps(0xffff, (__m256i)code);  // not _mm512_cvtph_ps: GCC 12 warns in it
#else
  return (vfloat)_mm256_cvtph_ps((__m128i)code);
#endif
#else
  const vuint code = __builtin_convertvector(bytes, vuint);
  vuint bits = (code & 0x7fu) << (std::is_same_v<C, e5m2> ? 21 : 20);
  vfloat magnitude;
  std::memcpy(&magnitude, &bits, sizeof magnitude);
  magnitude *= 0x1p112f;
  std::memcpy(&bits, &magnitude, sizeof bits);
  bits |= (code & 0x80u) << 24;
  vfloat value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}
__attribute__((always_inline)) inline vfloat load(const e4m3* p) { return load_fp8(p); }
__attribute__((always_inline)) inline vfloat load(const e5m2* p) { return load_fp8(p); }

// widen_row's order on AVX2 (below): within each 32 dims, the even dims, then the odd ones. Element
// k of a widened row holds dim widened_dim(k); a kernel permutes its query alike and its output back.
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
template <int64_t Dim> constexpr bool kWidenInterleaves = Dim % 32 == 0;
#else
template <int64_t Dim> constexpr bool kWidenInterleaves = false;
#endif
__attribute__((always_inline)) inline int64_t widened_dim(int64_t k) {
  const int64_t r = k & 31;
  return k - r + (r < 16 ? 2 * r : 2 * (r - 16) + 1);
}

// A row of Dim codes widened to float32 (load_fp8's values) at `out`. On AVX2 without AVX-512, 32
// codes at a time, with no instruction on the shuffle port, which widening in order (byte to word
// extension, float16 conversion from a register, lane extraction: 4 of 5 instructions) kept busy
// while the FMA ports waited: the 32 bytes read as 16 words, each word's low code moved up to a
// float16's place with shifts and its high code masked in place, both stored as float16s and
// converted from memory (a conversion from memory does not use the shuffle port).
template <typename C, int64_t Dim> __attribute__((always_inline)) inline void widen_row(float* out, const C* codes) {
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
  if constexpr (kWidenInterleaves<Dim>) {
    alignas(32) uint16_t half[Dim];
    for (int64_t i = 0; i < Dim; i += 32) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
      __m256i even, odd;
      if constexpr (std::is_same_v<C, e4m3>) {  // as load_fp8: sign at bits 15 and 14, bit 14 cleared
        const __m256i mask = _mm256_set1_epi16(short(0xbf80));
        even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(words, 8), 1), mask);
        odd = _mm256_and_si256(_mm256_srai_epi16(words, 1), mask);
      } else {
        even = _mm256_slli_epi16(words, 8);
        odd = _mm256_and_si256(words, _mm256_set1_epi16(short(0xff00)));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(half + i), even);
      _mm256_store_si256(reinterpret_cast<__m256i*>(half + i + 16), odd);
    }
    for (int64_t i = 0; i < Dim; i += 8) {
      __m256 value;  // asm: GCC would otherwise keep `half` in registers and extract their halves
      asm("vcvtph2ps %1, %0" : "=x"(value) : "m"(*reinterpret_cast<const __m128i*>(half + i)));
      _mm256_storeu_ps(out + i, value);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < Dim; i += kLanes) store(out + i, load_fp8(codes + i));
}

}  // namespace
