// Fused dequantize + matmul for QuantWeight on the CPU, for the rows of x at decode sizes.
//
// The weight is never dequantized into memory: each code is widened and dequantized in
// registers with exactly the reference's fp32 operations ((q - zero) * scale, or
// scale * q - min, as separate roundings) and then meets every row of x in a fused
// multiply-add. The weight is read once per call; results equal the reference (dequantize,
// then GEMM) up to the order of the sums.
//
// With AVX2 and FMA (the build uses -march=native) eight inputs go at a time, and blocks of
// up to kRowBlock rows of x share each dequantized vector. Packed 4-bit codes hold input 2j
// in the low nibble and 2j + 1 in the high one, so x is first split per group into its even
// and odd inputs, which the low and high nibbles of consecutive bytes then meet as
// contiguous vectors. Without AVX2 a plain loop computes the same sums.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define LOCALSERVE_AVX2 1
#endif

namespace {

// One [N, width] tensor of per-group (or per-super-block) factors, of any stored dtype.
struct Factors {
  const void* data = nullptr;
  at::ScalarType type = at::kFloat;
  int64_t width = 0;

  static Factors of(const torch::Tensor& t) {
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), "weight factors: contiguous [N, groups]");
    return {t.data_ptr(), t.scalar_type(), t.size(1)};
  }

  template <typename T>
  void widen_as(int64_t n, float* out) const {
    const T* row = static_cast<const T*>(data) + n * width;
    for (int64_t i = 0; i < width; ++i) out[i] = static_cast<float>(row[i]);
  }

  // fp16 with the hardware conversion where there is one: the scalar conversion costs
  // as much as the dot product itself at a GEMV's single row of x.
  void widen_half(int64_t n, float* out) const {
    const at::Half* row = static_cast<const at::Half*>(data) + n * width;
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= width; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i))));
#endif
    for (; i < width; ++i) out[i] = static_cast<float>(row[i]);
  }

  // Row n as fp32 (every supported type converts exactly).
  void widen(int64_t n, float* out) const {
    switch (type) {
      case at::kFloat: widen_as<float>(n, out); break;
      case at::kHalf: widen_half(n, out); break;
      case at::kByte: widen_as<uint8_t>(n, out); break;
      case at::kChar: widen_as<int8_t>(n, out); break;
      case at::kShort: widen_as<int16_t>(n, out); break;
      default: TORCH_CHECK(false, "unsupported factor dtype ", type);
    }
  }
};

// Row n's per-group values: inner[g], or outer[g / per_outer] * inner[g] in fp32.
void group_values(const Factors& inner, const std::optional<Factors>& outer, int64_t per_outer, int64_t n,
                  float* out, float* outer_buffer) {
  inner.widen(n, out);
  if (!outer) return;
  outer->widen(n, outer_buffer);
  for (int64_t g = 0; g < inner.width; ++g) out[g] = outer_buffer[g / per_outer] * out[g];
}

struct Weight {
  const uint8_t* codes;
  bool packed;
  int64_t group_size;
  Factors scales, offsets;
  std::optional<Factors> super_scales, super_offsets;
  int64_t groups_per_super;
};

// Packed codes: x with each group's inputs reordered to its even inputs, then its odd
// ones (matching low, then high nibbles). Unpacked codes read x as it is.
std::vector<float> split_even_odd(const float* x, int64_t rows, int64_t k, int64_t group_size) {
  std::vector<float> out(rows * k);
  const int64_t half = group_size / 2;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k0 = 0; k0 < k; k0 += group_size) {
      const float* src = x + m * k + k0;
      float* dst = out.data() + m * k + k0;
      for (int64_t j = 0; j < half; ++j) {
        dst[j] = src[2 * j];
        dst[half + j] = src[2 * j + 1];
      }
    }
  }
  return out;
}

// Rows of x that share each dequantized vector: eight accumulators plus the codes, scale
// and offset fit AVX2's sixteen registers.
constexpr int64_t kRowBlock = 8;

#ifdef LOCALSERVE_AVX2
// Eight codes starting at p widened to fp32: one per byte, or the low/high nibbles of p[0..7].
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
// row; kUnroll steps go to separate accumulators. A fused multiply-add waits about four
// cycles for the one before it on the same accumulator, so a single row of x (decode of
// one sequence) needs several chains to keep the FMA units busy; eight rows are eight
// chains already. kGroup, when not 0, is the group size known at compile time: the common
// 32 (every GGUF block type but the 16-wide K-quant sub-blocks) then needs no inner loop.
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

// Blocks of eight rows of x, then four, then single rows with as many chains as the
// group's steps divide into (up to four vectors).
template <bool kPacked, bool kMins, int kGroup>
void row_blocks_avx2(const float* x, int64_t rows, int64_t k, const uint8_t* codes, int64_t group_size,
                     const float* scale, const float* offset, float* out) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock)
    row_dots_avx2<kPacked, kMins, kRowBlock, 1, kGroup>(x + r * k, k, codes, group_size, scale, offset, out + r);
  for (; r + 4 <= rows; r += 4)
    row_dots_avx2<kPacked, kMins, 4, 1, kGroup>(x + r * k, k, codes, group_size, scale, offset, out + r);
  const int64_t steps = group_size / (kPacked ? 16 : 8);
  for (; r < rows; ++r) {
    if (!kPacked && steps % 4 == 0)
      row_dots_avx2<kPacked, kMins, 1, 4, kGroup>(x + r * k, k, codes, group_size, scale, offset, out + r);
    else if (steps % 2 == 0)
      row_dots_avx2<kPacked, kMins, 1, 2, kGroup>(x + r * k, k, codes, group_size, scale, offset, out + r);
    else
      row_dots_avx2<kPacked, kMins, 1, 1, kGroup>(x + r * k, k, codes, group_size, scale, offset, out + r);
  }
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
#ifdef LOCALSERVE_AVX2
  if (group_size == 32) return row_blocks_avx2<kPacked, kMins, 32>(x, rows, k, codes, group_size, scale, offset, out);
  if (group_size % (kPacked ? 16 : 8) == 0)
    return row_blocks_avx2<kPacked, kMins, 0>(x, rows, k, codes, group_size, scale, offset, out);
#endif
  row_dots_plain<kPacked, kMins>(x, rows, k, codes, group_size, scale, offset, out);
}

// Every output row n, split over the threads: its group scales and offsets widened to fp32,
// then row_fn(n, scale, offset, dots) gives the rows' results for it, written to out[:, n].
template <typename RowFn>
void for_each_output_row(const Weight& wt, int64_t rows, float* out, int64_t n_out, RowFn row_fn) {
  const int64_t groups = wt.scales.width;
#pragma omp parallel
  {
    std::vector<float> dots(rows), scale(groups), offset(groups), outer(groups);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
      group_values(wt.scales, wt.super_scales, wt.groups_per_super, n, scale.data(), outer.data());
      group_values(wt.offsets, wt.super_offsets, wt.groups_per_super, n, offset.data(), outer.data());
      row_fn(n, scale.data(), offset.data(), dots.data());
      for (int64_t m = 0; m < rows; ++m) out[m * n_out + n] = dots[m];
    }
  }
}

template <bool kPacked, bool kMins>
void gemv(const float* x_in, int64_t rows, int64_t k, const Weight& wt, float* out, int64_t n_out) {
  const int64_t code_stride = kPacked ? k / 2 : k;
  const std::vector<float> split = kPacked ? split_even_odd(x_in, rows, k, wt.group_size) : std::vector<float>();
  const float* x = kPacked ? split.data() : x_in;
  for_each_output_row(wt, rows, out, n_out, [&](int64_t n, const float* scale, const float* offset, float* dots) {
    row_dots<kPacked, kMins>(x, rows, k, wt.codes + n * code_stride, wt.group_size, scale, offset, dots);
  });
}

// --- int8 activations (packed 4-bit codes) ---------------------------------------------
//
// llama.cpp's CPU backend quantizes x to 8 bits per block of 32 inputs before its dot
// products with 4-bit weights; so does this path, for the weights loaded from GGUF files.
// Block b of row r holds q = round(x / d) with d = max|x| / 127, its inputs in the order a
// block's 16 code bytes widen to (the low nibbles: even inputs, then the high ones: odd
// inputs). A block's dot product is then integer work (maddubs: u8 codes times s8 x,
// pairwise into s16, then madd into s32) scaled once by scale * d; each group's zero or
// min meets d * sum(q) of its blocks. Exactly the float path applied to the rounded
// x = q * d, up to the order of the sums.
constexpr int64_t kXBlock = 32;

struct Int8Rows {
  std::vector<int8_t> q;     // [rows, K], per block in the order above
  std::vector<float> d;      // [rows, K / 32]
  std::vector<float> d_sum;  // [rows, groups]: d * sum(q) over each weight group's blocks
};

Int8Rows quantize_rows(const float* x, int64_t rows, int64_t k, int64_t group_size) {
  const int64_t blocks = k / kXBlock, per_group = group_size / kXBlock, groups = k / group_size;
  Int8Rows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks),
               std::vector<float>(rows * groups, 0.0f)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = x + r * k + b * kXBlock;
      float amax = 0.0f;
      for (int64_t j = 0; j < kXBlock; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float d = amax / 127.0f;
      int8_t* dst = out.q.data() + r * k + b * kXBlock;
      int32_t sum = 0;
      for (int64_t j = 0; j < kXBlock; ++j) {
        // nearbyint rounds half to even, as torch.round in the reference.
        const int8_t q = d == 0.0f ? 0 : static_cast<int8_t>(std::nearbyint(src[j] / d));
        dst[j % 2 == 0 ? j / 2 : kXBlock / 2 + j / 2] = q;
        sum += q;
      }
      out.d[r * blocks + b] = d;
      out.d_sum[r * groups + b / per_group] += d * static_cast<float>(sum);
    }
  }
  return out;
}

// One block's integer dot product, sum(codes * q), as eight s32 lanes (AVX2) or a scalar.
#ifdef LOCALSERVE_AVX2
inline __m256i block_dot(const uint8_t* codes, const int8_t* q) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  // Codes are at most 15 and |q| at most 127: a pair sums to at most 3810, no s16 saturation.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// kRows rows of x against one output row; two accumulators per row when there is one row,
// so consecutive blocks do not wait on each other's multiply-add.
template <int kRows>
void int8_row_dots_avx2(const Int8Rows& xq, int64_t r0, int64_t k, const uint8_t* codes, int64_t group_size,
                        const float* scale, float* out) {
  constexpr int kChains = kRows == 1 ? 2 : 1;
  const int64_t blocks = k / kXBlock, per_group = group_size / kXBlock;
  __m256 acc[kRows][kChains];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t g = 0, in_group = 0;  // the block's group, counted (a division per block costs more than its dot)
  for (int64_t b = 0; b < blocks; b += kChains) {
    for (int c = 0; c < kChains && b + c < blocks; ++c) {
      const int64_t block = b + c;
      const float s = scale[g];
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = r0 + r;
        const __m256i dot = block_dot(codes + block * kXBlock / 2, xq.q.data() + row * k + block * kXBlock);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s * xq.d[row * blocks + block]),
                                    acc[r][c]);
      }
      if (++in_group == per_group) in_group = 0, ++g;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    __m256 sum = acc[r][0];
    for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[r][c]);
    out[r] = hsum(sum);
  }
}
#endif

void int8_row_dots_plain(const Int8Rows& xq, int64_t row, int64_t k, const uint8_t* codes, int64_t group_size,
                         const float* scale, float* out) {
  const int64_t blocks = k / kXBlock, per_group = group_size / kXBlock;
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* q = xq.q.data() + row * k + b * kXBlock;
    const uint8_t* c = codes + b * kXBlock / 2;
    int32_t dot = 0;
    for (int64_t j = 0; j < kXBlock / 2; ++j) dot += (c[j] & 0xF) * q[j] + (c[j] >> 4) * q[kXBlock / 2 + j];
    acc += static_cast<float>(dot) * (scale[b / per_group] * xq.d[row * blocks + b]);
  }
  *out = acc;
}

template <bool kMins>
void int8_gemv(const float* x, int64_t rows, int64_t k, const Weight& wt, float* out, int64_t n_out) {
  const int64_t groups = wt.scales.width;
  const Int8Rows xq = quantize_rows(x, rows, k, wt.group_size);
  for_each_output_row(wt, rows, out, n_out, [&](int64_t n, const float* scale, const float* offset, float* dots) {
    const uint8_t* codes = wt.codes + n * (k / 2);
    int64_t r = 0;
#ifdef LOCALSERVE_AVX2
    for (; r + 4 <= rows; r += 4) int8_row_dots_avx2<4>(xq, r, k, codes, wt.group_size, scale, &dots[r]);
    for (; r < rows; ++r) int8_row_dots_avx2<1>(xq, r, k, codes, wt.group_size, scale, &dots[r]);
#endif
    for (; r < rows; ++r) int8_row_dots_plain(xq, r, k, codes, wt.group_size, scale, &dots[r]);
    for (int64_t m = 0; m < rows; ++m) {
      // (q - zero) * scale: the zero meets scale * d * sum(q); scale * q - min: the min meets d * sum(q).
      const float* d_sum = xq.d_sum.data() + m * groups;
      float offsets = 0.0f;
      for (int64_t g = 0; g < groups; ++g) offsets += (kMins ? offset[g] : offset[g] * scale[g]) * d_sum[g];
      dots[m] -= offsets;
    }
  });
}

std::optional<Factors> optional_factors(const std::optional<torch::Tensor>& t) {
  if (!t) return std::nullopt;
  return Factors::of(*t);
}

}  // namespace

// x [rows, K] fp32; codes uint8 [N, K/2] (packed) or [N, K]; scales [N, G] (fp16/fp32, or
// integer sub-scales with super_scales [N, G / groups_per_super]); offsets: zeros
// (uint8/int16) or mins (fp32, or integer sub-mins with super_offsets); int8_x: x
// quantized per 32 inputs first (packed codes, groups of whole blocks). Returns [rows, N].
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                         bool mins, bool packed, int64_t group_size, std::optional<torch::Tensor> super_scales,
                         std::optional<torch::Tensor> super_offsets, int64_t groups_per_super, bool int8_x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous fp32 [rows, K]");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == torch::kUInt8, "codes: contiguous uint8");
  const int64_t k = x.size(1);
  TORCH_CHECK(group_size > 0 && k % group_size == 0 && scales.size(1) * group_size == k, "groups do not tile K");
  TORCH_CHECK(!packed || group_size % 2 == 0, "packed codes need an even group size");
  TORCH_CHECK(codes.size(1) == (packed ? k / 2 : k), "codes do not match K");
  TORCH_CHECK(groups_per_super > 0, "groups_per_super must be positive");
  TORCH_CHECK(!int8_x || (packed && group_size % kXBlock == 0), "int8 x needs packed codes in groups of 32s");
  const Weight weight{codes.data_ptr<uint8_t>(), packed, group_size, Factors::of(scales), Factors::of(offsets),
                      optional_factors(super_scales), optional_factors(super_offsets), groups_per_super};
  auto out = torch::empty({x.size(0), codes.size(0)}, x.options());
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t rows = x.size(0), n_out = codes.size(0);
  if (int8_x) {
    mins ? int8_gemv<true>(xs, rows, k, weight, os, n_out) : int8_gemv<false>(xs, rows, k, weight, os, n_out);
  } else if (packed) {
    mins ? gemv<true, true>(xs, rows, k, weight, os, n_out) : gemv<true, false>(xs, rows, k, weight, os, n_out);
  } else {
    mins ? gemv<false, true>(xs, rows, k, weight, os, n_out) : gemv<false, false>(xs, rows, k, weight, os, n_out);
  }
  return out;
}
