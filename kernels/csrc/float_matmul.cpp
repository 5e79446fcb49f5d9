// fp32-activation matmul over a QuantWeight as it is stored (GPTQ, AWQ, and the exact path).
//
// The weight is never dequantized into memory: each code is widened and dequantized in
// registers with exactly the reference's fp32 operations ((q - zero) * scale, or
// scale * q - min, as separate roundings) and then meets the rows of x in fused
// multiply-adds. Results equal the reference (dequantize, then GEMM) up to the order of
// the sums, and that order depends on the weight alone: rows go in blocks of four and
// then one at a time, each row with the same accumulator chains, so a row's result is
// the same at any row count.
//
// With AVX2 and FMA eight inputs go at a time. Packed 4-bit codes hold input 2j in the low
// nibble and 2j + 1 in the high one, so x is first split per group into its even and odd
// inputs, which the low and high nibbles of consecutive bytes then meet as contiguous
// vectors. Without AVX2 a plain loop computes the same sums.
#include <algorithm>
#include <vector>

#include "api.h"
#include "runtime.h"
#include "simd.h"

namespace ls {
namespace {

// One [n, width] array of per-group (or per-super-group) factors, widened row by row.
struct Factors {
  const void* data;
  int32_t dtype;
  int64_t width;

  explicit Factors(const ls_factors& f) : data(f.data), dtype(f.dtype), width(f.width) {}
  bool present() const { return data != nullptr; }

  template <typename T>
  void widen_as(int64_t n, float* out) const {
    const T* row = static_cast<const T*>(data) + n * width;
    for (int64_t i = 0; i < width; ++i) out[i] = static_cast<float>(row[i]);
  }

  // fp16 with the hardware conversion where there is one: the scalar conversion costs
  // as much as the dot product itself at a single row of x.
  void widen_half(int64_t n, float* out) const {
    const uint16_t* row = static_cast<const uint16_t*>(data) + n * width;
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= width; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i))));
#endif
    for (; i < width; ++i) out[i] = half_to_float(row[i]);
  }

  // Row n as fp32 (every supported type converts exactly).
  void widen(int64_t n, float* out) const {
    switch (dtype) {
      case LS_F32: widen_as<float>(n, out); break;
      case LS_F16: widen_half(n, out); break;
      case LS_U8: widen_as<uint8_t>(n, out); break;
      case LS_I8: widen_as<int8_t>(n, out); break;
      default: widen_as<int16_t>(n, out); break;
    }
  }
};

// Row n's per-group values: inner[g], or outer[g / per_outer] * inner[g] in fp32.
void group_values(const Factors& inner, const Factors& outer, int64_t per_outer, int64_t n, float* out,
                  float* outer_buffer) {
  inner.widen(n, out);
  if (!outer.present()) return;
  outer.widen(n, outer_buffer);
  // Nested loops, not g / per_outer: a division per group cost more than the row's dot products.
  for (int64_t o = 0, g = 0; o < outer.width; ++o)
    for (int64_t i = 0; i < per_outer; ++i, ++g) out[g] = outer_buffer[o] * out[g];
}

// Packed codes: x with each group's inputs reordered to its even inputs, then its odd
// ones (matching low, then high nibbles). Unpacked codes read x as it is.
std::vector<float> split_even_odd(const float* x, int64_t rows, int64_t k, int64_t group_size) {
  std::vector<float> out(rows * k);
  const int64_t half = group_size / 2;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k0 = 0; k0 < k; k0 += group_size)
      for (int64_t j = 0; j < half; ++j) {
        out[m * k + k0 + j] = x[m * k + k0 + 2 * j];
        out[m * k + k0 + half + j] = x[m * k + k0 + 2 * j + 1];
      }
  return out;
}

// Rows of x that share each dequantized vector.
constexpr int64_t kRowBlock = 4;

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 widen_bytes(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void widen_nibbles(const uint8_t* p, __m256* lo, __m256* hi) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  *lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
  *hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The reference's dequantization of eight codes: (q - zero) * scale, or scale * q - min.
template <bool kMins>
inline __m256 dequantize8(__m256 q, __m256 scale, __m256 offset) {
  return kMins ? _mm256_sub_ps(_mm256_mul_ps(scale, q), offset) : _mm256_mul_ps(_mm256_sub_ps(q, offset), scale);
}

// out[r] = sum_k x[r, k] * w[k] for one output row's codes, kRows rows of x at once.
// Each step widens eight codes (two vectors of eight for packed nibbles) and meets every
// row; kUnroll steps go to separate accumulators, so a single row of x (decode) keeps the
// FMA units busy instead of waiting on one chain. kUnroll depends on the weight alone.
// kGroup, when not 0, is the group size known at compile time (32: no inner loop).
template <bool kPacked, bool kMins, int kRows, int kUnroll, int kGroup>
void row_dots_avx2(const float* x, int64_t k, const uint8_t* codes, int64_t runtime_group_size,
                   const float* scale, const float* offset, float* out) {
  const int64_t group_size = kGroup ? kGroup : runtime_group_size;
  constexpr int kPerStep = kPacked ? 2 : 1;
  constexpr int kChains = kUnroll * kPerStep;
  const int64_t half = group_size / 2;  // packed: a group's even inputs, then its odd ones
  __m256 acc[kRows][kChains];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < k; ++g, k0 += group_size) {
    const __m256 s = _mm256_set1_ps(scale[g]), o = _mm256_set1_ps(offset[g]);
    for (int64_t j = 0; j < group_size / kPerStep; j += 8 * kUnroll) {
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t at = j + 8 * u;
        __m256 w[kPerStep];
        if constexpr (kPacked) {
          widen_nibbles(codes + k0 / 2 + at, &w[0], &w[1]);
        } else {
          w[0] = widen_bytes(codes + k0 + at);
        }
        for (int t = 0; t < kPerStep; ++t) w[t] = dequantize8<kMins>(w[t], s, o);
        for (int r = 0; r < kRows; ++r)
          for (int t = 0; t < kPerStep; ++t) {
            __m256& a = acc[r][u * kPerStep + t];
            a = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + k0 + t * half + at), w[t], a);
          }
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    __m256 sum = acc[r][0];
    for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[r][c]);
    out[r] = hsum(sum);
  }
}

// Blocks of kRowBlock rows, then single rows, all with the same chains.
template <bool kPacked, bool kMins, int kUnroll, int kGroup>
void row_blocks_avx2(const float* x, int64_t rows, int64_t k, const uint8_t* codes, int64_t group_size,
                     const float* scale, const float* offset, float* out) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock)
    row_dots_avx2<kPacked, kMins, kRowBlock, kUnroll, kGroup>(x + r * k, k, codes, group_size, scale, offset, out + r);
  for (; r < rows; ++r)
    row_dots_avx2<kPacked, kMins, 1, kUnroll, kGroup>(x + r * k, k, codes, group_size, scale, offset, out + r);
}
#endif

// The same dot products, one row of x at a time, in plain C++.
template <bool kPacked, bool kMins>
void row_dots_plain(const float* x, int64_t rows, int64_t k, const uint8_t* codes, int64_t group_size,
                    const float* scale, const float* offset, float* out) {
  const auto dequantize = [](float q, float s, float o) { return kMins ? s * q - o : (q - o) * s; };
  const int64_t half = group_size / 2;
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.0f;
    for (int64_t g = 0, k0 = 0; k0 < k; ++g, k0 += group_size) {
      const float* xr = x + r * k + k0;
      if constexpr (kPacked) {
        for (int64_t j = 0; j < half; ++j) {
          const uint8_t byte = codes[k0 / 2 + j];
          acc += xr[j] * dequantize(static_cast<float>(byte & 0xF), scale[g], offset[g]);
          acc += xr[half + j] * dequantize(static_cast<float>(byte >> 4), scale[g], offset[g]);
        }
      } else {
        for (int64_t j = 0; j < group_size; ++j)
          acc += xr[j] * dequantize(static_cast<float>(codes[k0 + j]), scale[g], offset[g]);
      }
    }
    out[r] = acc;
  }
}

template <bool kPacked, bool kMins>
void row_dots(const float* x, int64_t rows, int64_t k, const uint8_t* codes, int64_t group_size, const float* scale,
              const float* offset, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  // Two chains per row where a group's steps pair up (16 inputs per packed step, 8 unpacked).
  const int64_t steps = group_size / (kPacked ? 16 : 8);
  if (group_size == 32) return row_blocks_avx2<kPacked, kMins, kPacked ? 1 : 2, 32>(x, rows, k, codes, group_size, scale, offset, out);
  if (group_size % (kPacked ? 16 : 8) == 0) {
    if (steps % 2 == 0) return row_blocks_avx2<kPacked, kMins, 2, 0>(x, rows, k, codes, group_size, scale, offset, out);
    return row_blocks_avx2<kPacked, kMins, 1, 0>(x, rows, k, codes, group_size, scale, offset, out);
  }
#endif
  row_dots_plain<kPacked, kMins>(x, rows, k, codes, group_size, scale, offset, out);
}

template <bool kPacked, bool kMins>
void matmul(const ls_quant_weight& w, const float* x_in, int64_t rows, float* out) {
  const int64_t k = w.k, n_out = w.n, code_stride = kPacked ? k / 2 : k;
  const std::vector<float> split = kPacked ? split_even_odd(x_in, rows, k, w.group_size) : std::vector<float>();
  const float* x = kPacked ? split.data() : x_in;
  const Factors scales(w.scales), offsets(w.offsets), super_scales(w.super_scales), super_offsets(w.super_offsets);
  const int64_t groups = scales.width;
#pragma omp parallel num_threads(ls::threads())
  {
    std::vector<float> dots(rows), scale(groups), offset(groups), outer(groups);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
      group_values(scales, super_scales, w.groups_per_super, n, scale.data(), outer.data());
      group_values(offsets, super_offsets, w.groups_per_super, n, offset.data(), outer.data());
      row_dots<kPacked, kMins>(x, rows, k, w.codes + n * code_stride, w.group_size, scale.data(), offset.data(),
                               dots.data());
      for (int64_t m = 0; m < rows; ++m) out[m * n_out + n] = dots[m];
    }
  }
}

}  // namespace
}  // namespace ls

extern "C" void ls_float_matmul(const ls_quant_weight* w, const float* x, int64_t rows, float* out) {
  const bool packed = w->bits <= 4;
  if (packed)
    w->mins ? ls::matmul<true, true>(*w, x, rows, out) : ls::matmul<true, false>(*w, x, rows, out);
  else
    w->mins ? ls::matmul<false, true>(*w, x, rows, out) : ls::matmul<false, false>(*w, x, rows, out);
}
