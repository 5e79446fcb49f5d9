// The sampler's last steps on the CPU (localserve/engine/sampler.py says what they mean):
// each row's greedy argmax, or its draw after temperature, top_k, min_p and top_p. torch
// takes ~0.2 ms for an argmax over a 128k vocabulary and ~1.7 ms for a draw at Ollama's
// defaults (temperature 0.8, top_k 40, top_p 0.9), a few percent of a 1B model's decode
// step; here a row is a few vector passes, and with top_k, every step after the selection
// meets only the k tokens kept.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "api.h"
#include "runtime.h"
#include "simd.h"

namespace ls {
namespace {

using F = Simd::F;
constexpr int kLanes = Simd::kLanes;

// Buffers a thread keeps from one row to the next.
struct RowScratch {
  std::vector<float> values, probs, weights, heap;
  std::vector<int64_t> tokens;
  std::vector<int32_t> block_keys;
  std::vector<float> block_sums;
};

// A float's order as an int32 (finite values and infinities): integer maxima vectorize.
int32_t order_key(float value) {
  int32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

// An int count, not a bool: the compiler vectorizes this one.
bool has_nan(const float* x, int64_t n) {
  int32_t nans = 0;
  for (int64_t i = 0; i < n; ++i) nans += x[i] != x[i];
  return nans > 0;
}

// The first index of the largest value: torch.argmax's answer (a NaN counts as the largest).
// Each block's largest in vector lanes, then one scan of the block that holds the answer.
int64_t argmax(const float* x, int64_t n) {
  constexpr int64_t kBlock = 256;
  int32_t most = order_key(x[0]);
  int64_t best_block = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(n, b + kBlock);
    if (has_nan(x + b, end - b)) {
      for (int64_t i = b;; ++i)
        if (x[i] != x[i]) return i;
    }
    int32_t block_most = order_key(x[b]);
    for (int64_t i = b + 1; i < end; ++i) block_most = std::max(block_most, order_key(x[i]));
    if (block_most > most) {
      most = block_most;
      best_block = b;
    }
  }
  for (int64_t i = best_block;; ++i)
    if (order_key(x[i]) == most) return i;
}


// The tokens of x [n] at least as large as its k-th largest (k < n; ties at the edge stay),
// in order: a min-heap keeps the k largest seen, and a block of 64 whose largest cannot
// enter it is passed over (its largest found in vector lanes), as it is when collecting.
void top_k_tokens(const float* x, int64_t n, int64_t k, RowScratch& s) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  s.block_keys.resize(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = std::min(n, (b + 1) * kBlock);
    int32_t most = order_key(x[b * kBlock]);
    for (int64_t i = b * kBlock + 1; i < end; ++i) most = std::max(most, order_key(x[i]));
    s.block_keys[b] = most;
  }
  std::vector<float>& heap = s.heap;
  heap.assign(x, x + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  for (int64_t i = k; i < n; ++i) {
    if (i % kBlock == 0 && s.block_keys[i / kBlock] <= order_key(heap.front())) {
      i += kBlock - 1;
      continue;
    }
    if (x[i] > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
      heap.back() = x[i];
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    }
  }
  const float kth = heap.front();
  s.tokens.clear();
  for (int64_t b = 0; b < blocks; ++b) {
    if (s.block_keys[b] < order_key(kth)) continue;
    for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i)
      if (x[i] >= kth) s.tokens.push_back(i);
  }
}

// sum of x[0..n) in lanes (a fixed order).
float lane_sum(const float* x, int64_t n) {
  F acc = Simd::zerof();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = Simd::add(acc, Simd::loadf(x + i));
  float sum = Simd::reduce(acc);
  for (; i < n; ++i) sum += x[i];
  return sum;
}

// max of x[0..n), n > 0, no NaN.
float lane_max(const float* x, int64_t n) {
  F acc = Simd::set1f(x[0]);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = Simd::maxf(acc, Simd::loadf(x + i));
  float most = Simd::reduce_max(acc);
  for (; i < n; ++i) most = std::max(most, x[i]);
  return most;
}

// The sum of the entries of p[0..n) above pivot, in lanes.
float mass_above(const float* p, int64_t n, float pivot) {
  alignas(64) float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += p[i + l] > pivot ? p[i + l] : 0.0f;
  float sum = Simd::reduce(Simd::loadf(lanes));
  for (; i < n; ++i) sum += p[i] > pivot ? p[i] : 0.0f;
  return sum;
}

// e[i] = exp(x[i] - most), vector lanes and a padded last vector.
void exp_shifted(const float* x, int64_t n, float most, float* e) {
  const F shift = Simd::set1f(most);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Simd::storef(e + i, Simd::exp(Simd::sub(Simd::loadf(x + i), shift)));
  if (i < n) {
    alignas(64) float padded[kLanes], out[kLanes];
    std::fill(padded, padded + kLanes, most);
    std::copy(x + i, x + n, padded);
    Simd::storef(out, Simd::exp(Simd::sub(Simd::loadf(padded), shift)));
    std::copy(out, out + (n - i), e + i);
  }
}

// The inverse CDF of weights w[0..n) at u in [0, 1): the first entry whose running sum passes
// u times the total (kept below the total, so a token with weight), found a block at a time.
int64_t draw(const float* w, int64_t n, float u, std::vector<float>& block_sums) {
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  block_sums.resize(blocks);
  float* sums = block_sums.data();
  float total = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) total += sums[b] = lane_sum(w + b * kBlock, std::min(kBlock, n - b * kBlock));
  const float target = std::min(u * total, std::nextafter(total, 0.0f));
  float running = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    if (running + sums[b] <= target) {
      running += sums[b];
      continue;
    }
    for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
      running += w[i];
      if (running > target) return i;
    }
  }
  // Past the end by rounding (the blocks' sums against the running one): the last token
  // with weight.
  for (int64_t i = n - 1; i >= 0; --i)
    if (w[i] > 0.0f) return i;
  return n - 1;
}

// One row's draw (see ls_sample_rows).
int64_t sample_row(const float* logits, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                   const float* uniforms, int64_t count, RowScratch& s) {
  if (has_nan(logits, vocab)) return vocab - 1;  // as torch's draw keeps a NaN row in range
  // With top_k, only the tokens whose logits are at least the k-th largest go on (ties at the
  // edge stay), in vocabulary order; then logits / temperature, as torch divides them.
  const bool compact = top_k > 0 && top_k < vocab;
  int64_t n = vocab;
  if (compact) {
    top_k_tokens(logits, vocab, top_k, s);
    n = static_cast<int64_t>(s.tokens.size());
  }
  s.values.resize(n);
  float* v = s.values.data();
  if (compact)
    for (int64_t i = 0; i < n; ++i) v[i] = logits[s.tokens[i]] / temperature;
  else
    for (int64_t i = 0; i < n; ++i) v[i] = logits[i] / temperature;
  const auto token_of = [&](int64_t i) { return compact ? s.tokens[i] : i; };
  float most = lane_max(v, n);
  if (std::isinf(most)) {
    if (most < 0) return token_of(n - 1);  // every logit -inf: in range, as torch's draw
    for (int64_t i = 0; i < n; ++i) v[i] = std::isinf(v[i]) && v[i] > 0 ? 0.0f : -INFINITY;
    most = 0.0f;  // logits of +inf (an overflowed bias): equally likely, the rest never
  }
  s.probs.resize(n);
  float* p = s.probs.data();
  exp_shifted(v, n, most, p);
  const float inverse = 1.0f / lane_sum(p, n);
  for (int64_t i = 0; i < n; ++i) p[i] *= inverse;
  // What is drawn from: the probabilities until min_p or a rejection drops some.
  const float* w = p;
  const auto writable_weights = [&]() {
    if (w == p) {
      s.weights.assign(p, p + n);
      w = s.weights.data();
    }
    return s.weights.data();
  };
  // min_p: below min_p times the best token's probability, out of the draw
  if (min_p > 0.0f) {
    const float floor = min_p * lane_max(p, n);
    float* out = writable_weights();
    for (int64_t i = 0; i < n; ++i)
      if (p[i] < floor) out[i] = 0.0f;
  }
  // top_p by rejection, as the torch sampler: a drawn token is kept while the mass of the
  // tokens more likely than it is below top_p; if not, it and every token as likely or less
  // leave the draw, and the next uniform draws again.
  for (int64_t round = 0; round < count; ++round) {
    const int64_t i = draw(w, n, uniforms[round], s.block_sums);
    if (top_p >= 1.0f) return token_of(i);
    const float drawn = p[i], better = mass_above(p, n, drawn);
    if (!(better >= top_p && better > 0.0f)) return token_of(i);
    float* out = writable_weights();
    for (int64_t j = 0; j < n; ++j)
      if (p[j] <= drawn) out[j] = 0.0f;
  }
  return -1;  // another uniform needed
}

}  // namespace
}  // namespace ls

extern "C" {

void ls_argmax_rows(const float* logits, int64_t rows, int64_t vocab, int64_t* out) {
#pragma omp parallel for num_threads(ls::threads()) schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) out[r] = ls::argmax(logits + r * vocab, vocab);
}

void ls_sample_rows(const float* logits, int64_t rows, int64_t vocab, const float* temperature, const int64_t* top_k,
                    const float* top_p, const float* min_p, const float* uniforms, int64_t count, int64_t* out) {
#pragma omp parallel num_threads(ls::threads()) if (rows > 1)
  {
    // Kept for the thread's next call: a fresh 128k-float buffer is an mmap and its page faults.
    thread_local ls::RowScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r)
      out[r] = ls::sample_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r], min_p[r],
                              uniforms + r * count, count, scratch);
  }
}
}
