// fp32 matmul over a dense fp32 weight (an HF checkpoint's layers, GPTQ/AWQ's LM head, MoE
// routers), batch invariant: a row's result does not depend on the other rows.
//
// A BLAS GEMM picks its blocking, its kernel (GEMV at one row) and how it splits the sums
// from the shapes, so the same row can come out with other bits in a batch of another
// size. Here every output element is summed the same way at any row count: vector
// accumulators over k in order, one fixed horizontal reduction, then the k % lanes tail
// with fused multiply-adds. Blocks of four rows and four outputs share each load; the
// block shape changes which values sit in registers together, never an element's sums.
#include <algorithm>
#include <cmath>

#include "api.h"
#include "runtime.h"
#include "simd.h"
#include "team.h"

namespace ls {
namespace {

using F = Simd::F;
constexpr int kLanes = Simd::kLanes;
constexpr int64_t kOutputBlock = 4;
// Rows of x kept hot in cache while the whole weight streams past them.
constexpr int64_t kRowChunk = 64;

template <int kRows, int kOutputs>
void dense_block(const float* w, int64_t k, const float* x, int64_t row0, int64_t n0, const Output& out) {
  F acc[kRows][kOutputs];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kOutputs; ++j) acc[r][j] = Simd::zerof();
  const int64_t vector_end = k - k % kLanes;
  for (int64_t i = 0; i < vector_end; i += kLanes) {
    F weights[kOutputs];
    for (int j = 0; j < kOutputs; ++j) weights[j] = Simd::loadf(w + (n0 + j) * k + i);
    for (int r = 0; r < kRows; ++r) {
      const F xv = Simd::loadf(x + (row0 + r) * k + i);
      for (int j = 0; j < kOutputs; ++j) acc[r][j] = Simd::fmadd(xv, weights[j], acc[r][j]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kOutputs; ++j) {
      float sum = Simd::reduce(acc[r][j]);
      for (int64_t i = vector_end; i < k; ++i) sum = std::fma(x[(row0 + r) * k + i], w[(n0 + j) * k + i], sum);
      out.data[(row0 + r) * out.stride + n0 + j] = sum;
    }
}

template <int kOutputs>
void output_block(const float* w, int64_t k, const float* x, int64_t row_begin, int64_t row_end, int64_t n0,
                  const Output& out) {
  int64_t r = row_begin;
  for (; r + 4 <= row_end; r += 4) dense_block<4, kOutputs>(w, k, x, r, n0, out);
  for (; r + 2 <= row_end; r += 2) dense_block<2, kOutputs>(w, k, x, r, n0, out);
  for (; r < row_end; ++r) dense_block<1, kOutputs>(w, k, x, r, n0, out);
}

}  // namespace

void dense_matmul_team(const float* w, int64_t n, int64_t k, const float* x, int64_t rows, const Output& out) {
  const int64_t blocks = (n + kOutputBlock - 1) / kOutputBlock;
  for (int64_t chunk = 0; chunk < rows; chunk += kRowChunk) {
    const int64_t chunk_end = std::min(rows, chunk + kRowChunk);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * kOutputBlock;
      if (n0 + kOutputBlock <= n) {
        output_block<kOutputBlock>(w, k, x, chunk, chunk_end, n0, out);
      } else {
        for (int64_t j = n0; j < n; ++j) output_block<1>(w, k, x, chunk, chunk_end, j, out);
      }
    }
  }
}

}  // namespace ls

extern "C" void ls_dense_matmul(const float* w, int64_t n, int64_t k, const float* x, int64_t rows, float* out) {
#pragma omp parallel num_threads(ls::threads())
  ls::dense_matmul_team(w, n, k, x, rows, {out, n});
}
