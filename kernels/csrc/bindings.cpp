// The Python module of localserve's CPU kernels (one extension, built once).
#include <torch/extension.h>

#include <optional>

torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                         bool mins, int64_t bits, int64_t group_size, std::optional<torch::Tensor> super_scales,
                         std::optional<torch::Tensor> super_offsets, int64_t groups_per_super, int64_t int8_block);
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_gemv", &quant_gemv, "fused dequantize-GEMV for QuantWeight");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged fp32 KV cache");
}
