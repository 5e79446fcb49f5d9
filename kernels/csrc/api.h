// The C interface of localserve's CPU kernels: plain pointers and sizes, no torch.
//
// The same sources are compiled once per instruction set (AVX-512 with VNNI, AVX2, plain
// C++) into libraries of their own when the package is built; localserve.kernels.cpu_library
// loads the best one this CPU runs and calls these functions through ctypes. The callers
// (kernels/*_cpu.py) check every shape before a call: these functions trust their arguments.
#pragma once

#include <cstdint>

// The library is built with hidden visibility; these are its only exported symbols.
#pragma GCC visibility push(default)
extern "C" {

// --- the library -----------------------------------------------------------------------
const char* ls_variant();         // "avx512_vnni", "avx2" or "generic"
int32_t ls_lanes();               // output rows per tile of a TiledWeight
void ls_set_threads(int32_t n);   // OpenMP threads for every kernel

// --- int8-activation matmul over a tiled weight ---------------------------------------
//
// A weight W [n, k] of integer codes u in groups of `group` inputs, tiled for the kernel:
// output rows in tiles of ls_lanes() (the last padded with zero codes), inputs in blocks
// of 32. Element (row, i) of group g is
//     zero form: S_g * (u - zero)          mins form (zero < 0): S_g * u - M_g
// with S_g = super_scales[g / groups_per_super] (fp16), times sub_scales[g] when
// sub_scales is set (the fp32 product), and M_g likewise from super_mins and sub_mins.
// A codebook weight (GGUF's IQ and MXFP4 types: 4-bit codes standing for 16 values) has
// `levels`: the stored code c stands for u = levels[c], each level plus 128, with zero 128,
// and S_g is further multiplied by `level_scale`, so that S_g * (u - zero) is the group's
// scale times the value (the values are the levels times a power of two: IQ2's eighths).
//
// Layouts (T tiles, L lanes, B = k / 32 blocks, G = k / group groups, P = G / groups_per_super):
//   codes         uint8 [T, B, chunk, L, 4]: nibbles (bits <= 6): 4 chunks, byte i of chunk j holds the
//                 low four bits of inputs 8j + i (low nibble) and 8j + 4 + i (high); bytes (8 bits):
//                 8 chunks of inputs 4j + i
//   high          uint8 [T, B, bits - 4, L, 4] for 5 and 6 bits (else null): the codes' top bits.
//                 6 bits: word h, byte i, bits 2j..2j+1 hold input 8j + 4h + i's; 5 bits: one word,
//                 byte i, bit j + 4h holds input 8j + 4h + i's
//   super_scales  fp16  [T, P, L]          sub_scales  int8  [T, G, L] or null
//   super_mins    fp16  [T, P, L] or null  sub_mins    uint8 [T, G, L] or null
struct ls_tiled_weight {
  int64_t n, k;
  int32_t bits;              // 2 to 6: low four bits as nibbles (and a plane for the rest); 8: bytes
  int32_t group;             // 16, or a multiple of 32 dividing x_block
  int32_t groups_per_super;  // 1 for single-level scales; else even, and group * groups_per_super == x_block <= 256
  int32_t zero;              // the constant zero point, or -1 for the mins form
  int32_t x_block;           // inputs per activation scale: 32 or 256 (a multiple of group)
  const uint8_t* codes;
  const uint8_t* high;
  const uint16_t* super_scales;
  const int8_t* sub_scales;
  const uint16_t* super_mins;
  const uint8_t* sub_mins;
  const uint8_t* levels;     // 16 bytes for 4-bit codebook codes (zero 128), or null
  float level_scale;         // what a level is worth (a power of two; 1 without levels)
};

// out [rows, n] = round8(x [rows, k]) @ W.T: each row of x rounded to int8 per x_block
// inputs (q = nearbyint(x / d), d = max|x| / 127), integer dot products per group (times
// the integer sub-scales and summed over a super-block, for two-level scales), then fp32
// scaling in a fixed order per output element. A row's result depends on nothing but
// that row: the same bits whatever else is in the batch.
void ls_int8_matmul(const ls_tiled_weight* w, const float* x, int64_t rows, float* out);

// Grouped rows through weights of one shape and form (a mixture of experts' chosen experts):
// x [rows, k] holds groups of rows one after another, group i's counts[i] rows taken
// through weights[ids[i]] into the same rows of out [rows, n]; each row as ls_int8_matmul
// computes it alone.
void ls_grouped_int8_matmul(const ls_tiled_weight* const* weights, const int64_t* ids, const int64_t* counts,
                            int64_t groups, const float* x, float* out);

// Rows `index[0..count)` of the tiled weight dequantized to fp32, into out [count, k].
void ls_tiled_dequantize_rows(const ls_tiled_weight* w, const int64_t* index, int64_t count, float* out);

// --- fp32-activation matmul over a QuantWeight (GPTQ, AWQ, the exact path) --------------
//
// Factors (scales, offsets, super scales/offsets) are [n, width] arrays of one dtype each.
enum ls_dtype : int32_t { LS_F32 = 0, LS_F16 = 1, LS_U8 = 2, LS_I8 = 3, LS_I16 = 4 };

struct ls_factors {
  const void* data;  // null: absent
  int32_t dtype;     // ls_dtype
  int64_t width;
};

// W [n, k] as QuantWeight stores it (codes of up to 4 bits two per byte, input 2j low);
// offsets are zeros ((u - zero) * scale) or, with mins set, mins (scale * u - min).
struct ls_quant_weight {
  int64_t n, k;
  int32_t bits, group_size, groups_per_super, mins;
  const uint8_t* codes;
  ls_factors scales, offsets, super_scales, super_offsets;
};

// out [rows, n] = x [rows, k] @ W.T with each weight dequantized in registers by the
// reference's fp32 operations; per row the same sums in the same order at any row count.
void ls_float_matmul(const ls_quant_weight* w, const float* x, int64_t rows, float* out);

// --- fp32 matmul over a dense fp32 weight ---------------------------------------------
//
// out [rows, n] = x [rows, k] @ w [n, k].T, each element summed in the same order at any
// row count (unlike a BLAS GEMM, whose blocking and kernel follow the shapes).
void ls_dense_matmul(const float* w, int64_t n, int64_t k, const float* x, int64_t rows, float* out);

// --- a stack of dense decoder layers in one call (decoder_layers.cpp) ----------------------
//
// One projection: up to four weights side by side (a fused Q/K/V whose parts differ in
// type, as llama.cpp's mixes make them), each a tiled weight or a dense fp32 one [n_i, k],
// their outputs concatenated; bias [sum n_i] or null.
struct ls_linear {
  int32_t parts;
  const ls_tiled_weight* tiled[4];
  const float* dense[4];
  int64_t n[4];
  const float* bias;
};

// A mixture of experts in a layer's MLP's place (Mixtral, Qwen3-MoE, OLMoE): logits =
// router(h); per row a softmax over all experts in fp32, the top_k largest (the lower expert
// first among equals), rescaled to sum to 1 when renormalize; then each chosen expert's
// SwiGLU MLP, down_e(silu(gate_e(h)) * up_e(h)), and the row's output the sum in fp32 of
// gate times output over its experts in the order of their ids (as the torch path's
// index_add over pairs sorted by expert). Experts are tiled weights, one per expert:
// gate_up[e] [2 * intermediate, hidden] (gate rows, then up rows), down[e] [hidden, intermediate].
struct ls_moe {
  ls_linear router;  // [experts, hidden]
  int64_t experts, top_k, intermediate;
  int32_t renormalize;
  const ls_tiled_weight* const* gate_up;
  const ls_tiled_weight* const* down;
};

// One pre-norm decoder layer of the Llama family (RMS norms with fp32 gains, any offset
// folded in; null norms are absent):
//   h = norm(x); q, k, v = qkv(h); per-head norms of q and k; rotary on q and k; k and v
//   written to the cache; a = attention(q); x += residual_scale * attn_out_norm(o(a));
//   h = pre_mlp_norm(x); gate, up = gate_up(h); x += residual_scale * mlp_out_norm(down(act(gate) * up))
// or, with moe set, x += residual_scale * mlp_out_norm(moe(h)) (gate_up and down unused).
struct ls_decoder_layer {
  const float* input_norm;
  ls_linear qkv;
  const float* q_norm;  // [head_dim], or null
  const float* k_norm;
  ls_linear o;
  const float* attn_out_norm;
  const float* pre_mlp_norm;
  ls_linear gate_up;
  ls_linear down;
  const float* mlp_out_norm;
  void* k_cache;  // [blocks, block_size, kv_heads, head_dim] of kv_type
  void* v_cache;
  int32_t kv_type;
  float scale;
  int64_t window;
  float softcap;
  const float* sinks;
  int32_t rope;        // which of the batch's rotary tables
  int32_t activation;  // 0: SiLU, 1: GELU with the tanh approximation
  float residual_scale;
  const ls_moe* moe;   // null: the dense MLP
};

// intermediate: the dense MLPs' width (0 when every layer is a mixture of experts).
struct ls_decoder_shape {
  int64_t hidden, heads, kv_heads, head_dim, rotary_dim, intermediate;
  float eps;
};

// The batch as ls_paged_attention takes it, with each row's cache slot (negative: not
// written) and cos/sin [tokens, rotary_dim] of up to two rotary tables (the first
// rotary_dim / 2 values repeated for the second half, as the torch model keeps them).
struct ls_decoder_batch {
  int64_t tokens;
  const float* cos[2];
  const float* sin[2];
  const int64_t* slot_mapping;
  int64_t block_size;
  const int32_t* block_tables;
  int64_t max_blocks;
  const int32_t* query_start;
  const int32_t* seq_lens;
  int64_t batch;
};

// x [tokens, hidden] through `count` layers in place, in one parallel region, then through
// the model's final RMS norm (final_norm: its gain; null: x is left the residual stream).
// Every step works row by row (the matmuls as ls_int8_matmul / ls_dense_matmul compute
// them): a row's result depends on nothing but that row and its cache.
void ls_decoder_layers(const ls_decoder_shape* shape, const ls_decoder_layer* layers, int64_t count,
                       const ls_decoder_batch* batch, const float* final_norm, float* x);

// Profiling (benchmarks/decode_profile.py): while on, the seconds each kind of step takes
// are summed over calls. Copies the sums into seconds [LS_DECODER_STEPS] (unless null),
// clears them, then turns profiling on or off.
enum ls_decoder_step : int32_t {
  LS_STEP_QKV = 0, LS_STEP_ROTARY_KV, LS_STEP_ATTENTION, LS_STEP_O, LS_STEP_GATE_UP, LS_STEP_DOWN, LS_STEP_GLUE,
  LS_STEP_EXPERTS, LS_DECODER_STEPS
};
void ls_decoder_profile(int32_t enable, double* seconds);

// --- paged attention --------------------------------------------------------------------
//
// query [tokens, heads, dim] holds each sequence's new rows; row i of sequence b (rows
// query_start[b]..query_start[b+1]) sits at position seq_lens[b] - query_len + i and
// attends causally to the cached keys 0..position. Caches [blocks, block_size, kv_heads,
// dim] of kv_type (fp16 and bf16 are widened to fp32 as they are read; the arithmetic is
// fp32), block_tables [batch, max_blocks] int32. Each row is computed exactly as a
// decode of its position would be: the same bits however the prompt was chunked. With
// window > 0 a row sees only the last `window` keys up to its position (sliding window).
// With softcap > 0 each scaled score s becomes softcap * tanh(s / softcap); sinks (null, or
// one logit per query head) add a value-less column to every row's softmax.
enum ls_kv_type : int32_t { LS_KV_F32 = 0, LS_KV_F16 = 1, LS_KV_BF16 = 2 };
void ls_paged_attention(const float* query, int64_t tokens, int64_t heads, int64_t dim, const void* k_cache,
                        const void* v_cache, int32_t kv_type, int64_t block_size, int64_t kv_heads,
                        const int32_t* block_tables, int64_t max_blocks, const int32_t* query_start,
                        const int32_t* seq_lens, int64_t batch, float scale, int64_t window, float softcap,
                        const float* sinks, float* out);

// --- sampling (sampling.cpp; localserve/engine/sampler.py has the meaning) --------------
//
// out[r]: the first index of row r's largest logit (a NaN counts as largest), as torch.argmax.
void ls_argmax_rows(const float* logits, int64_t rows, int64_t vocab, int64_t* out);
// out[r]: row r's token drawn from softmax(logits / temperature[r]) restricted to its top_k[r]
// largest (0 or >= vocab: all; ties at the edge kept), without the tokens under min_p[r] times
// the best one's probability, with top_p[r] by rejection: a drawn token is kept while the
// probability of the tokens more likely than it is below top_p; else it and every token as
// likely or less are dropped and the row's next uniform draws again. uniforms [rows, count]
// in [0, 1); -1 where a row's count uniforms were not enough (call again with more).
void ls_sample_rows(const float* logits, int64_t rows, int64_t vocab, const float* temperature, const int64_t* top_k,
                    const float* top_p, const float* min_p, const float* uniforms, int64_t count, int64_t* out);
}
#pragma GCC visibility pop
