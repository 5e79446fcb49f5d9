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
// Few rows meet the codes as stored (nibbles and top-bit planes unpacked as they load);
// many rows of a K-quant (prefill) meet them widened to bytes once per panel of inputs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
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

// A buffer for rows of x rounded for weights of w's k, x_block and group.
void size_buffer(Int8Buffer& b, const ls_tiled_weight& w, int64_t rows) {
  b.k = w.k;
  b.x_block = w.x_block;
  b.group = w.group;
  b.q.resize(rows * w.k);
  b.d.resize(rows * (w.k / w.x_block));
  b.q_sum.resize(rows * (w.k / w.group));
  b.q_sum_f.resize(rows * (w.k / w.group));
}

void quantize_buffer_row(const float* x, int64_t m, Int8Buffer& b) {
  const int64_t x_blocks = b.k / b.x_block, groups = b.k / b.group;
  quantize_row(x + m * b.k, b.k, b.x_block, b.group, b.q.data() + m * b.k, b.d.data() + m * x_blocks,
               b.q_sum.data() + m * groups, b.q_sum_f.data() + m * groups);
}

int32_t word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

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
  static constexpr bool kMinsForm = kMins;
  const ls_tiled_weight& w;
  int64_t tile0, groups, supers;
  int super_shift;  // log2(groups_per_super), or -1: a division per group costs as much as its dot products
  const uint8_t *codes[kTiles], *high_planes[kTiles];
  I levels;

  TiledCodes(const ls_tiled_weight& weight, int64_t first_tile)
      : w(weight), tile0(first_tile), groups(weight.k / weight.group), supers(groups / weight.groups_per_super),
        super_shift((weight.groups_per_super & (weight.groups_per_super - 1)) == 0
                        ? __builtin_ctz(static_cast<unsigned>(weight.groups_per_super)) : -1) {
    if constexpr (kLevels) levels = Simd::broadcast16(w.levels);
    for (int t = 0; t < kTiles; ++t) {
      codes[t] = w.codes + (tile0 + t) * (w.k / kInputs) * kLanes * 4;
      high_planes[t] = kHigh > 0 ? w.high + (tile0 + t) * (w.k / 32) * kHigh * kLanes * 4 : nullptr;
    }
  }

  void load(int t, int64_t c, I parts[kParts]) const {
    const I codes_word = Simd::load_codes(codes[t] + c * kLanes * 4);
    if constexpr (!kNibbles) {
      parts[0] = codes_word;
    } else {
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
      if constexpr (kLevels) {
        low = Simd::lookup16(levels, low);
        high = Simd::lookup16(levels, high);
      }
      parts[0] = low;
      parts[1] = high;
    }
  }

  int64_t super_of(int64_t g) const { return super_shift >= 0 ? g >> super_shift : g / w.groups_per_super; }

  F scale(int t, int64_t g) const {
    const int64_t tile = tile0 + t;
    F s = Simd::load_half(w.super_scales + (tile * supers + super_of(g)) * kLanes);
    if constexpr (kTwoLevel) s = Simd::mul(s, Simd::load_i8(w.sub_scales + (tile * groups + g) * kLanes));
    if constexpr (kLevels) s = Simd::mul(s, Simd::set1f(w.level_scale));  // exact: a power of two
    return s;
  }

  F min(int t, int64_t g) const {
    const int64_t tile = tile0 + t;
    F m = Simd::load_half(w.super_mins + (tile * supers + super_of(g)) * kLanes);
    if constexpr (kTwoLevel) m = Simd::mul(m, Simd::load_u8(w.sub_mins + (tile * groups + g) * kLanes));
    return m;
  }
};

// The codes of one panel of inputs (kPanel, or what is left of k) of kTiles tiles widened
// to bytes, and their groups' scales as floats: made once, then met by every row of x.
// For many rows this beats unpacking nibbles and high planes again for each block of rows.
constexpr int64_t kPanel = 256;

template <int kTiles>
struct Panel {
  alignas(64) uint8_t codes[kTiles][kPanel / 4][kLanes * 4];
  alignas(64) float scales[kPanel / 16][kTiles][kLanes];
  alignas(64) float mins[kPanel / 16][kTiles][kLanes];
};

// A panel as a source of codes: small, passed by value like TiledCodes.
template <int kTiles, bool kMins, int kMaxCodes>
struct PanelCodes {
  static constexpr int kInputs = 4, kParts = 1;
  static constexpr int kMaxCode = kMaxCodes;
  static constexpr bool kWide = kMaxCode > 127;  // widened nibble codes stay below 128, levels do not
  static constexpr bool kMinsForm = kMins;
  Panel<kTiles>* panel;
  int64_t chunk0 = 0, group0 = 0;

  template <class Source>
  void fill(const Source& source, int64_t x0, int64_t length, int64_t group) {
    chunk0 = x0 / kInputs;
    group0 = x0 / group;
    for (int t = 0; t < kTiles; ++t)
      for (int64_t c = 0; c < length / Source::kInputs; ++c) {
        I parts[Source::kParts];
        source.load(t, x0 / Source::kInputs + c, parts);
        for (int p = 0; p < Source::kParts; ++p) Simd::store_codes(panel->codes[t][c * Source::kParts + p], parts[p]);
      }
    for (int64_t g = 0; g < length / group; ++g)
      for (int t = 0; t < kTiles; ++t) {
        Simd::storef(panel->scales[g][t], source.scale(t, group0 + g));
        if constexpr (kMins) Simd::storef(panel->mins[g][t], source.min(t, group0 + g));
      }
  }

  void load(int t, int64_t c, I parts[1]) const { parts[0] = Simd::load_codes(panel->codes[t][c - chunk0]); }
  F scale(int t, int64_t g) const { return Simd::loadf(panel->scales[g - group0][t]); }
  F min(int t, int64_t g) const { return Simd::loadf(panel->mins[g - group0][t]); }
};

// kRows rows of x (from row0) against kTiles tiles, x blocks [xb0, xb1): each block's sum
// added into total [kRows][kTiles * kLanes]. The one place the sums are formed, whatever
// the codes' source, so a row's result is the same bits by either path. Kept out of line:
// inlined, GCC 12 spends registers on copies of the accumulators (measured: 10-20% slower).
// kGroup: the weight's group size when known at compile time (its chunk loop unrolled), or 0.
template <int kRows, int kTiles, class Codes, int kGroup = 0>
[[gnu::noinline]] void add_x_blocks(const Codes codes, const ls_tiled_weight& w, const Int8Rows& xq, int64_t row0,
                                    int64_t xb0, int64_t xb1, float* total) {
  constexpr int kParts = Codes::kParts;
  // Where the vector unit has no 8-bit dot product into 32 bits (AVX2), narrow codes' byte
  // pair products (|2 * kMaxCode * 127| per 16-bit lane) are summed in 16 bits for as many
  // steps as cannot overflow, then widened once: exact, and a third fewer instructions.
  constexpr bool kPairSums = Simd::kNoByteDot && !Codes::kWide;
  constexpr bool kCentred = Simd::kNoByteDot && Codes::kWide;  // AVX2 meets wide codes as u - 128
  constexpr int kProductsPerWiden = 32767 / (2 * Codes::kMaxCode * 127);
  constexpr int kChunksPerWiden = kProductsPerWiden / kParts > 0 ? kProductsPerWiden / kParts : 1;
  static_assert(!kPairSums || kProductsPerWiden >= kParts, "one chunk's products must fit 16 bits");
  const int64_t group_size = kGroup > 0 ? kGroup : w.group;
  const int64_t groups = xq.groups, groups_per_x_block = w.x_block / group_size;
  const int64_t chunks_per_group = group_size / Codes::kInputs;
  const int8_t* q[kRows];
  for (int r = 0; r < kRows; ++r) q[r] = xq.q + (row0 + r) * xq.k;

  for (int64_t xb = xb0; xb < xb1; ++xb) {
    F block[kRows][kTiles];
    for (int r = 0; r < kRows; ++r)
      for (int t = 0; t < kTiles; ++t) block[r][t] = Simd::zerof();
    for (int64_t g = xb * groups_per_x_block; g < (xb + 1) * groups_per_x_block; ++g) {
      F scale[kTiles], min[kTiles];
      for (int t = 0; t < kTiles; ++t) {
        scale[t] = codes.scale(t, g);
        if constexpr (Codes::kMinsForm) min[t] = codes.min(t, g);
      }
      I dots[kRows][kTiles], pairs[kRows][kTiles];
      for (int r = 0; r < kRows; ++r) {
        const int32_t q_sum = xq.q_sum[(row0 + r) * groups + g];
        // A centred dot leaves out 128 * sum(q) (Simd::dot_centred): added here once a group,
        // where a zero point of 128 (Q8_0, the codebooks) cancels it.
        const int32_t start = (w.zero > 0 ? -w.zero * q_sum : 0) + (kCentred ? 128 * q_sum : 0);
        for (int t = 0; t < kTiles; ++t) dots[r][t] = Simd::set1(start), pairs[r][t] = Simd::set1(0);
      }
      for (int64_t i = 0; i < chunks_per_group; ++i) {
        const int64_t c = g * chunks_per_group + i, at = c * Codes::kInputs;
        I parts[kTiles][kParts];
        for (int t = 0; t < kTiles; ++t) codes.load(t, c, parts[t]);
        for (int r = 0; r < kRows; ++r)
          for (int p = 0; p < kParts; ++p) {
            const int32_t x4 = word(q[r] + at + 4 * p);
            for (int t = 0; t < kTiles; ++t) {
              if constexpr (kPairSums)
                pairs[r][t] = Simd::dot16(pairs[r][t], parts[t][p], x4);
              else
                dots[r][t] = kCentred ? Simd::dot_centred(dots[r][t], parts[t][p], x4)
                                      : Simd::dot<Codes::kWide>(dots[r][t], parts[t][p], x4);
            }
          }
        if constexpr (kPairSums) {  // widened before the 16-bit sums could overflow, and at the group's end
          if ((i + 1) % kChunksPerWiden == 0 || i + 1 == chunks_per_group)
            for (int r = 0; r < kRows; ++r)
              for (int t = 0; t < kTiles; ++t) {
                dots[r][t] = Simd::widen16(dots[r][t], pairs[r][t]);
                pairs[r][t] = Simd::set1(0);
              }
        }
      }
      for (int r = 0; r < kRows; ++r)
        for (int t = 0; t < kTiles; ++t) {
          block[r][t] = Simd::fmadd(Simd::to_float(dots[r][t]), scale[t], block[r][t]);
          if constexpr (Codes::kMinsForm)
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

// Every row of x in blocks of four, then two, then one: each(Rows<n>(), row0) for each.
template <int kRows>
using Rows = std::integral_constant<int, kRows>;

template <class Each>
void row_blocks(int64_t rows, Each each) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) each(Rows<4>(), r);
  for (; r + 2 <= rows; r += 2) each(Rows<2>(), r);
  for (; r < rows; ++r) each(Rows<1>(), r);
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

// Few rows: each block of rows meets the tiles' codes as they are stored, all of k at once.
template <int kTiles, class Codes>
void tile_rows_direct(const Codes& codes, const ls_tiled_weight& w, const Int8Rows& xq, int64_t rows, int64_t tile0,
                      const Output& out) {
  float total[4 * kTiles * kLanes];
  // The common group sizes as constants: a decode step is mostly this loop.
  auto with_group = [&](auto group) {
    row_blocks(rows, [&](auto block_rows, int64_t row0) {
      constexpr int kRows = decltype(block_rows)::value;
      std::fill(total, total + kRows * kTiles * kLanes, 0.0f);
      add_x_blocks<kRows, kTiles, Codes, decltype(group)::value>(codes, w, xq, row0, 0, w.k / w.x_block, total);
      write_rows<kTiles>(w, total, row0, kRows, tile0, out);
    });
  };
  if (w.group == 32)
    with_group(std::integral_constant<int, 32>());
  else if (w.group == 16)
    with_group(std::integral_constant<int, 16>());
  else
    with_group(std::integral_constant<int, 0>());
}

// Many rows: panel by panel, every row meets the panel's widened codes.
template <int kTiles, bool kMins, class Codes>
void tile_rows_by_panel(const Codes& codes, const ls_tiled_weight& w, const Int8Rows& xq, int64_t rows,
                        int64_t tile0, const Output& out) {
  std::vector<float> total(rows * kTiles * kLanes, 0.0f);
  Panel<kTiles> buffer;
  PanelCodes<kTiles, kMins, Codes::kMaxCode> panel{&buffer};
  for (int64_t x0 = 0; x0 < w.k; x0 += kPanel) {
    const int64_t length = std::min(kPanel, w.k - x0);
    panel.fill(codes, x0, length, w.group);
    row_blocks(rows, [&](auto block_rows, int64_t row0) {
      constexpr int kRows = decltype(block_rows)::value;
      add_x_blocks<kRows, kTiles>(panel, w, xq, row0, x0 / w.x_block, (x0 + length) / w.x_block,
                                  total.data() + row0 * kTiles * kLanes);
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
  if (kTwoLevel && rows >= kPanelRows)
    tile_rows_by_panel<kTiles, kMins>(codes, w, xq, rows, tile0, out);
  else
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

// A weight's work splits into tasks: pairs of tiles, then a last odd tile alone.
int64_t tile_tasks(const ls_tiled_weight& w) {
  const int64_t tiles = (w.n + kLanes - 1) / kLanes;
  return tiles / 2 + tiles % 2;
}

void run_tile_task(const TileKernels& kernels, const ls_tiled_weight& w, const Int8Rows& xq, int64_t rows,
                   int64_t task, const Output& out) {
  const int64_t tiles = (w.n + kLanes - 1) / kLanes;
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
      s.task_start[i + 1] = s.task_start[i] + (jobs[i].rows > 0 ? tile_tasks(w) : 0);
    }
    s.forms.resize(used);
  }
  const int64_t forms = static_cast<int64_t>(s.forms.size());
#pragma omp for schedule(static)
  for (int64_t i = 0; i < forms * x_rows; ++i) quantize_buffer_row(x, i % x_rows, s.forms[i / x_rows]);
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
