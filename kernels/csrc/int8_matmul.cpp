// int8-activation matmul over a tiled quantized weight (see api.h for the layout).
//
// As llama.cpp's CPU backend does, each row of x is rounded to int8 first: q = round(x / d)
// with d = max|x| / 127 per x_block inputs (32 for the simple GGUF types, 256 for the
// K-quants). A group's dot product with the codes u is then integer work, exact:
//     I = sum(u * q)            zero form: I - zero * sum(q)
// and the floats come in once per group and once per x block, in this order for every
// output element (row m, output n):
//     block = 0
//     for each group g of the x block:  block = fma(float(I_g), S_g, block)
//                                       mins form: block = block - M_g * float(sum_g(q))
//     total = fma(block, d, total)
// The same operations whatever the tile shape, so a row's result does not depend on how
// many other rows share the call: batch invariance by construction.
//
// A tile is kLanes output rows; one vector holds a four-input word of each, so a dot step
// (vpdpbusd on AVX-512 VNNI) meets a broadcast four-input word of x. Tiles of rows of x
// (kRows) share each loaded code vector, and kTiles tiles share each broadcast of x.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "api.h"
#include "runtime.h"
#include "simd.h"

namespace ls {
namespace {

using I = Simd::I;
using F = Simd::F;
constexpr int kLanes = Simd::kLanes;

// x rounded to int8, row by row.
struct Int8Rows {
  int64_t k, x_blocks, groups;
  std::vector<int8_t> q;       // [rows, k]
  std::vector<float> d;        // [rows, x_blocks]
  std::vector<int32_t> q_sum;  // [rows, groups]: sum of q over each weight group
  std::vector<float> q_sum_f;  // the same as floats (the mins form)
};

void quantize_row(const float* x, int64_t k, int64_t x_block, int64_t group, int8_t* q, float* d, int32_t* q_sum,
                  float* q_sum_f) {
  for (int64_t b = 0; b < k / x_block; ++b) {
    const float* src = x + b * x_block;
    float amax = 0.0f;
    for (int64_t j = 0; j < x_block; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float scale = amax / 127.0f;
    d[b] = scale;
    // nearbyint rounds half to even, as torch.round in the reference; x / d, not
    // x * (1 / d), which can round the other way at a half.
    for (int64_t j = 0; j < x_block; ++j)
      q[b * x_block + j] = scale == 0.0f ? 0 : static_cast<int8_t>(std::nearbyint(src[j] / scale));
  }
  for (int64_t g = 0; g < k / group; ++g) {
    int32_t sum = 0;
    for (int64_t j = 0; j < group; ++j) sum += q[g * group + j];
    q_sum[g] = sum;
    q_sum_f[g] = static_cast<float>(sum);
  }
}

Int8Rows quantize_rows(const float* x, int64_t rows, const ls_tiled_weight& w) {
  const int64_t k = w.k, x_blocks = k / w.x_block, groups = k / w.group;
  Int8Rows out{k, x_blocks, groups, std::vector<int8_t>(rows * k), std::vector<float>(rows * x_blocks),
               std::vector<int32_t>(rows * groups), std::vector<float>(rows * groups)};
#pragma omp parallel for num_threads(ls::threads()) schedule(static) if (rows > 1)
  for (int64_t m = 0; m < rows; ++m)
    quantize_row(x + m * k, k, w.x_block, w.group, out.q.data() + m * k, out.d.data() + m * x_blocks,
                 out.q_sum.data() + m * groups, out.q_sum_f.data() + m * groups);
  return out;
}

int32_t word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// kRows rows of x (from row0) against kTiles tiles (from tile0); results for every lane
// into total [kRows][kTiles * kLanes].
template <int kRows, int kTiles, int kHigh, bool kTwoLevel, bool kMins>
void tile_block(const ls_tiled_weight& w, const Int8Rows& xq, int64_t row0, int64_t tile0, float* total) {
  constexpr bool kNibbles = kHigh >= 0;
  constexpr int64_t kInputsPerChunk = kNibbles ? 8 : 4;
  const int64_t k = w.k, groups = xq.groups, supers = groups / w.groups_per_super;
  const int64_t chunks_per_tile = k / kInputsPerChunk, chunks_per_group = w.group / kInputsPerChunk;
  const int64_t groups_per_x_block = w.x_block / w.group;
  const int8_t* q[kRows];
  for (int r = 0; r < kRows; ++r) q[r] = xq.q.data() + (row0 + r) * k;
  const uint8_t *codes[kTiles], *high_planes[kTiles];
  for (int t = 0; t < kTiles; ++t) {
    codes[t] = w.codes + (tile0 + t) * chunks_per_tile * kLanes * 4;
    if constexpr (kHigh > 0) high_planes[t] = w.high + (tile0 + t) * (k / 32) * kHigh * kLanes * 4;
  }
  for (int i = 0; i < kRows * kTiles * kLanes; ++i) total[i] = 0.0f;

  for (int64_t g0 = 0, xb = 0; g0 < groups; g0 += groups_per_x_block, ++xb) {
    F block[kRows][kTiles];
    for (int r = 0; r < kRows; ++r)
      for (int t = 0; t < kTiles; ++t) block[r][t] = Simd::zerof();
    for (int64_t g = g0; g < g0 + groups_per_x_block; ++g) {
      F scale[kTiles], min[kTiles];
      for (int t = 0; t < kTiles; ++t) {
        const int64_t tile = tile0 + t;
        scale[t] = Simd::load_half(w.super_scales + (tile * supers + g / w.groups_per_super) * kLanes);
        if constexpr (kTwoLevel) scale[t] = Simd::mul(scale[t], Simd::load_i8(w.sub_scales + (tile * groups + g) * kLanes));
        if constexpr (kMins) {
          min[t] = Simd::load_half(w.super_mins + (tile * supers + g / w.groups_per_super) * kLanes);
          if constexpr (kTwoLevel) min[t] = Simd::mul(min[t], Simd::load_u8(w.sub_mins + (tile * groups + g) * kLanes));
        }
      }
      I dots[kRows][kTiles];
      for (int r = 0; r < kRows; ++r) {
        const int32_t start = w.zero > 0 ? -w.zero * xq.q_sum[(row0 + r) * groups + g] : 0;
        for (int t = 0; t < kTiles; ++t) dots[r][t] = Simd::set1(start);
      }
      for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
        const int64_t at = c * kInputsPerChunk;
        for (int t = 0; t < kTiles; ++t) {
          const I codes_word = Simd::load_codes(codes[t] + c * kLanes * 4);
          if constexpr (kNibbles) {
            I low = Simd::low_nibbles(codes_word), high = Simd::high_nibbles(codes_word);
            if constexpr (kHigh > 0) {  // 5- and 6-bit codes: their top bits from the plane
              const uint8_t* plane = high_planes[t] + (c / 4) * kHigh * kLanes * 4;
              const int within = static_cast<int>(c % 4);
              if constexpr (kHigh == 2) {
                low = Simd::or_bits(low, Simd::load_codes(plane), 2 * within, 0x03);
                high = Simd::or_bits(high, Simd::load_codes(plane + kLanes * 4), 2 * within, 0x03);
              } else {
                const I bits = Simd::load_codes(plane);
                low = Simd::or_bits(low, bits, within, 0x01);
                high = Simd::or_bits(high, bits, 4 + within, 0x01);
              }
            }
            for (int r = 0; r < kRows; ++r) {
              dots[r][t] = Simd::dot<false>(dots[r][t], low, word(q[r] + at));
              dots[r][t] = Simd::dot<false>(dots[r][t], high, word(q[r] + at + 4));
            }
          } else {
            for (int r = 0; r < kRows; ++r) dots[r][t] = Simd::dot<(kHigh < 0)>(dots[r][t], codes_word, word(q[r] + at));
          }
        }
      }
      for (int r = 0; r < kRows; ++r)
        for (int t = 0; t < kTiles; ++t) {
          block[r][t] = Simd::fmadd(Simd::to_float(dots[r][t]), scale[t], block[r][t]);
          if constexpr (kMins)
            block[r][t] = Simd::fnmadd(min[t], Simd::set1f(xq.q_sum_f[(row0 + r) * groups + g]), block[r][t]);
        }
    }
    for (int r = 0; r < kRows; ++r) {
      const F d = Simd::set1f(xq.d[(row0 + r) * xq.x_blocks + xb]);
      for (int t = 0; t < kTiles; ++t) {
        float* at = total + (r * kTiles + t) * kLanes;
        Simd::storef(at, Simd::fmadd(block[r][t], d, Simd::loadf(at)));
      }
    }
  }
}

// Every row of x against kTiles tiles from tile0: blocks of four rows, then two, then one.
template <int kTiles, int kHigh, bool kTwoLevel, bool kMins>
void tile_rows(const ls_tiled_weight& w, const Int8Rows& xq, int64_t rows, int64_t tile0, float* out) {
  float total[4 * kTiles * kLanes];
  const auto write = [&](int64_t row0, int block_rows) {
    for (int r = 0; r < block_rows; ++r)
      for (int t = 0; t < kTiles; ++t)
        for (int l = 0; l < kLanes; ++l) {
          const int64_t n = (tile0 + t) * kLanes + l;
          if (n < w.n) out[(row0 + r) * w.n + n] = total[(r * kTiles + t) * kLanes + l];
        }
  };
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    tile_block<4, kTiles, kHigh, kTwoLevel, kMins>(w, xq, r, tile0, total);
    write(r, 4);
  }
  for (; r + 2 <= rows; r += 2) {
    tile_block<2, kTiles, kHigh, kTwoLevel, kMins>(w, xq, r, tile0, total);
    write(r, 2);
  }
  for (; r < rows; ++r) {
    tile_block<1, kTiles, kHigh, kTwoLevel, kMins>(w, xq, r, tile0, total);
    write(r, 1);
  }
}

// Pairs of tiles split over the threads (one output row block each), a last odd tile alone.
template <int kHigh, bool kTwoLevel, bool kMins>
void matmul(const ls_tiled_weight& w, const float* x, int64_t rows, float* out) {
  constexpr int kPair = 2;
  const Int8Rows xq = quantize_rows(x, rows, w);
  const int64_t tiles = (w.n + kLanes - 1) / kLanes, pairs = tiles / kPair;
#pragma omp parallel for num_threads(ls::threads()) schedule(static)
  for (int64_t p = 0; p <= pairs; ++p) {
    if (p < pairs)
      tile_rows<kPair, kHigh, kTwoLevel, kMins>(w, xq, rows, p * kPair, out);
    else if (tiles % kPair)
      tile_rows<1, kHigh, kTwoLevel, kMins>(w, xq, rows, p * kPair, out);
  }
}

template <int kHigh>
void matmul_for_scales(const ls_tiled_weight& w, const float* x, int64_t rows, float* out) {
  const bool two_level = w.sub_scales != nullptr, mins = w.zero < 0;
  if (two_level)
    mins ? matmul<kHigh, true, true>(w, x, rows, out) : matmul<kHigh, true, false>(w, x, rows, out);
  else
    mins ? matmul<kHigh, false, true>(w, x, rows, out) : matmul<kHigh, false, false>(w, x, rows, out);
}

}  // namespace
}  // namespace ls

extern "C" {

int32_t ls_lanes() { return ls::kLanes; }

void ls_int8_matmul(const ls_tiled_weight* w, const float* x, int64_t rows, float* out) {
  switch (w->bits) {
    case 5: ls::matmul_for_scales<1>(*w, x, rows, out); break;
    case 6: ls::matmul_for_scales<2>(*w, x, rows, out); break;
    case 8: ls::matmul_for_scales<-1>(*w, x, rows, out); break;
    default: ls::matmul_for_scales<0>(*w, x, rows, out); break;  // 2 to 4 bits
  }
}

void ls_tiled_dequantize_rows(const ls_tiled_weight* w, const int64_t* index, int64_t count, float* out) {
  using ls::kLanes;
  const int64_t k = w->k, groups = k / w->group, supers = groups / w->groups_per_super;
  const bool nibbles = w->bits <= 6;
  const int64_t high_bits = nibbles && w->bits > 4 ? w->bits - 4 : 0;
  const int64_t inputs_per_chunk = nibbles ? 8 : 4, chunks_per_tile = k / inputs_per_chunk;
#pragma omp parallel for num_threads(ls::threads()) schedule(static) if (count > 1)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = index[i], tile = n / kLanes, lane = n % kLanes;
    const uint8_t* codes = w->codes + tile * chunks_per_tile * kLanes * 4 + lane * 4;
    const uint8_t* plane = high_bits ? w->high + tile * (k / 32) * high_bits * kLanes * 4 + lane * 4 : nullptr;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t chunk = j / inputs_per_chunk, within = j % inputs_per_chunk;
      const uint8_t byte = codes[chunk * kLanes * 4 + within % 4];
      int32_t code = nibbles ? (within < 4 ? byte & 0x0F : byte >> 4) : byte;
      if (high_bits) {  // input 8c + 4h + i of a 32-input block: see api.h
        const int64_t c = chunk % 4, h = within / 4, word = high_bits == 2 ? h : 0;
        const int64_t shift = high_bits == 2 ? 2 * c : c + 4 * h;
        const uint8_t top = plane[((chunk / 4) * high_bits + word) * kLanes * 4 + within % 4];
        code |= ((top >> shift) & ((1 << high_bits) - 1)) << 4;
      }
      const float u = static_cast<float>(code);
      const int64_t g = j / w->group, s = (tile * supers + g / w->groups_per_super) * kLanes + lane;
      const int64_t sub = (tile * groups + g) * kLanes + lane;
      float scale = ls::half_to_float(w->super_scales[s]);
      if (w->sub_scales) scale = scale * static_cast<float>(w->sub_scales[sub]);
      float value;
      if (w->zero >= 0) {
        value = (u - static_cast<float>(w->zero)) * scale;
      } else {
        float min = ls::half_to_float(w->super_mins[s]);
        if (w->sub_mins) min = min * static_cast<float>(w->sub_mins[sub]);
        value = scale * u - min;
      }
      out[i * k + j] = value;
    }
  }
}
}
