// int8-activation matmul over a tiled quantized weight (see api.h for the layout).
//
// As llama.cpp's CPU backend does, each row of x is rounded to int8 first: q = round(x / d)
// with d = max|x| / 127 per x_block inputs (32 for the simple GGUF types, 256 for the
// K-quants). A group's dot product with the codes u is then integer work, exact:
//     I = sum(u * q)            zero form: I - zero * sum(q)
// and the floats come in in this order for every output element (row m, output n):
//   one level of scales (Q4_0, Q8_0, ...), per x block:
//     block = 0
//     for each group g of the x block:  block = fma(float(I_g), S_g, block)
//                                       mins form: block = block - M_g * float(sum_g(q))
//     total = fma(block, d, total)
//   two levels (the K-quants: a super-block of groups, which is the x block, has fp16 S and
//   M, each group integer sub-scales s_g and m_g), as llama.cpp sums them:
//     I = sum_g s_g * I_g, J = sum_g m_g * sum_g(q)       (integers, exact)
//     block = S * float(I)            mins form: block = block - M * float(J)
//     total = fma(block, d, total)
// The same operations whatever the tile shape, so a row's result does not depend on how
// many other rows share the call: batch invariance by construction.
//
// A tile is kLanes output rows; one vector holds a four-input word of each, so a dot step
// (vpdpbusd on AVX-512 VNNI) meets a broadcast four-input word of x. Tiles of rows of x
// (kRows) share each loaded code vector, and kTiles tiles share each broadcast of x.
// Few rows meet the codes as stored (nibbles and top-bit planes unpacked as they load);
// many rows of a K-quant (prefill) meet them widened to bytes once per panel of inputs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "api.h"
#include "runtime.h"
#include "simd.h"
#include "team.h"

namespace ls {
namespace {

using I = Simd::I;
using F = Simd::F;
constexpr int kLanes = Simd::kLanes;

// x rounded to int8, row by row: a view of rows of an Int8Buffer.
struct Int8Rows {
  int64_t k, x_blocks, groups;
  const int8_t* q;         // [rows, k]
  const float* d;          // [rows, x_blocks]
  const int32_t* q_sum;    // [rows, groups]: sum of q over each weight group
  const float* q_sum_f;    // the same as floats (the mins form)

  Int8Rows from(int64_t row) const {
    return {k, x_blocks, groups, q + row * k, d + row * x_blocks, q_sum + row * groups, q_sum_f + row * groups};
  }
};

Int8Rows rows_of(const Int8Buffer& b) {
  return {b.k, b.k / b.x_block, b.k / b.group, b.q.data(), b.d.data(), b.q_sum.data(), b.q_sum_f.data()};
}

// Inputs [from, to) of one row, whole x blocks and whole groups: their int8 values, each
// block's d and each group's sum.
void quantize_span(const float* x, int64_t from, int64_t to, int64_t x_block, int64_t group, int8_t* q, float* d,
                   int32_t* q_sum, float* q_sum_f) {
  for (int64_t b = from / x_block; b < to / x_block; ++b) {
    const float* src = x + b * x_block;
    // max |x| as the largest bit pattern with the sign cleared (the same order for finite
    // floats): an integer max, which the compiler vectorizes where it will not a float one.
    uint32_t most = 0;
    for (int64_t j = 0; j < x_block; ++j) {
      uint32_t bits;
      std::memcpy(&bits, src + j, sizeof bits);
      most = std::max(most, bits & 0x7FFFFFFFu);
    }
    float amax;
    std::memcpy(&amax, &most, sizeof amax);
    const float scale = amax / 127.0f;
    d[b] = scale;
    // nearbyint rounds half to even, as torch.round in the reference; x / d, not
    // x * (1 / d), which can round the other way at a half.
    for (int64_t j = 0; j < x_block; ++j)
      q[b * x_block + j] = scale == 0.0f ? 0 : static_cast<int8_t>(std::nearbyint(src[j] / scale));
  }
  for (int64_t g = from / group; g < to / group; ++g) {
    int32_t sum = 0;
    for (int64_t j = 0; j < group; ++j) sum += q[g * group + j];
    q_sum[g] = sum;
    q_sum_f[g] = static_cast<float>(sum);
  }
}

// A buffer for rows of x rounded for weights of w's k, x_block and group. Rows are rounded in
// spans of whole x blocks and groups, of at least 512 inputs where k allows, shared out
// among the threads: one decode row's rounding would otherwise keep one thread busy alone.
void size_buffer(Int8Buffer& b, const ls_tiled_weight& w, int64_t rows) {
  b.k = w.k;
  b.x_block = w.x_block;
  b.group = w.group;
  b.span = std::lcm(w.x_block, w.group);
  while (b.span < 512 && w.k % (2 * b.span) == 0) b.span *= 2;
  b.q.resize(rows * w.k);
  b.d.resize(rows * (w.k / w.x_block));
  b.q_sum.resize(rows * (w.k / w.group));
  b.q_sum_f.resize(rows * (w.k / w.group));
}

// Span `span` of row m of x, rounded into b.
void quantize_buffer_span(const float* x, int64_t m, int64_t span, Int8Buffer& b) {
  const int64_t x_blocks = b.k / b.x_block, groups = b.k / b.group;
  quantize_span(x + m * b.k, span * b.span, (span + 1) * b.span, b.x_block, b.group, b.q.data() + m * b.k,
                b.d.data() + m * x_blocks, b.q_sum.data() + m * groups, b.q_sum_f.data() + m * groups);
}

int32_t word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// f(0), f(1), ..., f(kCount - 1), each index a compile-time constant.
template <class Each, int... kIndex>
[[gnu::always_inline]] inline void each_index(Each&& f, std::integer_sequence<int, kIndex...>) {
  (f(std::integral_constant<int, kIndex>()), ...);
}
template <int kCount, class Each>
[[gnu::always_inline]] inline void each_index(Each&& f) {
  each_index(f, std::make_integer_sequence<int, kCount>());
}

// Whether a tile's runs are short (4,096 inputs or fewer: 32 KB of nibbles on AVX-512), too
// short for the hardware prefetchers to keep ahead of (see TiledCodes::prefetch_ahead).
bool short_runs(const ls_tiled_weight& w) { return w.k <= 4096; }

int64_t tile_count(const ls_tiled_weight& w) { return (w.n + kLanes - 1) / kLanes; }

// Where the codes and group scales come from, for kTiles tiles from tile0. A chunk is the
// inputs one code vector covers: 8 for nibbles (two vectors, inputs 0-3 and 4-7, unpacked
// as they are loaded) or 4 for bytes. With kLevels, each nibble is looked up in the weight's
// 16 levels as it is unpacked (a codebook weight).
template <int kTiles, int kHigh, bool kTwoLevel, bool kMins, bool kLevels = false>
struct TiledCodes {
  static constexpr bool kNibbles = kHigh >= 0;
  static constexpr int kInputs = kNibbles ? 8 : 4, kParts = kNibbles ? 2 : 1;
  static constexpr bool kWide = kHigh < 0 || kLevels;  // codes may reach 255
  static constexpr int kMaxCode = kWide ? 255 : (16 << kHigh) - 1;
  static constexpr bool kMinsForm = kMins, kTwoLevels = kTwoLevel;
  static constexpr bool kTopBitPlane = kHigh > 0;
  const ls_tiled_weight& w;
  int64_t tile0, groups, supers, chunks, tiles;
  bool asks_ahead;  // short runs: see prefetch_ahead
  const uint8_t *codes[kTiles], *high_planes[kTiles];
  I levels;

  TiledCodes(const ls_tiled_weight& weight, int64_t first_tile)
      : w(weight), tile0(first_tile), groups(weight.k / weight.group), supers(groups / weight.groups_per_super),
        chunks(weight.k / kInputs), tiles(tile_count(weight)), asks_ahead(short_runs(weight)) {
    if constexpr (kLevels) levels = Simd::broadcast16(w.levels);
    for (int t = 0; t < kTiles; ++t) {
      codes[t] = w.codes + (tile0 + t) * chunks * kLanes * 4;
      high_planes[t] = kHigh > 0 ? w.high + (tile0 + t) * (w.k / 32) * kHigh * kLanes * 4 : nullptr;
    }
  }

  // Chunk c of tile t. kWithin: c % 4 (its place among the four chunks that share a word of
  // the top-bit plane) where the caller knows it at compile time, for constant shifts; else -1.
  template <int kWithin = -1>
  void load(int t, int64_t c, I parts[kParts]) const {
    prefetch_ahead(t, c);
    const I codes_word = Simd::load_codes(codes[t] + c * kLanes * 4);
    if constexpr (!kNibbles) {
      parts[0] = codes_word;
    } else {
      I low = Simd::low_nibbles(codes_word), high = Simd::high_nibbles(codes_word);
      if constexpr (kHigh > 0) {  // 5- and 6-bit codes: their top bits from the plane
        const uint8_t* plane = high_planes[t] + (c / 4) * kHigh * kLanes * 4;
        if constexpr (kWithin >= 0 && kHigh == 2) {
          low = Simd::or_bits<2 * kWithin, 0x03>(low, Simd::load_codes(plane));
          high = Simd::or_bits<2 * kWithin, 0x03>(high, Simd::load_codes(plane + kLanes * 4));
        } else if constexpr (kWithin >= 0) {
          const I bits = Simd::load_codes(plane);
          low = Simd::or_bits<kWithin, 0x01>(low, bits);
          high = Simd::or_bits<4 + kWithin, 0x01>(high, bits);
        } else if constexpr (kHigh == 2) {
          const int within = static_cast<int>(c % 4);
          low = Simd::or_bits(low, Simd::load_codes(plane), 2 * within, 0x03);
          high = Simd::or_bits(high, Simd::load_codes(plane + kLanes * 4), 2 * within, 0x03);
        } else {
          const int within = static_cast<int>(c % 4);
          const I bits = Simd::load_codes(plane);
          low = Simd::or_bits(low, bits, within, 0x01);
          high = Simd::or_bits(high, bits, 4 + within, 0x01);
        }
      }
      if constexpr (kLevels) {
        low = Simd::lookup16(levels, low);
        high = Simd::lookup16(levels, high);
      }
      parts[0] = low;
      parts[1] = high;
    }
  }

  // One stream of decode reads each tile's codes and scales as short runs (16 KB of codes for
  // a tile of a 2048-input Q4_K weight), several at a time: too short and too many for the
  // hardware prefetchers to keep ahead of, so the loads waited on memory between bursts of
  // arithmetic (Q4_K at 17 GB/s a thread where a plain read gets 28, on Zen 4). So the memory
  // system is asked for them kAheadBytes of codes early: a chunk's codes line as the chunk
  // loads, a block's scales as the block begins. Past a tile's end, the same place in the tile
  // kTiles on: the next task's, which this thread takes next unless the other takes it. Into
  // L2 (locality 1): into L1 it was slower, and so was asking for Q6_K's top-bit planes too.
  // Tiles of longer runs (a down projection's 8,192 inputs: 64 KB) the hardware streams well
  // alone; asked for as well, they came out slower.
  static constexpr int64_t kAheadBytes = 8192, kAheadChunks = kAheadBytes / (kLanes * 4);
  static constexpr int64_t kChunksPerLine = kLanes * 4 >= 64 ? 1 : 64 / (kLanes * 4);

  // (tile, position) of the place `ahead` units after position `at` of tile t, where a tile
  // has `per_tile` of them; tile >= tiles: past the weight.
  std::pair<int64_t, int64_t> ahead_of(int t, int64_t at, int64_t ahead, int64_t per_tile) const {
    const int64_t to = at + ahead;
    return {tile0 + t + kTiles * (to / per_tile), to % per_tile};
  }

  void prefetch_ahead(int t, int64_t c) const {
    if (c % kChunksPerLine != 0 || !asks_ahead) return;
    const auto [tile, chunk] = ahead_of(t, c, kAheadChunks, chunks);
    if (tile < tiles) __builtin_prefetch(w.codes + (tile * chunks + chunk) * kLanes * 4, 0, 1);
  }

  // The scales of the x block kAheadBytes of codes after block xb of tile t.
  void prefetch_scales(int t, int64_t xb) const {
    if (!asks_ahead) return;
    const int64_t chunks_per_block = w.x_block / kInputs, blocks = w.k / w.x_block;
    const auto [tile, block] = ahead_of(t, xb, std::max<int64_t>(1, kAheadChunks / chunks_per_block), blocks);
    if (tile >= tiles) return;
    const int64_t block_groups = w.x_block / w.group, block_supers = std::max<int64_t>(1, block_groups / w.groups_per_super);
    const int64_t group = tile * groups + block * block_groups, super = tile * supers + block * block_supers;
    prefetch_lines(w.super_scales + super * kLanes, block_supers * kLanes * 2);
    if (w.super_mins) prefetch_lines(w.super_mins + super * kLanes, block_supers * kLanes * 2);
    if (w.sub_scales) prefetch_lines(w.sub_scales + group * kLanes, block_groups * kLanes);
    if (w.sub_mins) prefetch_lines(w.sub_mins + group * kLanes, block_groups * kLanes);
  }

  static void prefetch_lines(const void* from, int64_t bytes) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(from) & ~uintptr_t{63};
    const uintptr_t end = reinterpret_cast<uintptr_t>(from) + bytes;
    for (uintptr_t line = first; line < end; line += 64) __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 1);
  }

  // One level: the group's scale and min as floats.
  F scale(int t, int64_t g) const {
    F s = Simd::load_half(w.super_scales + ((tile0 + t) * supers + g) * kLanes);
    if constexpr (kLevels) s = Simd::mul(s, Simd::set1f(w.level_scale));  // exact: a power of two
    return s;
  }
  F min(int t, int64_t g) const { return Simd::load_half(w.super_mins + ((tile0 + t) * supers + g) * kLanes); }

  // Two levels: a super-block's scale and min, a group's integer sub-scale and sub-min.
  F super_scale(int t, int64_t super) const { return scale(t, super); }
  F super_min(int t, int64_t super) const { return min(t, super); }
  // Group g's sub-scale; groups g and g + 1's (g even) as a factor pair.
  I sub_scale(int t, int64_t g) const { return Simd::factor_i8(w.sub_scales + ((tile0 + t) * groups + g) * kLanes); }
  I sub_scale_pair(int t, int64_t g) const { return Simd::factor_pair_i8(w.sub_scales + ((tile0 + t) * groups + g) * kLanes); }
  I sub_min_pair(int t, int64_t g) const { return Simd::factor_pair_u8(w.sub_mins + ((tile0 + t) * groups + g) * kLanes); }
};

// The codes of one panel of inputs (kPanel: one super-block) of kTiles tiles widened to
// bytes, and their scales and factors: made once, then met by every row of x. For many rows
// this beats unpacking nibbles and high planes again for each block of rows. Two-level
// weights only (the K-quants), whose super-block and x block are the panel.
constexpr int64_t kPanel = 256;

template <int kTiles>
struct Panel {
  alignas(64) uint8_t codes[kTiles][kPanel / 4][kLanes * 4];
  alignas(64) I sub_scales[kPanel / 16][kTiles];
  alignas(64) I sub_scale_pairs[kPanel / 32][kTiles];
  alignas(64) I sub_min_pairs[kPanel / 32][kTiles];
  alignas(64) float super_scales[kTiles][kLanes];
  alignas(64) float super_mins[kTiles][kLanes];
};

// A panel as a source of codes: small, passed by value like TiledCodes.
template <int kTiles, bool kMins, int kMaxCodes>
struct PanelCodes {
  static constexpr int kInputs = 4, kParts = 1;
  static constexpr int kMaxCode = kMaxCodes;
  static constexpr bool kWide = kMaxCode > 127;  // widened nibble codes stay below 128, levels do not
  static constexpr bool kMinsForm = kMins, kTwoLevels = true, kTopBitPlane = false;
  Panel<kTiles>* panel;
  int64_t chunk0 = 0, group0 = 0;

  template <class Source>
  void fill(const Source& source, int64_t x0, int64_t group, int64_t groups_per_super) {
    static_assert(Source::kTwoLevels, "panels hold two-level weights");
    chunk0 = x0 / kInputs;
    group0 = x0 / group;
    for (int t = 0; t < kTiles; ++t)
      for (int64_t c = 0; c < kPanel / Source::kInputs; c += 4)  // x0 / kInputs is a multiple of 4
        each_index<4>([&](auto within) {
          I parts[Source::kParts];
          source.template load<within>(t, x0 / Source::kInputs + c + within, parts);
          for (int p = 0; p < Source::kParts; ++p)
            Simd::store_codes(panel->codes[t][(c + within) * Source::kParts + p], parts[p]);
        });
    for (int t = 0; t < kTiles; ++t) {
      Simd::storef(panel->super_scales[t], source.super_scale(t, group0 / groups_per_super));
      if constexpr (kMins) Simd::storef(panel->super_mins[t], source.super_min(t, group0 / groups_per_super));
      for (int64_t g = 0; g < kPanel / group; ++g) panel->sub_scales[g][t] = source.sub_scale(t, group0 + g);
      for (int64_t g = 0; g < kPanel / group; g += 2) {
        panel->sub_scale_pairs[g / 2][t] = source.sub_scale_pair(t, group0 + g);
        if constexpr (kMins) panel->sub_min_pairs[g / 2][t] = source.sub_min_pair(t, group0 + g);
      }
    }
  }

  template <int kWithin = -1>
  void load(int t, int64_t c, I parts[1]) const { parts[0] = Simd::load_codes(panel->codes[t][c - chunk0]); }
  void prefetch_scales(int, int64_t) const {}  // filled from TiledCodes, which asked ahead
  F super_scale(int t, int64_t) const { return Simd::loadf(panel->super_scales[t]); }
  F super_min(int t, int64_t) const { return Simd::loadf(panel->super_mins[t]); }
  I sub_scale(int t, int64_t g) const { return panel->sub_scales[g - group0][t]; }
  I sub_scale_pair(int t, int64_t g) const { return panel->sub_scale_pairs[(g - group0) / 2][t]; }
  I sub_min_pair(int t, int64_t g) const { return panel->sub_min_pairs[(g - group0) / 2][t]; }
};

// How a code source's group dot products are formed on this vector unit.
template <class Codes>
struct DotForm {
  // Where the vector unit has no 8-bit dot product into 32 bits (AVX2), narrow codes' byte
  // pair products (|2 * kMaxCode * 127| per 16-bit lane) are summed in 16 bits for as many
  // steps as cannot overflow, then widened once: exact, and a third fewer instructions.
  static constexpr bool kPairSums = Simd::kNoByteDot && !Codes::kWide;
  static constexpr bool kCentred = Simd::kNoByteDot && Codes::kWide;  // AVX2 meets wide codes as u - 128
  static constexpr int kProductsPerWiden = 32767 / (2 * Codes::kMaxCode * 127);
  static constexpr int kChunksPerWiden =
      kProductsPerWiden / Codes::kParts > 0 ? kProductsPerWiden / Codes::kParts : 1;
  static_assert(!kPairSums || kProductsPerWiden >= Codes::kParts, "one chunk's products must fit 16 bits");
  // AVX2 multiplies by a factor as it widens (free: the widening is a multiply); byte-dot
  // units multiply a group's sums once.
  static constexpr bool kFactorInWidening = Simd::kNoByteDot;
};

// Group g's dot products of kRows rows (q) with kTiles tiles added into sums: times each
// tile's factor where the widening applies it (DotForm::kFactorInWidening), else as they are.
// kWithin0 >= 0: the group's kChunks chunks unrolled, the first at place kWithin0 of its
// top-bit plane word (the codes' shifts then constants); -1: a loop over chunks_per_group.
template <int kRows, int kTiles, class Codes, int kChunks = 0, int kWithin0 = -1>
[[gnu::always_inline]] inline void add_group_dots(const Codes& codes, const int8_t* const* q, int64_t g,
                                                  int64_t chunks_per_group, const I* factor, I (*sums)[kTiles]) {
  using Form = DotForm<Codes>;
  I pairs[kRows][kTiles];
  if constexpr (Form::kPairSums)
    for (int r = 0; r < kRows; ++r)
      for (int t = 0; t < kTiles; ++t) pairs[r][t] = Simd::set1(0);
  const auto chunk = [&](int64_t i, auto within) __attribute__((always_inline)) {
    const int64_t c = g * chunks_per_group + i, at = c * Codes::kInputs;
    I parts[kTiles][Codes::kParts];
    for (int t = 0; t < kTiles; ++t) codes.template load<decltype(within)::value>(t, c, parts[t]);
    for (int r = 0; r < kRows; ++r)
      for (int p = 0; p < Codes::kParts; ++p) {
        const int32_t x4 = word(q[r] + at + 4 * p);
        for (int t = 0; t < kTiles; ++t) {
          if constexpr (Form::kPairSums)
            pairs[r][t] = Simd::dot16(pairs[r][t], parts[t][p], x4);
          else if constexpr (Form::kCentred)
            sums[r][t] = Simd::dot_centred(sums[r][t], parts[t][p], x4, factor[t]);
          else
            sums[r][t] = Simd::dot<Codes::kWide>(sums[r][t], parts[t][p], x4);
        }
      }
    if constexpr (Form::kPairSums) {  // widened before the 16-bit sums could overflow, and at the group's end
      if ((i + 1) % Form::kChunksPerWiden == 0 || i + 1 == chunks_per_group)
        for (int r = 0; r < kRows; ++r)
          for (int t = 0; t < kTiles; ++t) {
            sums[r][t] = Simd::widen16(sums[r][t], pairs[r][t], factor[t]);
            pairs[r][t] = Simd::set1(0);
          }
    }
  };
  if constexpr (kWithin0 >= 0)
    each_index<kChunks>([&](auto i) __attribute__((always_inline)) {
      chunk(i, std::integral_constant<int, kWithin0 + decltype(i)::value>());
    });
  else
    for (int64_t i = 0; i < chunks_per_group; ++i) chunk(i, std::integral_constant<int, -1>());
}

// kRows rows of x (from row0) against kTiles tiles, x blocks [xb0, xb1): each block's sum
// added into total [kRows][kTiles * kLanes]. The one place the sums are formed, whatever
// the codes' source, so a row's result is the same bits by either path. Kept out of line:
// inlined, GCC 12 spends registers on copies of the accumulators (measured: 10-20% slower).
// kGroup: the weight's group size when known at compile time (its chunk loop unrolled), or 0.
template <int kRows, int kTiles, class Codes, int kGroup = 0>
[[gnu::noinline]] void add_x_blocks(const Codes codes, const ls_tiled_weight& w, const Int8Rows& xq, int64_t row0,
                                    int64_t xb0, int64_t xb1, float* total) {
  using Form = DotForm<Codes>;
  const int64_t group_size = kGroup > 0 ? kGroup : w.group;
  const int64_t groups = xq.groups, groups_per_x_block = w.x_block / group_size;
  const int64_t chunks_per_group = group_size / Codes::kInputs;
  constexpr int kChunks = kGroup / Codes::kInputs;  // 0 where the group size is not known here
  // Unrolled four chunks a group (Q5_K) for 4 rows spill registers: 5-8% slower, measured.
  constexpr bool kConstantShifts = Codes::kTopBitPlane && (kChunks == 2 || (kChunks == 4 && kRows < 4));
  const int8_t* q[kRows];
  for (int r = 0; r < kRows; ++r) q[r] = xq.q + (row0 + r) * xq.k;
  // A centred dot leaves out 128 * sum(q) (Simd::dot_centred): added back with the zero
  // point's term, where a zero point of 128 (Q8_0, the codebooks) cancels it.
  const int32_t q_sum_factor = (w.zero > 0 ? -w.zero : 0) + (Form::kCentred ? 128 : 0);
  I unit[kTiles];
  for (int t = 0; t < kTiles; ++t) unit[t] = Simd::unit_factor();

  for (int64_t xb = xb0; xb < xb1; ++xb) {
    const int64_t g0 = xb * groups_per_x_block, g1 = g0 + groups_per_x_block;
    for (int t = 0; t < kTiles; ++t) codes.prefetch_scales(t, xb);
    F block[kRows][kTiles];
    if constexpr (Codes::kTwoLevels) {
      // I = sum_g s_g * I_g first; then, with q_sum_g = sum_g(q), the zero point's (and a
      // centred dot's) sum_g s_g * q_sum_g and the mins' J = sum_g m_g * q_sum_g.
      I sums[kRows][kTiles];
      for (int r = 0; r < kRows; ++r)
        for (int t = 0; t < kTiles; ++t) sums[r][t] = Simd::set1(0);
      const auto group_dots = [&](int64_t g, auto within0) __attribute__((always_inline)) {
        constexpr int kWithin0 = decltype(within0)::value;
        I sub_scale[kTiles];
        for (int t = 0; t < kTiles; ++t) sub_scale[t] = codes.sub_scale(t, g);
        if constexpr (Form::kFactorInWidening) {
          add_group_dots<kRows, kTiles, Codes, kChunks, kWithin0>(codes, q, g, chunks_per_group, sub_scale, sums);
        } else {
          I dots[kRows][kTiles];
          for (int r = 0; r < kRows; ++r)
            for (int t = 0; t < kTiles; ++t) dots[r][t] = Simd::set1(0);
          add_group_dots<kRows, kTiles, Codes, kChunks, kWithin0>(codes, q, g, chunks_per_group, sub_scale, dots);
          for (int r = 0; r < kRows; ++r)
            for (int t = 0; t < kTiles; ++t) sums[r][t] = Simd::add_scaled(sums[r][t], dots[r][t], sub_scale[t]);
        }
      };
      // A plane of top bits (Q5_K, Q6_K) holds four chunks' bits per word: with groups of 16
      // or 32 inputs a pair of groups covers whole words, the first from place 0 (g0 is even),
      // so each chunk's place, and its shifts, are constants.
      if constexpr (kConstantShifts)
        for (int64_t g = g0; g < g1; g += 2) {
          group_dots(g, std::integral_constant<int, 0>());
          group_dots(g + 1, std::integral_constant<int, kChunks % 4>());
        }
      else
        for (int64_t g = g0; g < g1; ++g) group_dots(g, std::integral_constant<int, -1>());
      I zero_terms[kRows][kTiles], min_terms[kRows][kTiles];
      for (int r = 0; r < kRows; ++r)
        for (int t = 0; t < kTiles; ++t) zero_terms[r][t] = min_terms[r][t] = Simd::set1(0);
      for (int64_t g = g0; g < g1; g += 2)  // two groups a step (a super-block has an even count)
        for (int t = 0; t < kTiles; ++t) {
          I scale_pair = Simd::set1(0), min_pair = Simd::set1(0);
          if (q_sum_factor != 0) scale_pair = codes.sub_scale_pair(t, g);
          if constexpr (Codes::kMinsForm) min_pair = codes.sub_min_pair(t, g);
          for (int r = 0; r < kRows; ++r) {
            const int32_t* q_sum = xq.q_sum + (row0 + r) * groups + g;
            const int32_t both = static_cast<int32_t>((static_cast<uint32_t>(q_sum[0]) & 0xFFFF) | (static_cast<uint32_t>(q_sum[1]) << 16));
            if (q_sum_factor != 0) zero_terms[r][t] = Simd::add_pair_times(zero_terms[r][t], scale_pair, both);
            if constexpr (Codes::kMinsForm) min_terms[r][t] = Simd::add_pair_times(min_terms[r][t], min_pair, both);
          }
        }
      const int64_t super = g0 / w.groups_per_super;
      for (int t = 0; t < kTiles; ++t) {
        const F scale = codes.super_scale(t, super);
        F min = Simd::zerof();
        if constexpr (Codes::kMinsForm) min = codes.super_min(t, super);
        for (int r = 0; r < kRows; ++r) {
          const I exact = q_sum_factor != 0 ? Simd::add_times(sums[r][t], zero_terms[r][t], q_sum_factor) : sums[r][t];
          block[r][t] = Simd::mul(scale, Simd::to_float(exact));
          if constexpr (Codes::kMinsForm) block[r][t] = Simd::fnmadd(min, Simd::to_float(min_terms[r][t]), block[r][t]);
        }
      }
    } else {
      for (int r = 0; r < kRows; ++r)
        for (int t = 0; t < kTiles; ++t) block[r][t] = Simd::zerof();
      for (int64_t g = g0; g < g1; ++g) {
        F scale[kTiles], min[kTiles];
        for (int t = 0; t < kTiles; ++t) {
          scale[t] = codes.scale(t, g);
          if constexpr (Codes::kMinsForm) min[t] = codes.min(t, g);
        }
        I dots[kRows][kTiles];
        for (int r = 0; r < kRows; ++r)
          for (int t = 0; t < kTiles; ++t) dots[r][t] = Simd::set1(q_sum_factor * xq.q_sum[(row0 + r) * groups + g]);
        add_group_dots<kRows, kTiles>(codes, q, g, chunks_per_group, unit, dots);
        for (int r = 0; r < kRows; ++r)
          for (int t = 0; t < kTiles; ++t) {
            block[r][t] = Simd::fmadd(Simd::to_float(dots[r][t]), scale[t], block[r][t]);
            if constexpr (Codes::kMinsForm)
              block[r][t] = Simd::fnmadd(min[t], Simd::set1f(xq.q_sum_f[(row0 + r) * groups + g]), block[r][t]);
          }
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

// Every row of x in blocks: fours, then the last one to five rows as one block, so that a
// step verifying two to four draft tokens (three to five rows) meets the codes once, not
// twice (five rows through Llama-3.2-1B's Q4_K gate_up: 1.13 ms against 1.31, Zen 4). Each row's sums are formed the same
// way in any block, so its result does not depend on the rows beside it.
template <int kRows>
using Rows = std::integral_constant<int, kRows>;

template <class Each>
void row_blocks(int64_t rows, Each each) {
  int64_t r = 0;
  for (; rows - r > 5; r += 4) each(Rows<4>(), r);
  switch (rows - r) {
    case 5: return each(Rows<5>(), r);
    case 4: return each(Rows<4>(), r);
    case 3: return each(Rows<3>(), r);
    case 2: return each(Rows<2>(), r);
    case 1: return each(Rows<1>(), r);
  }
}

// Rows' totals [rows][kTiles * kLanes] into out, dropping the padding lanes of a last tile.
template <int kTiles>
void write_rows(const ls_tiled_weight& w, const float* total, int64_t row0, int64_t rows, int64_t tile0,
                const Output& out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int t = 0; t < kTiles; ++t)
      for (int l = 0; l < kLanes; ++l) {
        const int64_t n = (tile0 + t) * kLanes + l;
        if (n < w.n) out.data[(row0 + r) * out.stride + n] = total[(r * kTiles + t) * kLanes + l];
      }
}

// f(group) with the weight's group size as a compile-time constant where it is a common one
// (16 or 32: the chunk loop unrolled), else 0 (read from the weight).
template <class F>
void with_group_size(int64_t group, F f) {
  if (group == 32)
    f(std::integral_constant<int, 32>());
  else if (group == 16)
    f(std::integral_constant<int, 16>());
  else
    f(std::integral_constant<int, 0>());
}

// Few rows: each block of rows meets the tiles' codes as they are stored, all of k at once.
template <int kTiles, class Codes>
void tile_rows_direct(const Codes& codes, const ls_tiled_weight& w, const Int8Rows& xq, int64_t rows, int64_t tile0,
                      const Output& out) {
  float total[5 * kTiles * kLanes];
  with_group_size(w.group, [&](auto group) {
    row_blocks(rows, [&](auto block_rows, int64_t row0) {
      constexpr int kRows = decltype(block_rows)::value;
      std::fill(total, total + kRows * kTiles * kLanes, 0.0f);
      add_x_blocks<kRows, kTiles, Codes, decltype(group)::value>(codes, w, xq, row0, 0, w.k / w.x_block, total);
      write_rows<kTiles>(w, total, row0, kRows, tile0, out);
    });
  });
}

// Many rows: panel by panel, every row meets the panel's widened codes.
template <int kTiles, bool kMins, class Codes>
void tile_rows_by_panel(const Codes& codes, const ls_tiled_weight& w, const Int8Rows& xq, int64_t rows,
                        int64_t tile0, const Output& out) {
  std::vector<float> total(rows * kTiles * kLanes, 0.0f);
  Panel<kTiles> buffer;
  using Source = PanelCodes<kTiles, kMins, Codes::kMaxCode>;
  Source panel{&buffer};
  for (int64_t x0 = 0; x0 < w.k; x0 += kPanel) {
    panel.fill(codes, x0, w.group, w.groups_per_super);
    with_group_size(w.group, [&](auto group) {
      row_blocks(rows, [&](auto block_rows, int64_t row0) {
        constexpr int kRows = decltype(block_rows)::value;
        add_x_blocks<kRows, kTiles, Source, decltype(group)::value>(panel, w, xq, row0, x0 / kPanel, x0 / kPanel + 1,
                                                                     total.data() + row0 * kTiles * kLanes);
      });
    });
  }
  write_rows<kTiles>(w, total.data(), 0, rows, tile0, out);
}

// The K-quants (two-level scales; Q5_K and Q6_K with a plane of top bits) widen their codes
// and scales once per panel from this many rows. Measured against the direct path: at 16
// rows Q4_K 1.0x, Q5_K and Q6_K 1.3-1.4x; at 64 to 512 rows (prefill) 1.2-1.9x. The
// single-scale types (Q4_0, Q8_0) unpack in a step or two and gain nothing: they stay direct.
constexpr int64_t kPanelRows = 16;

template <int kTiles, int kHigh, bool kTwoLevel, bool kMins, bool kLevels>
void tile_rows(const ls_tiled_weight& w, const Int8Rows& xq, int64_t rows, int64_t tile0, const Output& out) {
  const TiledCodes<kTiles, kHigh, kTwoLevel, kMins, kLevels> codes(w, tile0);
  if constexpr (kTwoLevel)
    if (rows >= kPanelRows && w.x_block == kPanel) return tile_rows_by_panel<kTiles, kMins>(codes, w, xq, rows, tile0, out);
  tile_rows_direct<kTiles>(codes, w, xq, rows, tile0, out);
}

// The row kernels for one weight's code and scale form: over a pair of tiles, or one.
using TileRows = void (*)(const ls_tiled_weight&, const Int8Rows&, int64_t, int64_t, const Output&);
struct TileKernels {
  TileRows pair, single;
};

template <int kHigh, bool kTwoLevel, bool kMins, bool kLevels = false>
TileKernels kernels_of() {
  return {&tile_rows<2, kHigh, kTwoLevel, kMins, kLevels>, &tile_rows<1, kHigh, kTwoLevel, kMins, kLevels>};
}

template <int kHigh>
TileKernels kernels_for_scales(const ls_tiled_weight& w) {
  const bool two_level = w.sub_scales != nullptr, mins = w.zero < 0;
  if (two_level) return mins ? kernels_of<kHigh, true, true>() : kernels_of<kHigh, true, false>();
  return mins ? kernels_of<kHigh, false, true>() : kernels_of<kHigh, false, false>();
}

TileKernels kernels_for(const ls_tiled_weight& w) {
  // Codebook weights: 4-bit codes, zero form, one or two levels of scales.
  if (w.levels) return w.sub_scales ? kernels_of<0, true, false, true>() : kernels_of<0, false, false, true>();
  switch (w.bits) {
    case 5: return kernels_for_scales<1>(w);
    case 6: return kernels_for_scales<2>(w);
    case 8: return kernels_for_scales<-1>(w);
    default: return kernels_for_scales<0>(w);  // 2 to 4 bits
  }
}

// A weight's work splits into tasks: pairs of tiles, which share each broadcast of x, then a
// last odd tile alone. With few rows of short-run tiles, tiles alone: a task then streams one
// tile's codes and scales instead of two tiles' side by side, which one thread read at 17 GB/s
// and alone at 24-25 (Zen 4, Q4_K of 2,048 inputs; 2 threads 29-31 -> 31-34 GB/s, with the
// VM's bandwidth near its busy 34). Longer runs (down: 8,192 inputs) stream better in pairs.
bool tiles_alone(const ls_tiled_weight& w, int64_t rows) { return rows < kPanelRows && short_runs(w); }

int64_t tile_tasks(const ls_tiled_weight& w, int64_t rows) {
  const int64_t tiles = tile_count(w);
  return tiles_alone(w, rows) ? tiles : tiles / 2 + tiles % 2;
}

void run_tile_task(const TileKernels& kernels, const ls_tiled_weight& w, const Int8Rows& xq, int64_t rows,
                   int64_t task, const Output& out) {
  const int64_t tiles = tile_count(w);
  if (tiles_alone(w, rows)) return kernels.single(w, xq, rows, task, out);
  (2 * task + 1 < tiles ? kernels.pair : kernels.single)(w, xq, rows, 2 * task, out);
}

bool same_form(const Int8Buffer& b, const ls_tiled_weight& w) {
  return b.k == w.k && b.x_block == w.x_block && b.group == w.group;
}

// Each job's rows through its weight, as separate calls would, in one parallel region (see api.h).
void grouped_matmul(const ls_tiled_weight* const* weights, const int64_t* ids, const int64_t* counts, int64_t groups,
                    const float* x, float* out) {
  std::vector<MatmulJob> jobs(groups);
  int64_t row0 = 0;
  for (int64_t i = 0; i < groups; ++i) {
    jobs[i] = {weights[ids[i]], row0, counts[i], {out + row0 * weights[ids[i]]->n, weights[ids[i]]->n}};
    row0 += counts[i];
  }
  Int8Scratch scratch;
#pragma omp parallel num_threads(ls::threads())
  int8_matmul_team(jobs.data(), groups, x, row0, scratch);
}

}  // namespace

void int8_matmul_team(const MatmulJob* jobs, int64_t count, const float* x, int64_t x_rows, Int8Scratch& s) {
#pragma omp single
  {
    // The distinct rounding forms (a projection's parts may differ: Q4_K beside Q6_K),
    // and where each job's tile tasks begin.
    int64_t used = 0;
    s.job_form.resize(count);
    s.task_start.resize(count + 1);
    s.task_start[0] = 0;
    for (int64_t i = 0; i < count; ++i) {
      const ls_tiled_weight& w = *jobs[i].w;
      int64_t f = 0;
      while (f < used && !same_form(s.forms[f], w)) ++f;
      if (f == used) {
        if (static_cast<int64_t>(s.forms.size()) <= used) s.forms.emplace_back();
        size_buffer(s.forms[used++], w, x_rows);
      }
      s.job_form[i] = static_cast<int32_t>(f);
      s.task_start[i + 1] = s.task_start[i] + (jobs[i].rows > 0 ? tile_tasks(w, jobs[i].rows) : 0);
    }
    s.forms.resize(used);
  }
  int64_t spans = 0;
  for (const Int8Buffer& form : s.forms) spans += x_rows * (form.k / form.span);
#pragma omp for schedule(static)
  for (int64_t item = 0; item < spans; ++item) {
    int64_t at = item, f = 0;
    for (; at >= x_rows * (s.forms[f].k / s.forms[f].span); ++f) at -= x_rows * (s.forms[f].k / s.forms[f].span);
    const int64_t per_row = s.forms[f].k / s.forms[f].span;
    quantize_buffer_span(x, at / per_row, at % per_row, s.forms[f]);
  }
  const int64_t tasks = s.task_start[count];
  // Handed out in chunks as threads come for them, not split in equal halves up front: on a
  // machine where another program holds a core, the thread sharing it does less of the work
  // instead of holding up the step (each output is one task's, so the bits do not change).
#pragma omp for schedule(dynamic, 8)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t i = std::upper_bound(s.task_start.begin(), s.task_start.end(), task) - s.task_start.begin() - 1;
    const MatmulJob& job = jobs[i];
    run_tile_task(kernels_for(*job.w), *job.w, rows_of(s.forms[s.job_form[i]]).from(job.row0), job.rows,
                  task - s.task_start[i], job.out);
  }
}

}  // namespace ls

extern "C" {

int32_t ls_lanes() { return ls::kLanes; }

void ls_int8_matmul(const ls_tiled_weight* w, const float* x, int64_t rows, float* out) {
  const int64_t first = 0;
  ls::grouped_matmul(&w, &first, &rows, 1, x, out);
}

void ls_grouped_int8_matmul(const ls_tiled_weight* const* weights, const int64_t* ids, const int64_t* counts,
                            int64_t groups, const float* x, float* out) {
  if (groups > 0) ls::grouped_matmul(weights, ids, counts, groups, x, out);
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
      if (w->levels) code = w->levels[code];
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
      if (w->levels) scale = scale * w->level_scale;
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
