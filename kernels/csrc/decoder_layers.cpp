// A stack of dense decoder layers in one call: the CPU's forward without Python between
// its steps (see api.h for what a layer computes).
//
// A decode step of a 1B model at one token a step is some 200 small operations per
// token: norms, rotary, cache writes, residual adds, the activation and a dozen matmuls
// a layer. Through torch and ctypes each costs tens of microseconds of dispatch and a
// fork and join of the thread team; here the whole stack is one parallel region whose
// threads meet at a barrier between steps (team.h). Every step is row by row, so a row's
// result depends only on that row and its cache: batch invariance holds as for the
// separate kernels.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <vector>

#include "api.h"
#include "runtime.h"
#include "simd.h"
#include "team.h"

namespace ls {
namespace {

using F = Simd::F;
constexpr int kLanes = Simd::kLanes;

// Seconds spent in each kind of step, summed over calls while profiling is on
// (ls_decoder_profile): read by the team's first thread after each step's barrier.
std::atomic<bool> g_profiling{false};
double g_step_seconds[LS_DECODER_STEPS] = {};

struct StepClock {
  bool on = g_profiling.load(std::memory_order_relaxed);
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();

  void mark(int step) {
    if (!on) return;
#pragma omp master
    {
      const auto now = std::chrono::steady_clock::now();
      g_step_seconds[step] += std::chrono::duration<double>(now - last).count();
      last = now;
    }
  }
};

constexpr int64_t kMaxTopK = 64;  // experts a row may choose (the caller checks)

// A mixture of experts' step: each row's chosen experts and gates, the (row, choice) pairs
// grouped by expert, and the matmul jobs of the chosen experts.
struct MoeScratch {
  std::vector<float> logits, gates, rows, expert_out;
  std::vector<int64_t> experts, order, position, counts, start;
  std::vector<MatmulJob> gate_up_jobs, down_jobs;
};

struct Buffers {
  std::vector<float> h, qkv, q, attention, projected, gate_up, activated;
  Int8Scratch int8;
  AttentionScratch attention_scratch;
  MoeScratch moe;
};

// sum(x^2) in one fixed order: lanes, then the lanes' fixed reduction, then the tail.
float sum_of_squares(const float* x, int64_t n) {
  F acc = Simd::zerof();
  const int64_t end = n - n % Simd::kLanes;
  for (int64_t i = 0; i < end; i += Simd::kLanes) {
    const F v = Simd::loadf(x + i);
    acc = Simd::fmadd(v, v, acc);
  }
  float sum = Simd::reduce(acc);
  for (int64_t i = end; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// out = x / rms(x) * gain (out may be x).
void rms_norm(const float* x, const float* gain, int64_t n, float eps, float* out) {
  const float inverse = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inverse * gain[i];
}

// Rotate one head in place (HF's rotate_half layout): dimensions past rotary_dim pass.
void rotate(float* head, const float* cos, const float* sin, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = head[i], b = head[i + half];
    head[i] = a * cos[i] - b * sin[i];
    head[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// The gated MLP's activation of kLanes gates at a time: SiLU g / (1 + e^-g), or GELU's tanh
// form 0.5 g (1 + tanh(y)) with tanh(y) = 1 - 2 / (e^2y + 1). Vector exp: a step's 8k gates
// a layer through scalar expf cost one thread ~40 us while the other waited.
F activate_lanes(F gate, int32_t activation) {
  const F one = Simd::set1f(1.0f);
  if (activation == 1) {
    const F cube_term = Simd::mul(Simd::set1f(0.044715f), Simd::mul(gate, gate));
    const F inner = Simd::mul(Simd::set1f(0.7978845608028654f), Simd::fmadd(cube_term, gate, gate));
    const F tanh = Simd::sub(one, Simd::div(Simd::set1f(2.0f), Simd::add(Simd::exp(Simd::add(inner, inner)), one)));
    return Simd::mul(Simd::mul(Simd::set1f(0.5f), gate), Simd::add(one, tanh));
  }
  return Simd::div(gate, Simd::add(one, Simd::exp(Simd::sub(Simd::zerof(), gate))));
}

// out[i] = act(gate[i] + gate_bias[i]) * (up[i] + up_bias[i]) for i in [from, to) (biases may
// be null); a last partial vector goes through padded copies, the same arithmetic.
void activate_span(const float* gate, const float* up, const float* gate_bias, const float* up_bias,
                   int32_t activation, int64_t from, int64_t to, float* out) {
  const auto lanes = [&](const float* g, const float* u, const float* gb, const float* ub) {
    F gv = Simd::loadf(g), uv = Simd::loadf(u);
    if (gb != nullptr) gv = Simd::add(gv, Simd::loadf(gb));
    if (ub != nullptr) uv = Simd::add(uv, Simd::loadf(ub));
    return Simd::mul(activate_lanes(gv, activation), uv);
  };
  int64_t i = from;
  for (; i + kLanes <= to; i += kLanes)
    Simd::storef(out + i, lanes(gate + i, up + i, gate_bias ? gate_bias + i : nullptr, up_bias ? up_bias + i : nullptr));
  if (i == to) return;
  const int64_t n = to - i;
  alignas(64) float padded[4][kLanes] = {}, result[kLanes];
  const float* sources[4] = {gate, up, gate_bias, up_bias};
  for (int part = 0; part < 4; ++part)
    if (sources[part] != nullptr) std::copy(sources[part] + i, sources[part] + to, padded[part]);
  Simd::storef(result, lanes(padded[0], padded[1], gate_bias ? padded[2] : nullptr, up_bias ? padded[3] : nullptr));
  std::copy(result, result + n, out + i);
}

// Rows' activations shared out in spans of this many gates: a single decode row's 8k gates
// keep both threads busy.
constexpr int64_t kActivationSpan = 1024;

// rows [rows, 2 * inter] of gates then ups -> out [rows, inter].
void activation_team(const float* gate_up, const float* bias, int32_t activation, int64_t rows, int64_t inter,
                     float* out) {
  const int64_t spans = (inter + kActivationSpan - 1) / kActivationSpan;
#pragma omp for schedule(static)
  for (int64_t item = 0; item < rows * spans; ++item) {
    const int64_t r = item / spans, from = item % spans * kActivationSpan;
    const float* gate = gate_up + r * 2 * inter;
    activate_span(gate, gate + inter, bias, bias != nullptr ? bias + inter : nullptr, activation, from,
                  std::min(from + kActivationSpan, inter), out + r * inter);
  }
}

int64_t outputs(const ls_linear& linear) {
  int64_t n = 0;
  for (int32_t i = 0; i < linear.parts; ++i) n += linear.n[i];
  return n;
}

// out [rows, outputs(linear)] = x [rows, k] through each part into its columns.
void linear_team(const ls_linear& linear, const float* x, int64_t rows, int64_t k, float* out, Buffers& buffers) {
  const int64_t stride = outputs(linear);
  MatmulJob jobs[4];
  int64_t tiled = 0, column = 0;
  for (int32_t i = 0; i < linear.parts; ++i) {
    if (linear.tiled[i] != nullptr) jobs[tiled++] = {linear.tiled[i], 0, rows, {out + column, stride}};
    column += linear.n[i];
  }
  if (tiled > 0) int8_matmul_team(jobs, tiled, x, rows, buffers.int8);
  column = 0;
  for (int32_t i = 0; i < linear.parts; ++i) {
    if (linear.dense[i] != nullptr) dense_matmul_team(linear.dense[i], linear.n[i], k, x, rows, {out + column, stride});
    column += linear.n[i];
  }
}

void add_bias(float* row, const float* bias, int64_t n) {
  if (bias != nullptr)
    for (int64_t i = 0; i < n; ++i) row[i] += bias[i];
}

// x += residual_scale * out_norm(block_out + bias), then normed = next_norm(x), row by row
// (normed may be x: the model's final norm).
void residual_team(const ls_decoder_shape& s, const ls_linear& projection, const float* out_norm,
                   float residual_scale, const float* next_norm, int64_t rows, float* x, float* normed, Buffers& b) {
  const int64_t hidden = s.hidden;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* out = b.projected.data() + r * hidden;
    float* row = x + r * hidden;
    add_bias(out, projection.bias, hidden);
    if (out_norm != nullptr) rms_norm(out, out_norm, hidden, s.eps, out);
    if (residual_scale != 1.0f)
      for (int64_t i = 0; i < hidden; ++i) out[i] *= residual_scale;
    for (int64_t i = 0; i < hidden; ++i) row[i] += out[i];
    if (next_norm != nullptr) rms_norm(row, next_norm, hidden, s.eps, normed + r * hidden);
  }
}

// One head's k or v into the cache at element `at`, narrowed to the cache's type as torch's
// .to() narrows (to nearest, ties to even).
void store_kv(const float* head, void* cache, int32_t kv_type, int64_t at, int64_t dim) {
  if (kv_type == LS_KV_F32) {
    std::copy(head, head + dim, static_cast<float*>(cache) + at);
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(cache) + at;
  for (int64_t d = 0; d < dim; ++d) out[d] = kv_type == LS_KV_F16 ? float_to_half(head[d]) : float_to_bf16(head[d]);
}

// q/k/v bias, per-head norms and rotary; q heads to b.q, k and v to the cache.
void heads_team(const ls_decoder_shape& s, const ls_decoder_layer& layer, const ls_decoder_batch& batch,
                Buffers& b) {
  const int64_t dim = s.head_dim, q_size = s.heads * dim, kv_size = s.kv_heads * dim;
  const int64_t width = q_size + 2 * kv_size, per_row = s.heads + s.kv_heads;
  const float* cos = batch.cos[layer.rope];
  const float* sin = batch.sin[layer.rope];
#pragma omp for schedule(static)
  for (int64_t item = 0; item < batch.tokens * per_row; ++item) {
    const int64_t r = item / per_row, head = item % per_row;
    float* row = b.qkv.data() + r * width;
    const float* bias = layer.qkv.bias;
    const float* row_cos = cos + r * s.rotary_dim;
    const float* row_sin = sin + r * s.rotary_dim;
    if (head < s.heads) {
      float* q = b.q.data() + r * q_size + head * dim;
      std::copy(row + head * dim, row + (head + 1) * dim, q);
      if (bias != nullptr) add_bias(q, bias + head * dim, dim);
      if (layer.q_norm != nullptr) rms_norm(q, layer.q_norm, dim, s.eps, q);
      rotate(q, row_cos, row_sin, s.rotary_dim);
    } else {
      const int64_t kvh = head - s.heads;
      float* k = row + q_size + kvh * dim;
      float* v = row + q_size + kv_size + kvh * dim;
      if (bias != nullptr) {
        add_bias(k, bias + q_size + kvh * dim, dim);
        add_bias(v, bias + q_size + kv_size + kvh * dim, dim);
      }
      if (layer.k_norm != nullptr) rms_norm(k, layer.k_norm, dim, s.eps, k);
      rotate(k, row_cos, row_sin, s.rotary_dim);
      const int64_t slot = batch.slot_mapping[r];
      if (slot >= 0) {
        store_kv(k, layer.k_cache, layer.kv_type, (slot * s.kv_heads + kvh) * dim, dim);
        store_kv(v, layer.v_cache, layer.kv_type, (slot * s.kv_heads + kvh) * dim, dim);
      }
    }
  }
}

// A row's top_k experts and gates from its router logits (see ls_moe in api.h); the logits
// become the probabilities in place, and the chosen ones are then marked taken.
void route_row(float* probs, int64_t experts, int64_t top_k, bool renormalize, int64_t* chosen, float* gates) {
  float most = probs[0];
  for (int64_t e = 1; e < experts; ++e) most = std::max(most, probs[e]);
  float total = 0.0f;
  for (int64_t e = 0; e < experts; ++e) total += probs[e] = std::exp(probs[e] - most);
  for (int64_t e = 0; e < experts; ++e) probs[e] /= total;
  float kept = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e)
      if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
    chosen[j] = best;
    gates[j] = probs[best];
    kept += probs[best];
    probs[best] = -1.0f;  // taken
  }
  if (renormalize)
    for (int64_t j = 0; j < top_k; ++j) gates[j] /= kept;
}

// b.projected [rows, hidden] = the mixture's output for b.h's rows: the experts a step chose
// run once each over their rows, every chosen expert of a projection in one int8 matmul.
void moe_team(const ls_decoder_shape& s, const ls_moe& moe, int64_t rows, Buffers& b) {
  MoeScratch& m = b.moe;
  const int64_t hidden = s.hidden, experts = moe.experts, top_k = moe.top_k, inter = moe.intermediate;
  const int64_t pairs = rows * top_k;
  linear_team(moe.router, b.h.data(), rows, hidden, m.logits.data(), b);
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    route_row(m.logits.data() + r * experts, experts, top_k, moe.renormalize != 0, m.experts.data() + r * top_k,
              m.gates.data() + r * top_k);
#pragma omp single
  {
    // A counting sort of the pairs by expert, stable in (row, choice) order.
    std::fill(m.counts.begin(), m.counts.end(), 0);
    for (int64_t p = 0; p < pairs; ++p) ++m.counts[m.experts[p]];
    int64_t at = 0;
    m.gate_up_jobs.clear();
    m.down_jobs.clear();
    for (int64_t e = 0; e < experts; ++e) {
      m.start[e] = at;
      if (m.counts[e] > 0) {
        m.gate_up_jobs.push_back({moe.gate_up[e], at, m.counts[e], {b.gate_up.data() + at * 2 * inter, 2 * inter}});
        m.down_jobs.push_back({moe.down[e], at, m.counts[e], {m.expert_out.data() + at * hidden, hidden}});
      }
      at += m.counts[e];
    }
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t position = m.start[m.experts[p]]++;
      m.order[position] = p;
      m.position[p] = position;
    }
  }
#pragma omp for schedule(static)
  for (int64_t i = 0; i < pairs; ++i) {
    const float* row = b.h.data() + (m.order[i] / top_k) * hidden;
    std::copy(row, row + hidden, m.rows.data() + i * hidden);
  }
  int8_matmul_team(m.gate_up_jobs.data(), static_cast<int64_t>(m.gate_up_jobs.size()), m.rows.data(), pairs, b.int8);
  activation_team(b.gate_up.data(), nullptr, 0, pairs, inter, b.activated.data());
  int8_matmul_team(m.down_jobs.data(), static_cast<int64_t>(m.down_jobs.size()), b.activated.data(), pairs, b.int8);
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    // This row's pairs in grouped order: by expert id, as the torch path sums them.
    int64_t positions[kMaxTopK];
    for (int64_t j = 0; j < top_k; ++j) positions[j] = m.position[r * top_k + j];
    std::sort(positions, positions + top_k);
    float* out = b.projected.data() + r * hidden;
    std::fill(out, out + hidden, 0.0f);
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t i = positions[j];
      const float gate = m.gates[m.order[i]];
      const float* y = m.expert_out.data() + i * hidden;
      for (int64_t c = 0; c < hidden; ++c) out[c] += y[c] * gate;
    }
  }
}

void layers_team(const ls_decoder_shape& s, const ls_decoder_layer* layers, int64_t count,
                 const ls_decoder_batch& batch, const float* final_norm, float* x, Buffers& b) {
  const int64_t rows = batch.tokens, hidden = s.hidden;
  StepClock clock;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) rms_norm(x + r * hidden, layers[0].input_norm, hidden, s.eps, b.h.data() + r * hidden);
  clock.mark(LS_STEP_GLUE);
  for (int64_t i = 0; i < count; ++i) {
    const ls_decoder_layer& layer = layers[i];
    linear_team(layer.qkv, b.h.data(), rows, hidden, b.qkv.data(), b);
    clock.mark(LS_STEP_QKV);
    heads_team(s, layer, batch, b);
    clock.mark(LS_STEP_ROTARY_KV);
    paged_attention_team(b.q.data(), rows, s.heads, s.head_dim, layer.k_cache, layer.v_cache, layer.kv_type,
                         batch.block_size, s.kv_heads, batch.block_tables, batch.max_blocks, batch.query_start, batch.seq_lens,
                         batch.batch, layer.scale, layer.window, layer.softcap, layer.sinks, b.attention.data(),
                         b.attention_scratch);
    clock.mark(LS_STEP_ATTENTION);
    linear_team(layer.o, b.attention.data(), rows, s.heads * s.head_dim, b.projected.data(), b);
    clock.mark(LS_STEP_O);
    residual_team(s, layer.o, layer.attn_out_norm, layer.residual_scale, layer.pre_mlp_norm, rows, x, b.h.data(), b);
    clock.mark(LS_STEP_GLUE);
    static const ls_linear kNoBias = {};
    if (layer.moe != nullptr) {
      moe_team(s, *layer.moe, rows, b);
      clock.mark(LS_STEP_EXPERTS);
    } else {
      linear_team(layer.gate_up, b.h.data(), rows, hidden, b.gate_up.data(), b);
      clock.mark(LS_STEP_GATE_UP);
      activation_team(b.gate_up.data(), layer.gate_up.bias, layer.activation, rows, s.intermediate, b.activated.data());
      clock.mark(LS_STEP_GLUE);
      linear_team(layer.down, b.activated.data(), rows, s.intermediate, b.projected.data(), b);
      clock.mark(LS_STEP_DOWN);
    }
    const bool last = i + 1 == count;
    residual_team(s, layer.moe != nullptr ? kNoBias : layer.down, layer.mlp_out_norm, layer.residual_scale,
                  last ? final_norm : layers[i + 1].input_norm, rows, x, last ? x : b.h.data(), b);
    clock.mark(LS_STEP_GLUE);
  }
}

}  // namespace
}  // namespace ls

extern "C" void ls_decoder_profile(int32_t enable, double* seconds) {
  if (seconds != nullptr)
    for (int i = 0; i < LS_DECODER_STEPS; ++i) seconds[i] = ls::g_step_seconds[i];
  for (double& total : ls::g_step_seconds) total = 0.0;
  ls::g_profiling.store(enable != 0, std::memory_order_relaxed);
}

extern "C" void ls_decoder_layers(const ls_decoder_shape* shape, const ls_decoder_layer* layers, int64_t count,
                                  const ls_decoder_batch* batch, const float* final_norm, float* x) {
  if (count <= 0 || batch->tokens <= 0) return;
  const ls_decoder_shape& s = *shape;
  const int64_t rows = batch->tokens, q_size = s.heads * s.head_dim;
  ls::Buffers b;
  b.h.resize(rows * s.hidden);
  b.qkv.resize(rows * (q_size + 2 * s.kv_heads * s.head_dim));
  b.q.resize(rows * q_size);
  b.attention.resize(rows * q_size);
  b.projected.resize(rows * s.hidden);
  // The MLP buffers serve the dense layers' rows and the experts' (row, choice) pairs alike.
  int64_t mlp_rows_x_width = rows * s.intermediate, experts = 0, pairs = 0;
  for (int64_t i = 0; i < count; ++i) {
    const ls_moe* moe = layers[i].moe;
    if (moe == nullptr) continue;
    mlp_rows_x_width = std::max(mlp_rows_x_width, rows * moe->top_k * moe->intermediate);
    experts = std::max(experts, moe->experts);
    pairs = std::max(pairs, rows * moe->top_k);
  }
  b.gate_up.resize(2 * mlp_rows_x_width);
  b.activated.resize(mlp_rows_x_width);
  if (pairs > 0) {
    ls::MoeScratch& m = b.moe;
    m.logits.resize(rows * experts);
    m.gates.resize(pairs);
    m.rows.resize(pairs * s.hidden);
    m.expert_out.resize(pairs * s.hidden);
    m.experts.resize(pairs);
    m.order.resize(pairs);
    m.position.resize(pairs);
    m.counts.resize(experts);
    m.start.resize(experts);
    m.gate_up_jobs.reserve(experts);
    m.down_jobs.reserve(experts);
  }
#pragma omp parallel num_threads(ls::threads())
  ls::layers_team(s, layers, count, *batch, final_norm, x, b);
}
