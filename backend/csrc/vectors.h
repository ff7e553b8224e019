// Float vectors shared by the C++ ops (cpu_ops.cpp) and the linear kernel (cpu_linear.cpp): the
// target's float32 lanes, loads and stores of float32 and bfloat16, bfloat16 rounding, exp. One
// definition, so that an op fused into the linear kernel computes what the op alone does, bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

struct bf16 {
  uint16_t bits;
};

// GCC's generic vectors as wide as the target's registers: 16 floats with AVX-512, 8 with AVX2, 4
// with SSE (x86-64-v2) or NEON (aarch64). A vector wider than the target's registers would be split
// by the compiler anyway, and passing one by value changes the ABI (g++'s -Wpsabi warning). The
// Python side checks that rows are whole multiples of 16 floats, so of kLanes on every target.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
constexpr int64_t kRowMultiple = 16;  // cpu_ops.supports(..., multiple=16)
static_assert(kRowMultiple % kLanes == 0, "rows must be whole vectors");
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vuint __attribute__((vector_size(kLanes * 4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * 2)));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vfloat load(const bf16* p) {  // bfloat16 is the top half of a float32
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  vuint u = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
inline void store(bf16* p, vfloat v) {  // round to nearest even, NaN kept quiet, as torch does
  vuint u;
  std::memcpy(&u, &v, sizeof u);
  vuint rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  vuint is_nan = (vuint)(v != v);
  rounded = (is_nan & 0x7fc0u) | (~is_nan & rounded);
  vhalf h = __builtin_convertvector(rounded, vhalf);
  std::memcpy(p, &h, sizeof h);
}

// The value an op computed in T holds: float32 rounded to T (nearest even) and widened again.
template <typename T> inline vfloat round_to(vfloat v);
template <> inline vfloat round_to<float>(vfloat v) { return v; }
template <> inline vfloat round_to<bf16>(vfloat v) {
  vuint u;
  std::memcpy(&u, &v, sizeof u);
  vuint rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  vfloat r;
  std::memcpy(&r, &rounded, sizeof r);
  return v != v ? v : r;
}

inline vfloat splat(float x) { return vfloat{} + x; }

// exp on each lane: 2^n * e^r with |r| <= ln2 / 2 and a degree-6 polynomial (Cephes' expf,
// a few ulp), for softmax and silu. Inputs are clamped to [-87, 88]: e^x is then (almost) 0 below
// and a huge finite number above, where callers only divide by it.
inline vfloat exp_lanes(vfloat x) {
  x = x < -87.f ? splat(-87.f) : x;
  x = x > 88.f ? splat(88.f) : x;
  vfloat n = x * 1.44269504088896341f;
  n = __builtin_convertvector(__builtin_convertvector(n + (n < 0.f ? splat(-0.5f) : splat(0.5f)), vint), vfloat);
  vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat poly = splat(1.9875691500e-4f);
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.f;
  vint exponent = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  return poly * scale;
}

// silu(gate) * up as torch computes it in T: the silu rounded to T, then the product.
template <typename T> inline vfloat silu_and_mul_lanes(vfloat gate, vfloat up) {
  return round_to<T>(gate / (1.f + exp_lanes(-gate))) * up;
}

}  // namespace
