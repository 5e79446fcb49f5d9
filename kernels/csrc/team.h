// Kernels as steps of a larger parallel region ("team" functions), so that a whole
// decoder stack runs in one region with barriers between its steps instead of a fork and
// join per matmul (decoder_layers.cpp).
//
// Every thread of the enclosing OpenMP team calls a team function with the same
// arguments; the work is shared with orphaned `omp for` / `omp single` constructs and the
// call ends at their barrier, so the next step sees all of its output. Called outside a
// parallel region, the same function runs on the calling thread alone. The exported
// kernels (api.h) are each one parallel region around one team function.
#pragma once

#include <cstdint>
#include <vector>

#include "api.h"

namespace ls {

// Where a matmul writes: row r, output n at data[r * stride + n].
struct Output {
  float* data;
  int64_t stride;
};

// x rounded to int8 for one rounding form (k, x_block, group), all rows of a call.
struct Int8Buffer {
  int64_t k = 0, x_block = 0, group = 0;
  int64_t span = 0;  // inputs rounded as one work item: whole x blocks and groups
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> q_sum;
  std::vector<float> q_sum_f;
};

// One weight's share of an int8 matmul: rows [row0, row0 + rows) of the call's x through
// w, written to out's rows [0, rows).
struct MatmulJob {
  const ls_tiled_weight* w;
  int64_t row0, rows;
  Output out;
};

// What an int8 matmul keeps between its steps; reused across calls so that a decode
// step allocates nothing.
struct Int8Scratch {
  std::vector<Int8Buffer> forms;     // the distinct rounding forms of the call's weights
  std::vector<int32_t> job_form;     // each job's form
  std::vector<int64_t> task_start;   // each job's first tile task, then the total
};

// The jobs' matmuls, all reading x [x_rows, k] (one k for every job): x is rounded once
// per distinct form, then every job's tile tasks are shared out at once. Each output
// element is the same bits as ls_int8_matmul gives for its row alone.
void int8_matmul_team(const MatmulJob* jobs, int64_t count, const float* x, int64_t x_rows, Int8Scratch& scratch);

// out = x [rows, k] @ w [n, k].T for a dense fp32 weight (ls_dense_matmul's sums).
void dense_matmul_team(const float* w, int64_t n, int64_t k, const float* x, int64_t rows, const Output& out);

// One item of ls_paged_attention's work: rows [first_row, first_row + rows) of sequence seq
// (positions from position0 on), for the query heads of KV heads kv_head..kv_head + kv_count.
struct AttentionItem {
  int64_t seq, kv_head, kv_count, first_row, rows, position0;
};
// ls_paged_attention's work list (shared) and each thread's tiles.
struct AttentionScratch {
  struct Thread {
    std::vector<float> keys, keys_t, values, scores, out, peak, total, rescale;
    std::vector<const float*> queries;
  };
  std::vector<AttentionItem> items;
  std::vector<Thread> per_thread;  // by thread number
};
void paged_attention_team(const float* query, int64_t tokens, int64_t heads, int64_t dim, const void* k_cache,
                          const void* v_cache, int32_t kv_type, int64_t block_size, int64_t kv_heads,
                          const int32_t* block_tables, int64_t max_blocks, const int32_t* query_start,
                          const int32_t* seq_lens, int64_t batch, float scale, int64_t window, float softcap,
                          const float* sinks, float* out, AttentionScratch& scratch);

}  // namespace ls
