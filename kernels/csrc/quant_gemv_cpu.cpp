// Fused dequantize + matmul for QuantWeight on the CPU, for a few rows of x (decode).
//
// Each output row n first widens its per-group scales and offsets (zeros or mins) to fp32,
// multiplying out two-level scales exactly as the reference does. Then it is dequantized
// group by group into a small buffer with exactly the fp32 operations of the reference
// ((q - zero) * scale, or scale * q - min; the build turns FMA contraction off so no
// product is fused) and dotted with every row of x. The weight is read once per call and
// never materialised as a whole.
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace {

// One [N, width] tensor of per-group (or per-super-block) factors, of any stored dtype.
struct Factors {
  const void* data = nullptr;
  at::ScalarType type = at::kFloat;
  int64_t width = 0;

  static Factors of(const torch::Tensor& t) {
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), "weight factors: contiguous [N, groups]");
    return {t.data_ptr(), t.scalar_type(), t.size(1)};
  }

  template <typename T>
  void widen_as(int64_t n, float* out) const {
    const T* row = static_cast<const T*>(data) + n * width;
    for (int64_t i = 0; i < width; ++i) out[i] = static_cast<float>(row[i]);
  }

  // Row n as fp32 (every supported type converts exactly).
  void widen(int64_t n, float* out) const {
    switch (type) {
      case at::kFloat: widen_as<float>(n, out); break;
      case at::kHalf: widen_as<at::Half>(n, out); break;
      case at::kByte: widen_as<uint8_t>(n, out); break;
      case at::kChar: widen_as<int8_t>(n, out); break;
      case at::kShort: widen_as<int16_t>(n, out); break;
      default: TORCH_CHECK(false, "unsupported factor dtype ", type);
    }
  }
};

// Row n's per-group values: inner[g], or outer[g / per_outer] * inner[g] in fp32.
void group_values(const Factors& inner, const std::optional<Factors>& outer, int64_t per_outer, int64_t n,
                  float* out, float* outer_buffer) {
  inner.widen(n, out);
  if (!outer) return;
  outer->widen(n, outer_buffer);
  for (int64_t g = 0; g < inner.width; ++g) out[g] = outer_buffer[g / per_outer] * out[g];
}

struct Weight {
  const uint8_t* codes;
  bool packed;
  int64_t group_size;
  Factors scales, offsets;
  std::optional<Factors> super_scales, super_offsets;
  int64_t groups_per_super;
};

template <bool kPacked, bool kMins>
void gemv(const float* x, int64_t rows, int64_t k, const Weight& wt, float* out, int64_t n_out) {
  const int64_t code_stride = kPacked ? k / 2 : k;
  const int64_t groups = wt.scales.width, group_size = wt.group_size;
#pragma omp parallel
  {
    std::vector<float> w(group_size), acc(rows), scale(groups), offset(groups), outer(groups);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
      const uint8_t* row_codes = wt.codes + n * code_stride;
      group_values(wt.scales, wt.super_scales, wt.groups_per_super, n, scale.data(), outer.data());
      group_values(wt.offsets, wt.super_offsets, wt.groups_per_super, n, offset.data(), outer.data());
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        const float s = scale[g], o = offset[g];
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

std::optional<Factors> optional_factors(const std::optional<torch::Tensor>& t) {
  if (!t) return std::nullopt;
  return Factors::of(*t);
}

}  // namespace

// x [rows, K] fp32; codes uint8 [N, K/2] (packed) or [N, K]; scales [N, G] (fp16/fp32, or
// integer sub-scales with super_scales [N, G / groups_per_super]); offsets: zeros
// (uint8/int16) or mins (fp32, or integer sub-mins with super_offsets). Returns [rows, N].
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                         bool mins, bool packed, int64_t group_size, std::optional<torch::Tensor> super_scales,
                         std::optional<torch::Tensor> super_offsets, int64_t groups_per_super) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous fp32 [rows, K]");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == torch::kUInt8, "codes: contiguous uint8");
  const int64_t k = x.size(1);
  TORCH_CHECK(group_size > 0 && k % group_size == 0 && scales.size(1) * group_size == k, "groups do not tile K");
  TORCH_CHECK(codes.size(1) == (packed ? k / 2 : k), "codes do not match K");
  TORCH_CHECK(groups_per_super > 0, "groups_per_super must be positive");
  const Weight weight{codes.data_ptr<uint8_t>(), packed, group_size, Factors::of(scales), Factors::of(offsets),
                      optional_factors(super_scales), optional_factors(super_offsets), groups_per_super};
  auto out = torch::empty({x.size(0), codes.size(0)}, x.options());
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t rows = x.size(0), n_out = codes.size(0);
  if (packed) {
    mins ? gemv<true, true>(xs, rows, k, weight, os, n_out) : gemv<true, false>(xs, rows, k, weight, os, n_out);
  } else {
    mins ? gemv<false, true>(xs, rows, k, weight, os, n_out) : gemv<false, false>(xs, rows, k, weight, os, n_out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("quant_gemv", &quant_gemv, "fused dequantize-GEMV"); }
