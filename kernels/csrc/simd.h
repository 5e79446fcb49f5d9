// The vector operations the int8 kernels are written in, for the instruction set this
// file is compiled for: AVX-512 with VNNI (16 lanes), AVX2 with FMA and F16C (8 lanes), or
// plain C++ (16 lanes in arrays). The kernels read the same way for each; only how a lane
// gets its value differs, and each variant is one library of its own.
//
// or_bits(codes, plane, shift, mask): codes with ((plane >> shift) & mask) << 4 added in
// each byte (the top bits of 5- and 6-bit codes, kept in a plane of their own);
// or_bits<kShift, kMask>(codes, plane) the same with the shift known at compile time: one
// shift moves the bits to bit 4 (a byte's bits kShift.. stay in that byte while
// kShift + width <= 8), then a mask and an or.
//
// reduce(v): the sum of v's lanes, in one fixed order; reduce_max(v): their largest.
//
// exp(v): e to each lane (Cephes' range reduction and polynomial, within 2 ulp of expf for
// the inputs attention gives it, x <= 0); a lane below -87.3 (so -inf too) is exactly 0.
//
// dot(acc, w, x4): each 32-bit lane of acc plus the dot product of its four code bytes
// (unsigned) with the four int8 values of x4 (one 32-bit word, the same for every lane).
//
// A factor is a per-lane integer (a K-quant's sub-scale or sub-min) in the form this
// variant multiplies by: factor_i8 loads one (kLanes bytes), unit_factor() is 1
// in every lane; add_scaled(acc, dots, f): acc + dots * f. A factor pair holds two adjacent
// groups' factors per lane (2 * kLanes bytes: the first group's lanes, then the second's) as
// 16-bit halves; add_pair_times(acc, pair, v): acc + pair.first * v.low + pair.second *
// v.high for the two 16-bit halves of v. add_times(acc, a, v): acc + a * v. All exact in
// 32-bit lanes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LS_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LS_AVX2 1
#include <immintrin.h>
#endif

namespace ls {

inline float half_to_float(uint16_t h) {
  // IEEE binary16 -> binary32, exact (normals, subnormals, infinities, NaNs).
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while (!(mantissa & 0x400)) mantissa <<= 1, --exponent;
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// binary32 -> binary16, rounding to nearest, ties to even, as torch's .to(float16) does
// (subnormals, overflow to infinity, NaN kept quiet).
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t magnitude = x & 0x7FFFFFFF;
  if (magnitude > 0x7F800000) return sign | 0x7E00 | static_cast<uint16_t>((magnitude >> 13) & 0x3FF);  // NaN
  if (magnitude >= 0x477FF000) return sign | 0x7C00;  // rounds to at least 65520: infinity
  if (magnitude < 0x38800000) {  // below 2**-14: a subnormal half (or zero)
    // Add 0.5 (as a float, so the FPU rounds to the 2**-24 grid, ties to even), keep the bits.
    float shifted;
    const uint32_t abs_bits = magnitude;
    std::memcpy(&shifted, &abs_bits, sizeof shifted);
    shifted += 0.5f;
    uint32_t bits;
    std::memcpy(&bits, &shifted, sizeof bits);
    return sign | static_cast<uint16_t>(bits - 0x3F000000);
  }
  const uint32_t odd = (magnitude >> 13) & 1;  // ties go to the even mantissa
  return sign | static_cast<uint16_t>((magnitude - 0x38000000 + 0xFFF + odd) >> 13);
}

// bfloat16 is binary32's top half: widening is a shift; narrowing rounds to nearest even
// (NaN stays a quiet NaN), as torch's .to(bfloat16).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((x >> 16) | 0x40);
  return static_cast<uint16_t>((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

// exp(x) = 2^n * e^r with n = round(x / ln 2) and r = x - n ln 2 (ln 2 in two parts, so r is
// exact), e^r = 1 + r + r^2 * P(r): Cephes' expf constants.
namespace exp_constants {
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
constexpr float kMin = -87.3f, kMax = 88.3762626647949f;
}  // namespace exp_constants

// The same steps on any vector type: only rounding, the power of two and the zeroing of
// lanes below kMin differ by instruction set.
template <typename S>
inline typename S::F exp_lanes(typename S::F x) {
  using namespace exp_constants;
  const typename S::F clamped = S::minf(x, S::set1f(kMax));
  const typename S::F n = S::round(S::mul(clamped, S::set1f(kLog2e)));
  typename S::F r = S::fnmadd(n, S::set1f(kLn2High), clamped);
  r = S::fnmadd(n, S::set1f(kLn2Low), r);
  typename S::F poly = S::set1f(kP0);
  poly = S::fmadd(poly, r, S::set1f(kP1));
  poly = S::fmadd(poly, r, S::set1f(kP2));
  poly = S::fmadd(poly, r, S::set1f(kP3));
  poly = S::fmadd(poly, r, S::set1f(kP4));
  poly = S::fmadd(poly, r, S::set1f(kP5));
  const typename S::F e_r = S::add(S::fmadd(poly, S::mul(r, r), r), S::set1f(1.0f));
  return S::zero_below(S::mul(e_r, S::pow2(n)), x, kMin);
}

#if defined(LS_AVX512)
constexpr const char* kVariant = "avx512_vnni";
struct Simd {
  static constexpr int kLanes = 16;
  using I = __m512i;
  using F = __m512;
  static I load_codes(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void store_codes(uint8_t* p, I v) { _mm512_storeu_si512(p, v); }
  static I low_nibbles(I w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
  // 16 bytes repeated in every 128-bit lane, and a byte-wise lookup of values 0-15 in them.
  static I broadcast16(const uint8_t* p) {  // the zero-masked form: the plain one warns (undefined source)
    return _mm512_maskz_broadcast_i32x4(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I lookup16(I table, I index) { return _mm512_shuffle_epi8(table, index); }
  static I or_bits(I codes, I plane, int shift, int mask) {
    const I bits = _mm512_and_si512(_mm512_srl_epi32(plane, _mm_cvtsi32_si128(shift)), _mm512_set1_epi8(mask));
    return _mm512_or_si512(codes, _mm512_slli_epi32(bits, 4));
  }
  template <int kShift, int kMask>
  static I or_bits(I codes, I plane) {
    static_assert(kShift >= 0 && kShift < 8 && kMask < 16, "top bits within a byte");
    I moved;
    if constexpr (kShift <= 4)
      moved = _mm512_slli_epi32(plane, 4 - kShift);
    else
      moved = _mm512_srli_epi32(plane, kShift - 4);
    return _mm512_or_si512(codes, _mm512_and_si512(moved, _mm512_set1_epi8(static_cast<char>(kMask << 4))));
  }
  template <bool kWide>
  static I dot(I acc, I w, int32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4)); }
  static constexpr bool kNoByteDot = false;  // dpbusd sums byte products into 32 bits itself
  static I dot16(I acc, I, int32_t) { return acc; }
  static I widen16(I acc, I, I) { return acc; }
  static I dot_centred(I acc, I, int32_t, I) { return acc; }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I factor_i8(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I unit_factor() { return _mm512_set1_epi32(1); }
  static I add_scaled(I acc, I dots, I factor) { return _mm512_add_epi32(acc, _mm512_mullo_epi32(dots, factor)); }
  // 16-bit words [first 0..15, second 0..15] into lanes (first l, second l).
  static I interleave_pair(I words) {
    const I order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                     20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, words);
  }
  static I factor_pair_i8(const int8_t* p) {
    return interleave_pair(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static I factor_pair_u8(const uint8_t* p) {
    return interleave_pair(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static I add_pair_times(I acc, I pair, int32_t v) { return _mm512_add_epi32(acc, _mm512_madd_epi16(pair, _mm512_set1_epi32(v))); }
  static I add_times(I acc, I a, int32_t v) { return add_scaled(acc, a, _mm512_set1_epi32(v)); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static F load_i8(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static F load_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static float reduce(F v) { return _mm512_reduce_add_ps(v); }
  static F maxf(F a, F b) { return _mm512_max_ps(a, b); }
  static F minf(F a, F b) { return _mm512_min_ps(a, b); }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  static F round(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static F zero_below(F v, F x, float floor) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(floor), _CMP_GE_OQ), v);
  }
  static F exp(F x) { return exp_lanes<Simd>(x); }
};
#elif defined(LS_AVX2)
constexpr const char* kVariant = "avx2";
struct Simd {
  static constexpr int kLanes = 8;
  using I = __m256i;
  using F = __m256;
  static I load_codes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store_codes(uint8_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static I low_nibbles(I w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F)); }
  static I broadcast16(const uint8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I lookup16(I table, I index) { return _mm256_shuffle_epi8(table, index); }
  static I or_bits(I codes, I plane, int shift, int mask) {
    const I bits = _mm256_and_si256(_mm256_srl_epi32(plane, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(mask));
    return _mm256_or_si256(codes, _mm256_slli_epi32(bits, 4));
  }
  template <int kShift, int kMask>
  static I or_bits(I codes, I plane) {
    static_assert(kShift >= 0 && kShift < 8 && kMask < 16, "top bits within a byte");
    I moved;
    if constexpr (kShift <= 4)
      moved = _mm256_slli_epi32(plane, 4 - kShift);
    else
      moved = _mm256_srli_epi32(plane, kShift - 4);
    return _mm256_or_si256(codes, _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(kMask << 4))));
  }
  // maddubs sums byte pairs into saturating int16: exact while codes stay below 128
  // (2 * 127 * 127 fits), so AVX2 has no 32-bit byte dot: narrow codes go through dot16 and
  // widen16, wide ones (|u - 128| <= 128, 2 * 128 * 127 fits) through dot_centred.
  template <bool kWide>
  static I dot(I, I, int32_t) = delete;
  // Codes below 128: the byte pair products summed in 16-bit lanes (the caller bounds how
  // many), and those sums added into 32-bit lanes times a factor: the widening multiply
  // (madd) that must run anyway applies a K-quant's sub-scale for free.
  static constexpr bool kNoByteDot = true;  // maddubs: byte pairs into 16 bits, then madd
  static I dot16(I acc16, I w, int32_t x4) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4))); }
  static I widen16(I acc, I acc16, I factor) { return _mm256_add_epi32(acc, _mm256_madd_epi16(acc16, factor)); }
  // Wide codes' dot product less 128 * sum(x), times a factor: sum((u - 128) * x) * f, the
  // shift left to the caller, which adds it once per group instead of once per four inputs.
  static I dot_centred(I acc, I w, int32_t x4, I factor) {
    const I x = _mm256_set1_epi32(x4);
    const I s = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    const I pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(x, s));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, factor));
  }
  // A factor is its value in both 16-bit halves of a lane, as madd multiplies pairs: bytes
  // spread by a shuffle (a signed one into the high byte of each half, then shifted down).
  static I spread(I bytes, int8_t b0, int8_t b1, int8_t b2, int8_t b3) {  // lane l: bytes b(l) for each half
    return _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(
        b0, b1, b2, b3, b0 + 1, b1 + 1, b2 + 1, b3 + 1, b0 + 2, b1 + 2, b2 + 2, b3 + 2, b0 + 3, b1 + 3, b2 + 3, b3 + 3,
        b0 + 4, b1 + 4, b2 + 4, b3 + 4, b0 + 5, b1 + 5, b2 + 5, b3 + 5, b0 + 6, b1 + 6, b2 + 6, b3 + 6, b0 + 7, b1 + 7,
        b2 + 7, b3 + 7));
  }
  static I load8(const void* p) {
    int64_t v;
    std::memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
  }
  static I factor_i8(const int8_t* p) { return _mm256_srai_epi16(spread(load8(p), -128, 0, -128, 0), 8); }
  static I unit_factor() { return _mm256_set1_epi16(1); }
  static I add_scaled(I acc, I dots, I factor) {
    return _mm256_add_epi32(acc, _mm256_mullo_epi32(dots, _mm256_srai_epi32(factor, 16)));
  }
  // A pair: lane l takes bytes l and 8 + l of 16 (both 128-bit halves hold all 16).
  static I load16(const void* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I factor_pair_i8(const int8_t* p) { return _mm256_srai_epi16(spread(load16(p), -128, 0, -128, 8), 8); }
  static I factor_pair_u8(const uint8_t* p) { return spread(load16(p), 0, -128, 8, -128); }
  static I add_pair_times(I acc, I pair, int32_t v) { return _mm256_add_epi32(acc, _mm256_madd_epi16(pair, _mm256_set1_epi32(v))); }
  static I add_times(I acc, I a, int32_t v) { return _mm256_add_epi32(acc, _mm256_mullo_epi32(a, _mm256_set1_epi32(v))); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F load_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static F load_i8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static F load_u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  static float reduce(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static F maxf(F a, F b) { return _mm256_max_ps(a, b); }
  static F minf(F a, F b) { return _mm256_min_ps(a, b); }
  static float reduce_max(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static F round(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static F zero_below(F v, F x, float floor) {
    return _mm256_and_ps(v, _mm256_cmp_ps(x, _mm256_set1_ps(floor), _CMP_GE_OQ));
  }
  static F exp(F x) { return exp_lanes<Simd>(x); }
};
#else
constexpr const char* kVariant = "generic";
// Plain arrays; the compiler vectorises what it can. Multiply and add stay separate
// roundings here (no fused multiply-add is assumed), the same at every row count.
struct Simd {
  static constexpr int kLanes = 16;
  struct I { int32_t v[kLanes]; };
  struct F { float v[kLanes]; };
  static I load_codes(const uint8_t* p) { I r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static void store_codes(uint8_t* p, I v) { std::memcpy(p, v.v, sizeof v.v); }
  static I low_nibbles(I w) { for (auto& v : w.v) v &= 0x0F0F0F0F; return w; }
  static I high_nibbles(I w) { for (auto& v : w.v) v = (static_cast<uint32_t>(v) >> 4) & 0x0F0F0F0F; return w; }
  static I broadcast16(const uint8_t* p) { I r{}; std::memcpy(r.v, p, 16); return r; }
  static I lookup16(I table, I index) {
    uint8_t levels[16];
    std::memcpy(levels, table.v, 16);
    for (auto& v : index.v) {
      uint8_t b[4];
      std::memcpy(b, &v, 4);
      for (auto& byte : b) byte = levels[byte & 0x0F];
      std::memcpy(&v, b, 4);
    }
    return index;
  }
  static I or_bits(I codes, I plane, int shift, int mask) {
    for (int l = 0; l < kLanes; ++l)
      codes.v[l] |= static_cast<int32_t>(((static_cast<uint32_t>(plane.v[l]) >> shift) & (mask * 0x01010101u)) << 4);
    return codes;
  }
  template <int kShift, int kMask>
  static I or_bits(I codes, I plane) { return or_bits(codes, plane, kShift, kMask); }
  template <bool kWide>
  static I dot(I acc, I w, int32_t x4) {
    int8_t x[4];
    std::memcpy(x, &x4, 4);
    for (int l = 0; l < kLanes; ++l) {
      uint8_t u[4];
      std::memcpy(u, &w.v[l], 4);
      acc.v[l] += u[0] * x[0] + u[1] * x[1] + u[2] * x[2] + u[3] * x[3];
    }
    return acc;
  }
  static constexpr bool kNoByteDot = false;
  static I dot16(I acc, I, int32_t) { return acc; }
  static I widen16(I acc, I, I) { return acc; }
  static I dot_centred(I acc, I, int32_t, I) { return acc; }
  static I set1(int32_t v) { I r; for (auto& e : r.v) e = v; return r; }
  static I factor_i8(const int8_t* p) { I r; for (int l = 0; l < kLanes; ++l) r.v[l] = p[l]; return r; }
  static I unit_factor() { return set1(1); }
  static I add_scaled(I acc, I dots, I factor) {
    for (int l = 0; l < kLanes; ++l) acc.v[l] += dots.v[l] * factor.v[l];
    return acc;
  }
  template <class Byte>
  static I factor_pair(const Byte* p) {
    I r;
    for (int l = 0; l < kLanes; ++l)
      r.v[l] = static_cast<int32_t>(static_cast<uint16_t>(p[l]) | (static_cast<uint32_t>(static_cast<uint16_t>(p[kLanes + l])) << 16));
    return r;
  }
  static I factor_pair_i8(const int8_t* p) { return factor_pair(p); }
  static I factor_pair_u8(const uint8_t* p) { return factor_pair(p); }
  static I add_pair_times(I acc, I pair, int32_t v) {
    const auto low = [](int32_t w) { return static_cast<int32_t>(static_cast<int16_t>(w & 0xFFFF)); };
    const auto high = [](int32_t w) { return static_cast<int32_t>(static_cast<int16_t>(static_cast<uint32_t>(w) >> 16)); };
    for (int l = 0; l < kLanes; ++l) acc.v[l] += low(pair.v[l]) * low(v) + high(pair.v[l]) * high(v);
    return acc;
  }
  static I add_times(I acc, I a, int32_t v) { return add_scaled(acc, a, set1(v)); }
  static F to_float(I a) { F r; for (int l = 0; l < kLanes; ++l) r.v[l] = static_cast<float>(a.v[l]); return r; }
  static F fmadd(F a, F b, F c) { for (int l = 0; l < kLanes; ++l) c.v[l] = a.v[l] * b.v[l] + c.v[l]; return c; }
  static F add(F a, F b) { for (int l = 0; l < kLanes; ++l) a.v[l] += b.v[l]; return a; }
  static F sub(F a, F b) { for (int l = 0; l < kLanes; ++l) a.v[l] -= b.v[l]; return a; }
  static F fnmadd(F a, F b, F c) { for (int l = 0; l < kLanes; ++l) c.v[l] = c.v[l] - a.v[l] * b.v[l]; return c; }
  static F mul(F a, F b) { for (int l = 0; l < kLanes; ++l) a.v[l] *= b.v[l]; return a; }
  static F div(F a, F b) { for (int l = 0; l < kLanes; ++l) a.v[l] /= b.v[l]; return a; }
  static F set1f(float v) { F r; for (auto& e : r.v) e = v; return r; }
  static F zerof() { return set1f(0.0f); }
  static F load_half(const uint16_t* p) { F r; for (int l = 0; l < kLanes; ++l) r.v[l] = half_to_float(p[l]); return r; }
  static F load_bf16(const uint16_t* p) { F r; for (int l = 0; l < kLanes; ++l) r.v[l] = bf16_to_float(p[l]); return r; }
  static F load_i8(const int8_t* p) { F r; for (int l = 0; l < kLanes; ++l) r.v[l] = p[l]; return r; }
  static F load_u8(const uint8_t* p) { F r; for (int l = 0; l < kLanes; ++l) r.v[l] = p[l]; return r; }
  static F loadf(const float* p) { F r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static void storef(float* p, F v) { std::memcpy(p, v.v, sizeof v.v); }
  static float reduce(F v) {  // pairwise, as the vector variants do
    for (int width = kLanes / 2; width > 0; width /= 2)
      for (int l = 0; l < width; ++l) v.v[l] += v.v[l + width];
    return v.v[0];
  }
  static F maxf(F a, F b) { for (int l = 0; l < kLanes; ++l) a.v[l] = a.v[l] > b.v[l] ? a.v[l] : b.v[l]; return a; }
  static F minf(F a, F b) { for (int l = 0; l < kLanes; ++l) a.v[l] = a.v[l] < b.v[l] ? a.v[l] : b.v[l]; return a; }
  static float reduce_max(F v) { float m = v.v[0]; for (float e : v.v) m = e > m ? e : m; return m; }
  static F round(F v) { for (auto& e : v.v) e = std::nearbyint(e); return v; }
  static F pow2(F n) {
    for (auto& e : n.v) {  // n clamped first: a float outside int's range (or NaN) does not convert
      const float c = e > -127.0f ? (e < 128.0f ? e : 128.0f) : -127.0f;
      const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(c) + 127) << 23;
      std::memcpy(&e, &bits, sizeof e);
    }
    return n;
  }
  static F zero_below(F v, F x, float floor) {
    for (int l = 0; l < kLanes; ++l) v.v[l] = x.v[l] >= floor ? v.v[l] : 0.0f;
    return v;
  }
  static F exp(F x) { return exp_lanes<Simd>(x); }
};
#endif

}  // namespace ls
