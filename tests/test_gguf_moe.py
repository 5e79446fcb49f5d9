"""MoE GGUF files (Mixtral as arch llama with experts, qwen2moe, qwen3moe, olmoe; experts in
stacked ``*_exps`` tensors): our logits against gguf-py's dequantization and against
llama.cpp on the same file, for gguf-py's Q8_0/Q4_0 and llama.cpp's own Q4_K_M.

llama.cpp rounds activations to 8 bits inside its quantized matmuls, so a token whose
k-th and (k+1)-th router logits are nearly tied may be routed differently there: both
routings are right to within that rounding, yet the logits then differ by far more
than it. Those positions (router margin < ``NEAR_TIE`` in some layer, a few in 48) are
left out of the llama.cpp comparison; the comparison with the dequantized weights
covers every position."""

from __future__ import annotations

import pytest
import torch

from localserve import Engine, EngineConfig
from localserve.kernels import cpu_library
from localserve.kernels.quant_linear_cpu import TiledWeight
from localserve.models.moe import SparseMoE

from .conftest import hf_logits, random_prompt, relative_error
from .gguf_writers import dequantized_reference, tiny_moe, write_gguf
from .test_gguf_models import llama_cpp_logits, llama_cpp_quantize
from .test_models import all_logits

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
NEAR_TIE = 0.1  # router logits are ~4 apart on average at the tiny models' 4x router scale


@pytest.fixture(scope="module", params=KINDS)
def moe_model(request):
    return request.param, tiny_moe(request.param)


def logits_and_router_margins(engine: Engine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """All-position logits, and per position the smallest gap between the k-th and
    (k+1)-th router logits over the MoE layers."""
    margins: list[torch.Tensor] = []
    hooks = []
    for layer in engine.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            k = layer.mlp.top_k
            hooks.append(layer.mlp.router.register_forward_hook(
                lambda module, args, out, k=k: margins.append(-torch.diff(out.float().topk(k + 1).values[:, k - 1:]))))
    try:
        logits = all_logits(engine, [prompt])[0]
    finally:
        for hook in hooks:
            hook.remove()
    return logits, torch.cat(margins, dim=1).min(dim=1).values


def check_against_oracles(path, model, tiled: bool = True) -> None:
    """Exact (fp32 activations) against gguf-py's dequantization, and as served against
    llama.cpp; ``tiled``: the experts run on the int8 kernel, as llama.cpp's do."""
    prompt = [1, *random_prompt(47, seed=11)]
    engine = Engine(path, EngineConfig(num_kv_blocks=32), device="cpu")
    if cpu_library.available():
        assert all(isinstance(e.mlp.down.weight, TiledWeight) == tiled for _, e in engine.model.experts())
    ours = all_logits(engine, [prompt])[0]
    # fp32 activations in every matmul, as the dequantized fp32 model computes them; its
    # modules' routers give the margins (the int8 path's may run inside the C++ decoder stack).
    exact_engine = Engine(path, EngineConfig(num_kv_blocks=32, exact_cpu_matmul=True), device="cpu")
    exact, margins = logits_and_router_margins(exact_engine, prompt)
    versus_dequantized = relative_error(exact, hf_logits(dequantized_reference(path, model), prompt))
    clear = margins >= NEAR_TIE
    versus_llama_cpp = relative_error(ours[clear], llama_cpp_logits(path, prompt)[clear])
    print(f"\n{path.name}: vs dequantized {versus_dequantized:.1e}, vs llama.cpp {versus_llama_cpp:.1e} "
          f"({int((~clear).sum())} near-tie positions of {len(prompt)} left out)")
    assert versus_dequantized <= 1e-4
    assert versus_llama_cpp <= 3e-2
    assert clear.float().mean() >= 0.75


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda t: t.name)
def test_gguf_py_types(tmp_path, moe_model, qtype) -> None:
    pytest.importorskip("llama_cpp")
    kind, model = moe_model
    path = tmp_path / f"{kind}-{qtype.name}.gguf"
    write_gguf(path, model, qtype)
    check_against_oracles(path, model)


def q4_k_m_file(tmp_path, kind: str, model):
    """The model quantized by llama.cpp's own quantizer (it keeps routers F32)."""
    pytest.importorskip("llama_cpp")
    source = tmp_path / f"{kind}-f32.gguf"
    write_gguf(source, model, Q.F32)
    path = tmp_path / f"{kind}-Q4_K_M.gguf"
    llama_cpp_quantize(source, path, "Q4_K_M")
    return path


def test_q4_k_m_from_llama_cpp_quantizer(tmp_path, moe_model) -> None:
    kind, model = moe_model
    path = q4_k_m_file(tmp_path, kind, model)
    expert_types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if "_exps" in t.name}
    assert expert_types & {"Q4_K", "Q6_K"}, expert_types
    check_against_oracles(path, model)


def test_f32_file_equals_transformers_and_llama_cpp(tmp_path, moe_model) -> None:
    """Unquantized, llama.cpp computes in fp32 too and every position must agree."""
    pytest.importorskip("llama_cpp")
    kind, model = moe_model
    path = tmp_path / f"{kind}-f32.gguf"
    write_gguf(path, model, Q.F32)
    engine = Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32)
    prompt = [1, *random_prompt(47, seed=11)]
    ours = all_logits(engine, [prompt])[0]
    assert relative_error(ours, hf_logits(model, prompt)) <= 1e-4
    assert relative_error(ours, llama_cpp_logits(path, prompt)) <= 2e-3


def test_planned_weights_equal_what_the_engine_holds(tmp_path, moe_model) -> None:
    """`localserve fit` sizes stacked experts from the header as the engine loads them."""
    from localserve.facts.fit import plan

    kind, model = moe_model
    path = q4_k_m_file(tmp_path, kind, model)
    # The plan is for a GPU, where weights keep the QuantWeight layout; the CPU's int8
    # kernel would re-lay GGUF's weights in tiles (exact_cpu_matmul keeps them as they are).
    engine = Engine(path, EngineConfig(num_kv_blocks=4, exact_cpu_matmul=True), device="cpu", dtype=torch.float32)
    model_ = engine.model
    held = (sum(p.numel() * p.element_size() for p in model_.parameters())
            + sum(linear.nbytes for linear in model_.linears()) + sum(e.nbytes for _, e in model_.experts()))
    planned = plan(path, 1 << 30, dtype="float32").weights
    assert planned.loaded_bytes == held
    assert sum(planned.expert_bytes_by_layer.values()) == sum(e.nbytes for _, e in model_.experts())
