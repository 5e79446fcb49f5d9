"""GPT-OSS from the files people download: the released HF layout (experts in MXFP4 blocks
and e8m0 scales, a ``quantization_config`` of ``mxfp4``) against transformers' own
dequantization of those blocks, and GGUF files written by llama.cpp's converter
conventions (gate and up apart, biases, sinks, MXFP4 experts) against llama.cpp and
against gguf-py's dequantization. The experts stay MXFP4 in memory. (The tiny
transformers-saved checkpoint, dense experts, is checked with the other kinds in
test_models.py and test_moe_models.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from localserve import Engine, EngineConfig
from localserve.formats import open_checkpoint
from localserve.formats.layout import check_tensors
from localserve.kernels.quant_weight import QuantWeight

from .conftest import hf_logits, random_prompt, relative_error
from .gguf_writers import tiny_gpt_oss, write_gguf
from .test_gguf_moe import check_against_oracles
from .test_gguf_models import llama_cpp_logits
from .test_models import all_logits

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
PROMPT = [1, *random_prompt(47, seed=11)]


@pytest.fixture(scope="module")
def model():
    return tiny_gpt_oss()


def to_hf_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert weight ``[E, in, out]`` as the released checkpoints hold it: blocks
    ``[E, out, in / 32, 16]`` (the even input in the low nibble) and e8m0 exponents
    ``[E, out, in / 32]``, quantized by gguf-py's MXFP4 (whose exponent means the same:
    GGUF's 2 ** (e - 128) times doubled e2m1 values)."""
    experts, inputs, outputs = weight.shape
    rows = weight.transpose(1, 2).reshape(-1, inputs).numpy()
    packed = gguf.quants.quantize(rows, Q.MXFP4).reshape(-1, 17)
    exponents, nibbles = packed[:, 0], packed[:, 1:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # GGUF: element j low, j + 16 high
    blocks = codes[:, 0::2] | (codes[:, 1::2] << 4)
    shape = (experts, outputs, inputs // 32)
    return torch.from_numpy(blocks.reshape(*shape, 16).copy()), torch.from_numpy(exponents.reshape(shape).copy())


def write_released_layout(path, model) -> dict[str, torch.Tensor]:
    """The model as the released checkpoints are laid out (MXFP4 experts, the config's
    quantization_config); returns the reference weights: transformers' own reading of
    those blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    reference_state = dict(state)
    for name in list(state):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = to_hf_mxfp4(state.pop(name))
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
            reference_state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    model.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                          "model.layers.*.mlp.router",
                                                                                          "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, path / "model.safetensors")
    return reference_state


def test_released_mxfp4_layout_equals_transformers_dequantization(tmp_path, model) -> None:
    reference_state = write_released_layout(tmp_path, model)
    check_tensors(open_checkpoint(tmp_path))  # what pull checks, from the headers
    reference = type(model)(model.config)
    reference.load_state_dict(reference_state)
    engine = Engine(tmp_path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32)
    error = relative_error(all_logits(engine, [PROMPT])[0], hf_logits(reference.eval(), PROMPT))
    assert error <= 1e-4, f"{error:.1e} from transformers on its dequantized MXFP4 experts"
    # Held as stored: 4-bit codes and a bf16 power-of-two scale per 32, 4.5 bits a weight.
    for _, experts in engine.model.experts():
        for projection in (*experts.mlp.gate_up, experts.mlp.down):
            weight = projection.weight
            assert isinstance(weight, QuantWeight) and weight.codebook is not None
            assert weight.nbytes * 8 == 4.5 * weight.out_features * weight.in_features


def test_f32_gguf_equals_llama_cpp(tmp_path, model) -> None:
    pytest.importorskip("llama_cpp")
    path = tmp_path / "gpt-oss-f32.gguf"
    write_gguf(path, model, Q.F32)
    ours = all_logits(Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32), [PROMPT])[0]
    error = relative_error(ours, llama_cpp_logits(path, PROMPT))
    assert error <= 1e-2, f"{error:.1e} from llama.cpp"


@pytest.mark.parametrize("experts", ["MXFP4", "Q8_0"])
def test_gguf_equals_its_dequantization_and_llama_cpp(tmp_path, model, experts: str) -> None:
    """Experts in MXFP4 as llama.cpp's converter writes them (the rest F32), or every matrix
    Q8_0: either way the experts, biases and all, run on the CPU's grouped int8 kernel (MXFP4
    through its 16-level lookup); exact against gguf-py's dequantization, and against llama.cpp,
    which rounds activations to 8 bits, where no router near-tie can flip (as
    test_gguf_moe.py)."""
    pytest.importorskip("llama_cpp")
    path = tmp_path / f"gpt-oss-{experts}.gguf"
    if experts == "MXFP4":
        write_gguf(path, model, Q.F32, expert_qtype=Q.MXFP4)
    else:
        write_gguf(path, model, Q.Q8_0)
    check_tensors(open_checkpoint(path))
    check_against_oracles(path, model, tiled=True)


@pytest.mark.parametrize("form", ["hf-mxfp4", "gguf-mxfp4"])
def test_planned_sizes_equal_what_the_engine_holds(tmp_path, model, form: str) -> None:
    """`show` counts the parameters transformers' model has, and `fit` sizes the MXFP4
    experts as the engine holds them, from the headers alone."""
    from localserve.facts.fit import plan
    from localserve.formats.weights import weight_sizes

    if form == "hf-mxfp4":
        write_released_layout(tmp_path, model)
        path = tmp_path
    else:
        path = tmp_path / "gpt-oss.gguf"
        write_gguf(path, model, Q.F32, expert_qtype=Q.MXFP4)
    checkpoint = open_checkpoint(path)
    assert checkpoint.spec.parameter_counts().total == model.num_parameters()
    assert weight_sizes(checkpoint, torch.float32).parameters == model.num_parameters()
    engine = Engine(path, EngineConfig(num_kv_blocks=4), device="cpu", dtype=torch.float32)
    held_model = engine.model
    sinks = sum(layer.attn.sinks.numel() * 4 for layer in held_model.layers)
    held = (sum(p.numel() * p.element_size() for p in held_model.parameters()) + sinks
            + sum(linear.nbytes for linear in held_model.linears()) + sum(e.nbytes for _, e in held_model.experts()))
    planned = plan(path, 1 << 30, dtype="float32").weights
    assert planned.loaded_bytes == held
    assert sum(planned.expert_bytes_by_layer.values()) == sum(e.nbytes for _, e in held_model.experts())


def test_broken_mxfp4_tensors_are_refused_in_one_line(tmp_path, model) -> None:
    """A released-layout file whose blocks lack their scales, or whose scales do not fit
    the blocks, is refused when opened (what pull checks), naming the tensor."""
    from safetensors.torch import load_file

    from localserve import LocalserveError

    write_released_layout(tmp_path, model)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    for broken, message in (({k: v for k, v in tensors.items() if k != f"{name}_scales"}, "has no _scales"),
                            ({**tensors, f"{name}_scales": tensors[f"{name}_scales"][:, :-1].contiguous()}, "are not MXFP4")):
        save_file(broken, tmp_path / "model.safetensors")
        with pytest.raises(LocalserveError, match=message) as caught:
            open_checkpoint(tmp_path)
        assert name in str(caught.value) and "\n" not in str(caught.value)
