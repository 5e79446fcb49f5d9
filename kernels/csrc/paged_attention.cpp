// Paged attention on the CPU: each new row attends to its cached keys and values where
// they lie, block by block, with no gather into a contiguous copy.
//
// Flash attention's order of work, in tiles: an item of work is up to kQueryVectors / group
// consecutive rows of one sequence (times the `group` query heads that share a KV head, GQA)
// and one or more of its KV heads. For each KV head, the item walks the keys kKeys at a time:
// the tile's keys and values are widened to fp32 once (keys transposed, so a query meets
// kKeys keys in one vector step), every query vector of the head scores them, an online
// softmax (a running maximum and sum per query, in fp32) weighs them, and the weighted values
// are added to the query's output. A prompt's rows thus share each key and value read, and
// each step is a vector operation.
//
// A row's result is the same bits whatever shares its item or its step: a row meets the
// tiles of absolute positions (0-15, 16-31, ...) from its first key to itself, each lane
// of a score or an output is computed with the same operations in the same order whichever
// query vectors are beside it, keys outside the row's range get a weight of exactly 0, and
// tiles past its position are skipped. So a prompt's row is computed exactly as a decode at
// its position, however the prompt was chunked.
#include <algorithm>
#include <cmath>
#include <vector>

#include "api.h"
#include "runtime.h"
#include "simd.h"
#include "team.h"

#include <omp.h>

namespace ls {
namespace {

// How a cache element is read: fp32 as is, fp16 and bf16 widened to fp32 in registers (the
// same values torch's .float() gives).
struct F32Kv {
  using T = float;
  static Simd::F load(const T* p) { return Simd::loadf(p); }
  static float get(T x) { return x; }
};
struct F16Kv {
  using T = uint16_t;
  static Simd::F load(const T* p) { return Simd::load_half(p); }
  static float get(T x) { return half_to_float(x); }
};
struct BF16Kv {
  using T = uint16_t;
  static Simd::F load(const T* p) { return Simd::load_bf16(p); }
  static float get(T x) { return bf16_to_float(x); }
};

constexpr int64_t kLanes = Simd::kLanes;
constexpr int64_t kKeys = 16;  // keys per tile: one or two vectors of scores
constexpr int64_t kScoreVectors = kKeys / kLanes;
static_assert(kKeys % kLanes == 0, "a tile's scores fill whole vectors");
constexpr int64_t kQueryVectors = 64;  // per item: rows times the KV head's query heads

void prefetch(const void* row, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(row) + at);
}

// One cache row (dim elements) widened into dst, zero from dim up to padded.
template <typename Kv>
void widen_row(const typename Kv::T* src, float* dst, int64_t dim, int64_t padded) {
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) Simd::storef(dst + d, Kv::load(src + d));
  for (; d < dim; ++d) dst[d] = Kv::get(src[d]);
  for (; d < padded; ++d) dst[d] = 0.0f;
}

// keys (kKeys rows of padded floats) -> keys_t (padded rows of kKeys floats).
void transpose_keys(const float* keys, int64_t padded, float* keys_t) {
#if defined(LS_AVX2) || defined(LS_AVX512)
  if (padded % 8 == 0) {  // 8 x 8 blocks in registers
    for (int64_t j = 0; j < kKeys; j += 8) {
      for (int64_t d = 0; d < padded; d += 8) {
        __m256 r[8], t[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(keys + (j + i) * padded + d);
        for (int i = 0; i < 8; i += 2) {
          t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
          t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
          r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
          r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
          r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
          r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
        }
        // Now r[i] (i < 4) holds column i of rows 0-3 in its low half and column i + 4 of
        // rows 0-3 in its high half; r[i + 4] the same of rows 4-7.
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_ps(keys_t + (d + i) * kKeys + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
          _mm256_storeu_ps(keys_t + (d + i + 4) * kKeys + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
        }
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < kKeys; ++j)
    for (int64_t d = 0; d < padded; ++d) keys_t[d * kKeys + j] = keys[j * padded + d];
}

// scores[q][0..kKeys) = scale * (query q . each key of the tile), for kQ query vectors:
// each lane a chain of fused multiply-adds over d in order, whatever kQ is.
template <int kQ>
void score_tile(const float* const* queries, const float* keys_t, int64_t dim, float scale, float* scores) {
  Simd::F acc[kQ][kScoreVectors];
  for (auto& row : acc)
    for (auto& v : row) v = Simd::zerof();
  for (int64_t d = 0; d < dim; ++d) {
    Simd::F k[kScoreVectors];
    for (int64_t v = 0; v < kScoreVectors; ++v) k[v] = Simd::loadf(keys_t + d * kKeys + v * kLanes);
    for (int q = 0; q < kQ; ++q) {
      const Simd::F x = Simd::set1f(queries[q][d]);
      for (int64_t v = 0; v < kScoreVectors; ++v) acc[q][v] = Simd::fmadd(x, k[v], acc[q][v]);
    }
  }
  const Simd::F s = Simd::set1f(scale);
  for (int q = 0; q < kQ; ++q)
    for (int64_t v = 0; v < kScoreVectors; ++v) Simd::storef(scores + q * kKeys + v * kLanes, Simd::mul(acc[q][v], s));
}

// out[q] = out[q] * rescale[q] + sum over the tile's keys t of weights[q][t] * values[t], for
// kQ query vectors, kChunks vectors of the output at a time (each weight is broadcast once
// for them): each lane's chain over t in order, whatever kQ and kChunks are.
template <int kQ, int kChunks>
void add_value_chunks(const float* weights, const float* rescale, const float* values, int64_t padded, int64_t d,
                      float* out) {
  Simd::F acc[kQ][kChunks];
  for (int q = 0; q < kQ; ++q)
    for (int c = 0; c < kChunks; ++c)
      acc[q][c] = Simd::mul(Simd::loadf(out + q * padded + d + c * kLanes), Simd::set1f(rescale[q]));
  for (int64_t t = 0; t < kKeys; ++t) {
    Simd::F v[kChunks];
    for (int c = 0; c < kChunks; ++c) v[c] = Simd::loadf(values + t * padded + d + c * kLanes);
    for (int q = 0; q < kQ; ++q) {
      const Simd::F weight = Simd::set1f(weights[q * kKeys + t]);
      for (int c = 0; c < kChunks; ++c) acc[q][c] = Simd::fmadd(weight, v[c], acc[q][c]);
    }
  }
  for (int q = 0; q < kQ; ++q)
    for (int c = 0; c < kChunks; ++c) Simd::storef(out + q * padded + d + c * kLanes, acc[q][c]);
}

template <int kQ>
void add_values(const float* weights, const float* rescale, const float* values, int64_t padded, float* out) {
  int64_t d = 0;
  for (; d + 2 * kLanes <= padded; d += 2 * kLanes) add_value_chunks<kQ, 2>(weights, rescale, values, padded, d, out);
  if (d < padded) add_value_chunks<kQ, 1>(weights, rescale, values, padded, d, out);
}

// Where a row's keys lie: positions first..position of its sequence (the last `window`
// under a sliding window).
struct Keys {
  const int32_t* table;
  int64_t block_size, block_stride, token_stride, window;
  int64_t first(int64_t position) const { return window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0; }
  int64_t slot(int64_t position, int64_t kv_offset) const {
    return table[position / block_size] * block_stride + (position % block_size) * token_stride + kv_offset;
  }
};

// The tile's keys and values of one KV head, widened: positions begin..end of the tile that
// starts at `tile`; the rest zero (their weights are 0).
template <typename Kv>
void load_tile(const Keys& keys, int64_t tile, int64_t begin, int64_t end, int64_t stop, int64_t kv_offset, int64_t dim,
               int64_t padded, const typename Kv::T* k_cache, const typename Kv::T* v_cache, AttentionScratch::Thread& t) {
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(typename Kv::T));
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t pos = tile + j;
    float* key = t.keys.data() + j * padded;
    float* value = t.values.data() + j * padded;
    if (pos < begin || pos >= end) {
      std::fill(key, key + padded, 0.0f);
      std::fill(value, value + padded, 0.0f);
      continue;
    }
    // The same head's rows a tile ahead (up to `stop`, the item's last key) are asked for
    // now, one position at a time: a position's rows lie a token's K/V row apart, often in
    // another page, too far apart for the hardware prefetchers.
    if (pos + kKeys < stop) {
      prefetch(k_cache + keys.slot(pos + kKeys, kv_offset), row_bytes);
      prefetch(v_cache + keys.slot(pos + kKeys, kv_offset), row_bytes);
    }
    widen_row<Kv>(k_cache + keys.slot(pos, kv_offset), key, dim, padded);
    widen_row<Kv>(v_cache + keys.slot(pos, kv_offset), value, dim, padded);
  }
  transpose_keys(t.keys.data(), padded, t.keys_t.data());
}

// The online softmax over one tile for one query vector: scores s become weights (keys
// outside from..to weigh exactly 0), and its running peak, total and this tile's rescale
// of what came before are updated.
void weigh_tile(float* s, int64_t from, int64_t to, float softcap, float& peak, float& total, float& rescale) {
  if (softcap > 0.0f)
    for (int64_t j = from; j < to; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
  std::fill(s, s + from, -INFINITY);
  std::fill(s + to, s + kKeys, -INFINITY);
  Simd::F lanes[kScoreVectors];
  for (int64_t i = 0; i < kScoreVectors; ++i) lanes[i] = Simd::loadf(s + i * kLanes);
  Simd::F largest = lanes[0];
  for (int64_t i = 1; i < kScoreVectors; ++i) largest = Simd::maxf(largest, lanes[i]);
  const float new_peak = std::max(peak, Simd::reduce_max(largest));
  const Simd::F shift = Simd::set1f(new_peak), one = Simd::set1f(1.0f);
  Simd::F sum = Simd::zerof();
  for (int64_t i = 0; i < kScoreVectors; ++i) {
    const Simd::F weight = Simd::exp(Simd::fnmadd(one, shift, lanes[i]));  // s - peak, rounded once
    Simd::storef(s + i * kLanes, weight);
    sum = Simd::add(sum, weight);
  }
  rescale = std::exp(peak - new_peak);  // 0 at a query's first tile (its peak was -inf)
  total = total * rescale + Simd::reduce(sum);
  peak = new_peak;
}

// One item: rows [first_row, first_row + rows) of sequence seq (consecutive positions from
// position0), the query heads of KV heads kv_head..kv_head + kv_count. Its state is kept
// per query vector v = (KV head, row, query head in the group), in that order.
template <typename Kv>
void attend_item(const AttentionItem& item, const float* query, int64_t heads, int64_t dim, int64_t kv_heads,
                 const typename Kv::T* k_cache, const typename Kv::T* v_cache, int64_t block_size,
                 const int32_t* block_tables, int64_t max_blocks, float scale, int64_t window, float softcap,
                 const float* sinks, float* out, AttentionScratch::Thread& t) {
  const int64_t group = heads / kv_heads, token_stride = kv_heads * dim;
  const Keys keys{block_tables + item.seq * max_blocks, block_size, block_size * token_stride, token_stride, window};
  const int64_t padded = (dim + kLanes - 1) / kLanes * kLanes, per_head = item.rows * group;
  const int64_t vectors = per_head * item.kv_count;
  t.keys.resize(kKeys * padded);
  t.keys_t.resize(kKeys * padded);
  t.values.resize(kKeys * padded);
  t.scores.resize(per_head * kKeys);
  t.out.assign(vectors * padded, 0.0f);
  t.peak.assign(vectors, -INFINITY);
  t.total.assign(vectors, 0.0f);
  t.rescale.resize(vectors);
  t.queries.resize(vectors);
  // Query vector v's (row, head) in the step's [rows, heads] layout, which the output shares.
  auto row_head = [&](int64_t v) {
    return (item.first_row + v % per_head / group) * heads + (item.kv_head + v / per_head) * group + v % group;
  };
  for (int64_t v = 0; v < vectors; ++v) t.queries[v] = query + row_head(v) * dim;

  const int64_t last = item.position0 + item.rows - 1, lo = keys.first(item.position0);
  for (int64_t tile = lo / kKeys * kKeys; tile <= last; tile += kKeys) {
    const int64_t begin = std::max(lo, tile), end = std::min(last + 1, tile + kKeys);
    // KV heads inner: a position's rows of the item's heads lie side by side in the cache.
    for (int64_t head = 0; head < item.kv_count; ++head) {
      load_tile<Kv>(keys, tile, begin, end, last + 1, (item.kv_head + head) * dim, dim, padded, k_cache, v_cache, t);
      const int64_t v0 = head * per_head;
      const float* const* queries = t.queries.data() + v0;
      float* scores = t.scores.data();
      int64_t q = 0;
      for (; q + 4 <= per_head; q += 4) score_tile<4>(queries + q, t.keys_t.data(), dim, scale, scores + q * kKeys);
      for (; q < per_head; ++q) score_tile<1>(queries + q, t.keys_t.data(), dim, scale, scores + q * kKeys);
      for (int64_t r = 0; r < item.rows; ++r) {
        const int64_t pos = item.position0 + r;
        const int64_t from = std::max(keys.first(pos), tile) - tile, to = std::min(pos + 1, tile + kKeys) - tile;
        for (int64_t i = r * group; i < (r + 1) * group; ++i) {
          float* s = scores + i * kKeys;
          if (from >= to) {  // a tile past this row (or before its window) adds nothing
            t.rescale[v0 + i] = 1.0f;
            std::fill(s, s + kKeys, 0.0f);
          } else {
            weigh_tile(s, from, to, softcap, t.peak[v0 + i], t.total[v0 + i], t.rescale[v0 + i]);
          }
        }
      }
      const float* rescale = t.rescale.data() + v0;
      float* acc = t.out.data() + v0 * padded;
      q = 0;
      for (; q + 4 <= per_head; q += 4)
        add_values<4>(scores + q * kKeys, rescale + q, t.values.data(), padded, acc + q * padded);
      for (; q < per_head; ++q) add_values<1>(scores + q * kKeys, rescale + q, t.values.data(), padded, acc + q * padded);
    }
  }

  for (int64_t v = 0; v < vectors; ++v) {
    float factor = 1.0f, total = t.total[v];
    if (sinks != nullptr) {  // a sink is one more logit in the softmax, with no value to weigh
      const float sink = sinks[row_head(v) % heads], peak = std::max(t.peak[v], sink);
      factor = std::exp(t.peak[v] - peak);
      total = total * factor + std::exp(sink - peak);
    }
    const float weight = factor / total;
    const float* o = t.out.data() + v * padded;
    float* dst = out + row_head(v) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = o[d] * weight;
  }
}

template <typename Kv>
void attend(const float* query, int64_t heads, int64_t dim, const void* k_cache, const void* v_cache,
            int64_t block_size, int64_t kv_heads, const int32_t* block_tables, int64_t max_blocks, float scale,
            int64_t window, float softcap, const float* sinks, float* out, AttentionScratch& scratch) {
  AttentionScratch::Thread& mine = scratch.per_thread[omp_get_thread_num()];
  const auto* keys = static_cast<const typename Kv::T*>(k_cache);
  const auto* values = static_cast<const typename Kv::T*>(v_cache);
  const int64_t items = static_cast<int64_t>(scratch.items.size());
#pragma omp for schedule(dynamic)
  for (int64_t i = 0; i < items; ++i)
    attend_item<Kv>(scratch.items[i], query, heads, dim, kv_heads, keys, values, block_size, block_tables, max_blocks,
                    scale, window, softcap, sinks, out, mine);
}

}  // namespace

void paged_attention_team(const float* query, int64_t /*tokens*/, int64_t heads, int64_t dim, const void* k_cache,
                          const void* v_cache, int32_t kv_type, int64_t block_size, int64_t kv_heads,
                          const int32_t* block_tables, int64_t max_blocks, const int32_t* query_start,
                          const int32_t* seq_lens, int64_t batch, float scale, int64_t window, float softcap,
                          const float* sinks, float* out, AttentionScratch& scratch) {
#pragma omp single
  {
    // Items of up to kQueryVectors rows times query heads, all KV heads (a position's rows
    // of every head lie side by side in the cache); where that leaves fewer than four items
    // a thread (a few decodes), the KV heads are split between items too. How rows and heads
    // are grouped into items does not change any row's result.
    const int64_t group = heads / kv_heads, rows_per_item = std::max<int64_t>(1, kQueryVectors / group);
    int64_t row_tiles = 0;
    for (int64_t b = 0; b < batch; ++b)
      row_tiles += (query_start[b + 1] - query_start[b] + rows_per_item - 1) / rows_per_item;
    const int64_t wanted = static_cast<int64_t>(omp_get_num_threads());
    const int64_t splits = std::clamp<int64_t>((wanted + row_tiles - 1) / std::max<int64_t>(row_tiles, 1), 1, kv_heads);
    const int64_t heads_per_item = (kv_heads + splits - 1) / splits;
    scratch.items.clear();
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t start = query_start[b], rows = query_start[b + 1] - start;
      for (int64_t r = 0; r < rows; r += rows_per_item)
        for (int64_t h = 0; h < kv_heads; h += heads_per_item)
          scratch.items.push_back({b, h, std::min(heads_per_item, kv_heads - h), start + r,
                                   std::min(rows_per_item, rows - r), seq_lens[b] - rows + r});
    }
    scratch.per_thread.resize(omp_get_num_threads());
  }
  switch (kv_type) {
    case LS_KV_F16:
      attend<F16Kv>(query, heads, dim, k_cache, v_cache, block_size, kv_heads, block_tables, max_blocks, scale, window,
                    softcap, sinks, out, scratch);
      break;
    case LS_KV_BF16:
      attend<BF16Kv>(query, heads, dim, k_cache, v_cache, block_size, kv_heads, block_tables, max_blocks, scale, window,
                     softcap, sinks, out, scratch);
      break;
    default:
      attend<F32Kv>(query, heads, dim, k_cache, v_cache, block_size, kv_heads, block_tables, max_blocks, scale, window,
                    softcap, sinks, out, scratch);
  }
}

}  // namespace ls

extern "C" void ls_paged_attention(const float* query, int64_t tokens, int64_t heads, int64_t dim,
                                   const void* k_cache, const void* v_cache, int32_t kv_type, int64_t block_size,
                                   int64_t kv_heads, const int32_t* block_tables, int64_t max_blocks,
                                   const int32_t* query_start, const int32_t* seq_lens, int64_t batch, float scale,
                                   int64_t window, float softcap, const float* sinks, float* out) {
  ls::AttentionScratch scratch;
#pragma omp parallel num_threads(ls::threads())
  ls::paged_attention_team(query, tokens, heads, dim, k_cache, v_cache, kv_type, block_size, kv_heads, block_tables,
                           max_blocks, query_start, seq_lens, batch, scale, window, softcap, sinks, out, scratch);
}
