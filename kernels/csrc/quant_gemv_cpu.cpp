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
  // Nested loops, not g / per_outer: a division per group cost more than the row's dot products.
  for (int64_t o = 0, g = 0; o < outer->width; ++o)
    for (int64_t i = 0; i < per_outer; ++i, ++g) out[g] = outer_buffer[o] * out[g];
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

// --- int8 activations ----------------------------------------------------------------
//
// llama.cpp's CPU backend quantizes x to 8 bits before its dot products with quantized
// weights; so does this path, for the weights loaded from GGUF files: q = round(x / d)
// with d = max|x| / 127 over each block of 32 inputs (llama.cpp's Q8_0 and Q8_1, used
// with the simple types) or of 256 (its Q8_K, used with the K-quants; each 32-input
// block then carries its 256-block's d). A 32-input block's dot product
// with the codes u is then integer work (maddubs: u8 times s8, pairwise into s16, then
// madd into eight s32 lanes) scaled by scale * d per lane; each group's zero or min meets
// d * sum(q) of its inputs. Exactly the float path applied to the rounded x = q * d, up
// to the order of the sums.
//
// How a block's codes reach the lanes decides the order q is stored in and which group
// each lane belongs to:
// - kNibbles (codes of up to 4 bits, two per byte): the low nibbles of the block's 16
//   bytes (its even inputs) fill lanes 0-3, the high nibbles (odd inputs) lanes 4-7, so q
//   holds the block's even inputs, then its odd ones. With 16-input groups, lanes 0-1 and
//   4-5 are the first group, 2-3 and 6-7 the second.
// - kBytes (5 to 7 bits, one per byte): q in input order; lanes 0-3 are inputs 0-15.
// - kBytes8 (8 bits): as kBytes, but a code of 255 times a q of 127, twice, overflows
//   maddubs' s16 pair sum, so the codes are shifted to signed s = u - 128 and multiplied
//   as |s| times q with s's sign; the shift meets 128 * d * sum(q) like a zero point.
constexpr int64_t kXBlock = 32;

enum class Codes { kNibbles, kBytes, kBytes8 };

struct Int8Rows {
  std::vector<int8_t> q;     // [rows, K], each block in its codes' order (above)
  std::vector<float> d;      // [rows, K / 32]
  std::vector<float> d_sum;  // [rows, groups]: d * sum(q) over each weight group's inputs
};

// x_block: the inputs that share a d (a multiple of 32 dividing k).
Int8Rows quantize_rows(const float* x, int64_t rows, int64_t k, int64_t x_block, int64_t group_size,
                       bool even_then_odd) {
  const int64_t blocks = k / kXBlock, groups = k / group_size, per_x_block = x_block / kXBlock;
  Int8Rows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks),
               std::vector<float>(rows * groups, 0.0f)};
  for (int64_t r = 0; r < rows; ++r) {
    float d = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = x + r * k + b * kXBlock;
      if (b % per_x_block == 0) {
        float amax = 0.0f;
        for (int64_t j = 0; j < x_block; ++j) amax = std::max(amax, std::fabs(src[j]));
        d = amax / 127.0f;
      }
      int8_t* dst = out.q.data() + r * k + b * kXBlock;
      int32_t half_sums[2] = {0, 0};  // inputs 0-15 and 16-31: a 16-input group each
      for (int64_t j = 0; j < kXBlock; ++j) {
        // nearbyint rounds half to even, as torch.round in the reference; x / d, not
        // x * (1 / d), which can round the other way at a half.
        const int8_t q = d == 0.0f ? 0 : static_cast<int8_t>(std::nearbyint(src[j] / d));
        dst[even_then_odd ? (j % 2 == 0 ? j / 2 : kXBlock / 2 + j / 2) : j] = q;
        half_sums[j / 16] += q;
      }
      out.d[r * blocks + b] = d;
      float* d_sum = out.d_sum.data() + r * groups;
      if (group_size == 16) {
        d_sum[2 * b] = d * static_cast<float>(half_sums[0]);
        d_sum[2 * b + 1] = d * static_cast<float>(half_sums[1]);
      } else {
        d_sum[b * kXBlock / group_size] += d * static_cast<float>(half_sums[0] + half_sums[1]);
      }
    }
  }
  return out;
}

constexpr int64_t code_bytes_per_block(Codes codes) { return codes == Codes::kNibbles ? kXBlock / 2 : kXBlock; }

#ifdef LOCALSERVE_AVX2
// One block's integer dot product, sum(u * q) (kBytes8: sum((u - 128) * q)), as eight s32 lanes.
template <Codes kCodes>
inline __m256i block_dot(const uint8_t* codes, const int8_t* q) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  __m256i pairs;
  if constexpr (kCodes == Codes::kNibbles) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
    pairs = _mm256_maddubs_epi16(w, x);  // codes <= 15, |q| <= 127: pair sums within s16
  } else {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
    if constexpr (kCodes == Codes::kBytes) {
      pairs = _mm256_maddubs_epi16(w, x);  // codes <= 127: pair sums within s16
    } else {
      const __m256i s = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // u - 128
      pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(x, s));  // |s| <= 128
    }
  }
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// Each lane's scale * d for block b: one group's scale, or (16-input groups) the two
// groups' scales laid out as the lanes hold their inputs.
template <Codes kCodes, bool kHalves>
inline __m256 lane_scales(const float* scale, int64_t g, int64_t b, float d) {
  if constexpr (!kHalves) {
    return _mm256_set1_ps(scale[g] * d);
  } else {
    const __m256 two = _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scale + 2 * b))));
    const __m256i lanes = kCodes == Codes::kNibbles ? _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1)
                                                    : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    return _mm256_mul_ps(_mm256_permutevar8x32_ps(two, lanes), _mm256_set1_ps(d));
  }
}

// kRows rows of x against one output row; two accumulators per row when there is one row,
// so consecutive blocks do not wait on each other's multiply-add.
template <Codes kCodes, bool kHalves, int kRows>
void int8_row_dots_avx2(const Int8Rows& xq, int64_t r0, int64_t k, const uint8_t* codes, int64_t group_size,
                        const float* scale, float* out) {
  constexpr int kChains = kRows == 1 ? 2 : 1;
  const int64_t blocks = k / kXBlock, per_group = std::max<int64_t>(1, group_size / kXBlock);
  __m256 acc[kRows][kChains];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t g = 0, in_group = 0;  // the block's group, counted (a division per block costs more than its dot)
  for (int64_t b = 0; b < blocks; b += kChains) {
    for (int c = 0; c < kChains && b + c < blocks; ++c) {
      const int64_t block = b + c;
      const uint8_t* block_codes = codes + block * code_bytes_per_block(kCodes);
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = r0 + r;
        const __m256i dot = block_dot<kCodes>(block_codes, xq.q.data() + row * k + block * kXBlock);
        const __m256 s = lane_scales<kCodes, kHalves>(scale, g, block, xq.d[row * blocks + block]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r][c]);
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

// The same sums one input at a time, in plain C++ (no AVX2).
template <Codes kCodes>
void int8_row_dots_plain(const Int8Rows& xq, int64_t row, int64_t k, const uint8_t* codes, int64_t group_size,
                         const float* scale, float* out) {
  const int64_t blocks = k / kXBlock;
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* q = xq.q.data() + row * k + b * kXBlock;
    const uint8_t* c = codes + b * code_bytes_per_block(kCodes);
    for (int64_t j = 0; j < kXBlock; ++j) {  // j: the input within the block
      int32_t code;
      int8_t x;
      if constexpr (kCodes == Codes::kNibbles) {
        code = j % 2 == 0 ? c[j / 2] & 0xF : c[j / 2] >> 4;
        x = q[j % 2 == 0 ? j / 2 : kXBlock / 2 + j / 2];
      } else {
        code = kCodes == Codes::kBytes8 ? c[j] - 128 : c[j];
        x = q[j];
      }
      acc += static_cast<float>(code * x) * (scale[(b * kXBlock + j) / group_size] * xq.d[row * blocks + b]);
    }
  }
  *out = acc;
}

// What the zeros or mins take off a row's dot product: (u - zero) * scale =
// (u - shift) * scale - (zero - shift) * scale, and scale * u - min = scale * (u - shift) -
// (min - shift * scale); the second terms meet d * sum(q) per group. Eight partial sums:
// one ordered chain of adds cost as much as the row's integer dot products.
template <bool kMins>
float offset_terms(const float* scale, const float* offset, float shift, const float* d_sum, int64_t groups) {
  const auto term = [&](int64_t g) {
    return (kMins ? offset[g] - shift * scale[g] : (offset[g] - shift) * scale[g]) * d_sum[g];
  };
  int64_t g = 0;
  float total = 0.0f;
#ifdef LOCALSERVE_AVX2
  const __m256 shifts = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= groups; g += 8) {
    const __m256 s = _mm256_loadu_ps(scale + g), o = _mm256_loadu_ps(offset + g);
    const __m256 w = kMins ? _mm256_sub_ps(o, _mm256_mul_ps(shifts, s)) : _mm256_mul_ps(_mm256_sub_ps(o, shifts), s);
    acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(d_sum + g), acc);
  }
  total = hsum(acc);
#endif
  for (; g < groups; ++g) total += term(g);
  return total;
}

template <Codes kCodes, bool kMins>
void int8_gemv(const float* x, int64_t rows, int64_t k, int64_t x_block, const Weight& wt, float* out,
               int64_t n_out) {
  const int64_t groups = wt.scales.width, group_size = wt.group_size;
  const Int8Rows xq = quantize_rows(x, rows, k, x_block, group_size, kCodes == Codes::kNibbles);
  const float shift = kCodes == Codes::kBytes8 ? 128.0f : 0.0f;  // the codes met q as u - shift
  for_each_output_row(wt, rows, out, n_out, [&](int64_t n, const float* scale, const float* offset, float* dots) {
    const uint8_t* codes = wt.codes + n * (k / kXBlock) * code_bytes_per_block(kCodes);
    int64_t r = 0;
#ifdef LOCALSERVE_AVX2
    const auto run = [&](auto halves) {
      constexpr bool kHalves = decltype(halves)::value;
      for (; r + 4 <= rows; r += 4) int8_row_dots_avx2<kCodes, kHalves, 4>(xq, r, k, codes, group_size, scale, &dots[r]);
      for (; r < rows; ++r) int8_row_dots_avx2<kCodes, kHalves, 1>(xq, r, k, codes, group_size, scale, &dots[r]);
    };
    group_size == 16 ? run(std::true_type{}) : run(std::false_type{});
#endif
    for (; r < rows; ++r) int8_row_dots_plain<kCodes>(xq, r, k, codes, group_size, scale, &dots[r]);
    for (int64_t m = 0; m < rows; ++m)
      dots[m] -= offset_terms<kMins>(scale, offset, shift, xq.d_sum.data() + m * groups, groups);
  });
}

template <bool kMins>
void int8_gemv_for_bits(int64_t bits, const float* x, int64_t rows, int64_t k, int64_t x_block, const Weight& wt,
                        float* out, int64_t n_out) {
  if (bits <= 4) return int8_gemv<Codes::kNibbles, kMins>(x, rows, k, x_block, wt, out, n_out);
  if (bits <= 7) return int8_gemv<Codes::kBytes, kMins>(x, rows, k, x_block, wt, out, n_out);
  int8_gemv<Codes::kBytes8, kMins>(x, rows, k, x_block, wt, out, n_out);
}

std::optional<Factors> optional_factors(const std::optional<torch::Tensor>& t) {
  if (!t) return std::nullopt;
  return Factors::of(*t);
}

}  // namespace

// x [rows, K] fp32; codes uint8 of `bits` bits, [N, K/2] (packed: up to 4 bits) or [N, K];
// scales [N, G] (fp16/fp32, or integer sub-scales with super_scales [N, G / groups_per_super]);
// offsets: zeros (uint8/int16) or mins (fp32, or integer sub-mins with super_offsets);
// int8_block: when not 0, x is quantized to int8 per this many inputs first (a multiple
// of 32 dividing K; groups of 16 or of whole 32-input blocks).
// Returns [rows, N].
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                         bool mins, int64_t bits, int64_t group_size, std::optional<torch::Tensor> super_scales,
                         std::optional<torch::Tensor> super_offsets, int64_t groups_per_super, int64_t int8_block) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous fp32 [rows, K]");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == torch::kUInt8, "codes: contiguous uint8");
  TORCH_CHECK(bits >= 1 && bits <= 8, "codes are 1 to 8 bits");
  const bool packed = bits <= 4;
  const int64_t k = x.size(1);
  TORCH_CHECK(group_size > 0 && k % group_size == 0 && scales.size(1) * group_size == k, "groups do not tile K");
  TORCH_CHECK(!packed || group_size % 2 == 0, "packed codes need an even group size");
  TORCH_CHECK(codes.size(1) == (packed ? k / 2 : k), "codes do not match K");
  TORCH_CHECK(groups_per_super > 0, "groups_per_super must be positive");
  TORCH_CHECK(int8_block == 0 || (int8_block % kXBlock == 0 && k % int8_block == 0 &&
                                  (group_size == 16 || group_size % kXBlock == 0)),
              "int8 x needs blocks of 32s dividing K and groups of 16 or of whole 32-input blocks");
  const Weight weight{codes.data_ptr<uint8_t>(), packed, group_size, Factors::of(scales), Factors::of(offsets),
                      optional_factors(super_scales), optional_factors(super_offsets), groups_per_super};
  auto out = torch::empty({x.size(0), codes.size(0)}, x.options());
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t rows = x.size(0), n_out = codes.size(0);
  if (int8_block) {
    mins ? int8_gemv_for_bits<true>(bits, xs, rows, k, int8_block, weight, os, n_out)
         : int8_gemv_for_bits<false>(bits, xs, rows, k, int8_block, weight, os, n_out);
  } else if (packed) {
    mins ? gemv<true, true>(xs, rows, k, weight, os, n_out) : gemv<true, false>(xs, rows, k, weight, os, n_out);
  } else {
    mins ? gemv<false, true>(xs, rows, k, weight, os, n_out) : gemv<false, false>(xs, rows, k, weight, os, n_out);
  }
  return out;
}
