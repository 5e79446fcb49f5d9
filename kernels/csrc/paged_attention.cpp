// Paged attention on the CPU: each new row attends to its cached keys and values where
// they lie, block by block, with no gather into a contiguous copy.
//
// Work is split over (sequence, KV head, row) triples. The query heads that share a KV
// head (GQA) go together, so each cached key and value vector is read once for them: the
// keys give every such head its scores, a softmax (max-subtracted, in fp32) turns them
// into weights, and the values are summed with them. A row at position p is computed
// exactly as a decode at sequence length p + 1 would be, whatever else is in the batch and
// however the prompt was split into chunks.
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
// same values torch's .float() gives), so the arithmetic after the load is the same for all.
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

// q . k over dim values: in vector lanes (a fixed order: lanes, then their reduction), or
// one by one where dim is not a multiple of the lanes.
template <typename Kv>
float dot_vectors(const float* q, const typename Kv::T* k, int64_t dim) {
  Simd::F a = Simd::zerof(), b = Simd::zerof();
  int64_t d = 0;
  for (; d + 2 * Simd::kLanes <= dim; d += 2 * Simd::kLanes) {
    a = Simd::fmadd(Simd::loadf(q + d), Kv::load(k + d), a);
    b = Simd::fmadd(Simd::loadf(q + d + Simd::kLanes), Kv::load(k + d + Simd::kLanes), b);
  }
  if (d < dim) a = Simd::fmadd(Simd::loadf(q + d), Kv::load(k + d), a);
  return Simd::reduce(Simd::add(a, b));
}

template <typename Kv>
float dot_scalar(const float* q, const typename Kv::T* k, int64_t dim) {
  float dot = 0.0f;
  for (int64_t d = 0; d < dim; ++d) dot += q[d] * Kv::get(k[d]);
  return dot;
}

// acc += p * v
template <typename Kv>
void axpy_vectors(float p, const typename Kv::T* v, float* acc, int64_t dim) {
  const Simd::F weight = Simd::set1f(p);
  for (int64_t d = 0; d < dim; d += Simd::kLanes)
    Simd::storef(acc + d, Simd::fmadd(weight, Kv::load(v + d), Simd::loadf(acc + d)));
}

template <typename Kv>
void axpy_scalar(float p, const typename Kv::T* v, float* acc, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += p * Kv::get(v[d]);
}

constexpr int64_t kPrefetch = 8;

void prefetch(const void* row, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(row) + at);
}

template <typename Kv>
void attend(const float* query, int64_t tokens, int64_t heads, int64_t dim, const typename Kv::T* k_cache,
            const typename Kv::T* v_cache, int64_t block_size, int64_t kv_heads, const int32_t* block_tables,
            int64_t max_blocks, float scale, int64_t window, float softcap, const float* sinks, float* out,
            AttentionScratch& scratch) {
  const int64_t group = heads / kv_heads, token_stride = kv_heads * dim, block_stride = block_size * token_stride;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(typename Kv::T));
  const std::vector<int64_t>&row_seq = scratch.row_seq, &row_pos = scratch.row_pos;
  const int thread = omp_get_thread_num();
  std::vector<float>& scores = scratch.per_thread[thread].scores;
  std::vector<float>& acc = scratch.per_thread[thread].acc;
  acc.resize(group * dim);
  const bool vectors = dim % Simd::kLanes == 0;
#pragma omp for schedule(dynamic)
  for (int64_t item = 0; item < tokens * kv_heads; ++item) {
    const int64_t row = item / kv_heads, kvh = item % kv_heads, b = row_seq[row];
    // Keys first..position: all of them, or the last `window` under a sliding window.
    const int64_t first = window > 0 ? std::max<int64_t>(0, row_pos[row] + 1 - window) : 0;
    const int64_t len = row_pos[row] + 1 - first;
    const int32_t* table = block_tables + b * max_blocks;
    const float* qg = query + (row * heads + kvh * group) * dim;  // this KV head's query heads
    scores.resize(group * len);
    // Positions lie a token's K/V row apart (all heads), often in another page: too far
    // apart for the hardware prefetchers, so rows a few positions ahead are asked for.
    auto key_at = [&](int64_t pos) {
      return k_cache + table[pos / block_size] * block_stride + (pos % block_size) * token_stride + kvh * dim;
    };
    auto value_at = [&](int64_t pos) {
      return v_cache + table[pos / block_size] * block_stride + (pos % block_size) * token_stride + kvh * dim;
    };
    for (int64_t t = 0; t < len; ++t) {
      const int64_t pos = first + t;
      if (t + kPrefetch < len) prefetch(key_at(pos + kPrefetch), row_bytes);
      const typename Kv::T* k = key_at(pos);
      for (int64_t g = 0; g < group; ++g) {
        const float dot = vectors ? dot_vectors<Kv>(qg + g * dim, k, dim) : dot_scalar<Kv>(qg + g * dim, k, dim);
        const float scaled = dot * scale;
        scores[g * len + t] = softcap > 0.0f ? softcap * std::tanh(scaled / softcap) : scaled;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores.data() + g * len;
      // A sink is one more logit in the softmax, with no value to weigh.
      const float sink = sinks != nullptr ? sinks[kvh * group + g] : -INFINITY;
      const float peak = std::max(*std::max_element(s, s + len), sink);
      float total = sinks != nullptr ? std::exp(sink - peak) : 0.0f;
      for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - peak));
      const float inverse = 1.0f / total;
      for (int64_t t = 0; t < len; ++t) s[t] *= inverse;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t t = 0; t < len; ++t) {
      const int64_t pos = first + t;
      if (t + kPrefetch < len) prefetch(value_at(pos + kPrefetch), row_bytes);
      const typename Kv::T* v = value_at(pos);
      for (int64_t g = 0; g < group; ++g) {
        if (vectors)
          axpy_vectors<Kv>(scores[g * len + t], v, acc.data() + g * dim, dim);
        else
          axpy_scalar<Kv>(scores[g * len + t], v, acc.data() + g * dim, dim);
      }
    }
    std::copy(acc.begin(), acc.end(), out + (row * heads + kvh * group) * dim);
  }
}

}  // namespace

void paged_attention_team(const float* query, int64_t tokens, int64_t heads, int64_t dim, const void* k_cache,
                          const void* v_cache, int32_t kv_type, int64_t block_size, int64_t kv_heads,
                          const int32_t* block_tables, int64_t max_blocks, const int32_t* query_start,
                          const int32_t* seq_lens, int64_t batch, float scale, int64_t window, float softcap,
                          const float* sinks, float* out, AttentionScratch& scratch) {
  std::vector<int64_t>&row_seq = scratch.row_seq, &row_pos = scratch.row_pos;
#pragma omp single
  {
    // Every row's (sequence, position), so the work splits evenly over rows, not sequences.
    row_seq.resize(tokens);
    row_pos.resize(tokens);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t start = query_start[b], rows = query_start[b + 1] - start;
      for (int64_t i = 0; i < rows; ++i) {
        row_seq[start + i] = b;
        row_pos[start + i] = seq_lens[b] - rows + i;
      }
    }
    scratch.per_thread.resize(omp_get_num_threads());
  }
  switch (kv_type) {
    case LS_KV_F16:
      attend<F16Kv>(query, tokens, heads, dim, static_cast<const uint16_t*>(k_cache),
                    static_cast<const uint16_t*>(v_cache), block_size, kv_heads, block_tables, max_blocks, scale,
                    window, softcap, sinks, out, scratch);
      break;
    case LS_KV_BF16:
      attend<BF16Kv>(query, tokens, heads, dim, static_cast<const uint16_t*>(k_cache),
                     static_cast<const uint16_t*>(v_cache), block_size, kv_heads, block_tables, max_blocks, scale,
                     window, softcap, sinks, out, scratch);
      break;
    default:
      attend<F32Kv>(query, tokens, heads, dim, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache),
                    block_size, kv_heads, block_tables, max_blocks, scale, window, softcap, sinks, out, scratch);
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
