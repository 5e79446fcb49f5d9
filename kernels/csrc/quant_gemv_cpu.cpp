// Fused dequantize + matmul for QuantWeight on the CPU, for a few rows of x (decode).
//
// Each output row n is dequantized group by group into a small buffer with exactly the
// fp32 operations of the reference ((q - zero) * scale, or scale * q - min; the build turns
// FMA contraction off so no product is fused), then dotted with every row of x. The
// weight is read once per call and never materialised as a whole.
#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace {

template <typename Scale>
inline float to_float(Scale v) { return static_cast<float>(v); }
template <>
inline float to_float<at::Half>(at::Half v) { return static_cast<float>(v); }

// Zero: uint8_t or int16_t for the zeros form; float for the mins form (kMins).
template <bool kPacked, bool kMins, typename Scale, typename Zero>
void gemv(const float* x, int64_t rows, int64_t k, const uint8_t* codes, const Scale* scales,
          const Zero* offsets, int64_t groups, int64_t group_size, float* out, int64_t n_out) {
  const int64_t code_stride = kPacked ? k / 2 : k;
#pragma omp parallel
  {
    std::vector<float> w(group_size);
    std::vector<float> acc(rows);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
      const uint8_t* row_codes = codes + n * code_stride;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        const float s = to_float(scales[n * groups + g]);
        const float o = static_cast<float>(offsets[n * groups + g]);
        const int64_t k0 = g * group_size;
        if constexpr (kPacked) {
          // Byte j holds inputs 2j (low nibble) and 2j + 1 (high nibble).
          const uint8_t* bytes = row_codes + k0 / 2;
#pragma omp simd
          for (int64_t j = 0; j < group_size / 2; ++j) {
            const float lo = static_cast<float>(bytes[j] & 0xF);
            const float hi = static_cast<float>(bytes[j] >> 4);
            w[2 * j] = kMins ? s * lo - o : (lo - o) * s;
            w[2 * j + 1] = kMins ? s * hi - o : (hi - o) * s;
          }
        } else {
          const uint8_t* bytes = row_codes + k0;
#pragma omp simd
          for (int64_t j = 0; j < group_size; ++j) {
            const float q = static_cast<float>(bytes[j]);
            w[j] = kMins ? s * q - o : (q - o) * s;
          }
        }
        for (int64_t m = 0; m < rows; ++m) {
          const float* xm = x + m * k + k0;
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < group_size; ++j) sum += xm[j] * w[j];
          acc[m] += sum;
        }
      }
      for (int64_t m = 0; m < rows; ++m) out[m * n_out + n] = acc[m];
    }
  }
}

template <bool kPacked, typename Scale>
void dispatch_offsets(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                      const torch::Tensor& offsets, bool mins, int64_t group_size, torch::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), n_out = out.size(1), groups = scales.size(1);
  const auto* xs = x.data_ptr<float>();
  const auto* cs = codes.data_ptr<uint8_t>();
  const auto* ss = scales.data_ptr<Scale>();
  auto* os = out.data_ptr<float>();
  if (mins) {
    gemv<kPacked, true>(xs, rows, k, cs, ss, offsets.data_ptr<float>(), groups, group_size, os, n_out);
  } else if (offsets.scalar_type() == torch::kUInt8) {
    gemv<kPacked, false>(xs, rows, k, cs, ss, offsets.data_ptr<uint8_t>(), groups, group_size, os, n_out);
  } else {
    gemv<kPacked, false>(xs, rows, k, cs, ss, offsets.data_ptr<int16_t>(), groups, group_size, os, n_out);
  }
}

}  // namespace

// x [rows, K] fp32; codes uint8 [N, K/2] (packed) or [N, K]; scales fp16/fp32 [N, G];
// offsets: zeros (uint8/int16) or mins (fp32) [N, G]. Returns [rows, N] fp32.
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                         bool mins, bool packed, int64_t group_size) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous fp32 [rows, K]");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && offsets.is_contiguous(), "contiguous weight parts");
  auto out = torch::empty({x.size(0), codes.size(0)}, x.options());
  if (scales.scalar_type() == torch::kHalf) {
    packed ? dispatch_offsets<true, at::Half>(x, codes, scales, offsets, mins, group_size, out)
           : dispatch_offsets<false, at::Half>(x, codes, scales, offsets, mins, group_size, out);
  } else {
    packed ? dispatch_offsets<true, float>(x, codes, scales, offsets, mins, group_size, out)
           : dispatch_offsets<false, float>(x, codes, scales, offsets, mins, group_size, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("quant_gemv", &quant_gemv, "fused dequantize-GEMV"); }
