// Paged decode attention on the CPU: one new token per sequence attends to its cached keys
// and values where they lie, block by block, with no gather into a contiguous copy.
//
// Work is split over (sequence, KV head) pairs. The query heads that share a KV head (GQA)
// are processed together, so each cached key and value vector is read once: the keys give
// every such head its scores, a softmax (max-subtracted, in fp32) turns them into weights,
// and the values are summed with them.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// query [B, H, D], k_cache/v_cache [blocks, block_size, KVH, D] (fp32, contiguous),
// block_tables [B, max_blocks] int32, seq_lens [B] int32 (>= 1). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(),
              "query: contiguous fp32 [batch, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "caches: contiguous fp32 [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "block tables and sequence lengths: contiguous int32");
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head_dim or head counts do not match");
  TORCH_CHECK(block_tables.size(0) == batch && seq_lens.size(0) == batch, "one table and length per sequence");
  const int64_t max_blocks = block_tables.size(1), group = heads / kv_heads;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && (lens[b] + block_size - 1) / block_size <= max_blocks, "bad sequence length");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < num_blocks, "bad block id");
  }

  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* keys = k_cache.data_ptr<float>();
  const float* values = v_cache.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float softmax_scale = static_cast<float>(scale);
  const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;

#pragma omp parallel
  {
    std::vector<float> scores, acc(group * dim);
#pragma omp for schedule(dynamic)
    for (int64_t pair = 0; pair < batch * kv_heads; ++pair) {
      const int64_t b = pair / kv_heads, kvh = pair % kv_heads, len = lens[b];
      const float* qg = q + (b * heads + kvh * group) * dim;  // this KV head's query heads
      scores.assign(group * len, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const float* k = keys + tables[b * max_blocks + t / block_size] * block_stride +
                         (t % block_size) * token_stride + kvh * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = qg + g * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * k[d];
          scores[g * len + t] = dot * softmax_scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float peak = *std::max_element(s, s + len);
        float total = 0.0f;
        for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - peak));
        const float inverse = 1.0f / total;
        for (int64_t t = 0; t < len; ++t) s[t] *= inverse;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const float* v = values + tables[b * max_blocks + t / block_size] * block_stride +
                         (t % block_size) * token_stride + kvh * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * v[d];
        }
      }
      std::copy(acc.begin(), acc.end(), o + (b * heads + kvh * group) * dim);
    }
  }
  return out;
}
