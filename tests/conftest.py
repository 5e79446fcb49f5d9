"""Tiny checkpoints built at test time from transformers configs, and helpers that run
our model on them directly (all-position logits) for comparison with transformers."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter, which
    # must be chosen before triton is first imported (transformers imports it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

DATA = Path(__file__).resolve().parent / "data"
STORIES_HF = DATA / "models" / "stories260K-hf"

VOCAB = 256
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _configs() -> dict[str, Callable[[], object]]:
    from transformers import (Gemma2Config, Gemma3TextConfig, GptOssConfig, GraniteConfig, LlamaConfig, MistralConfig,
                              MixtralConfig, OlmoeConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    return {
        "llama": lambda: LlamaConfig(**_BASE),
        # A short original context so llama3 / yarn scaling changes positions we test.
        "llama3-rope": lambda: LlamaConfig(
            **_BASE,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
        ),
        "llama-linear-rope": lambda: LlamaConfig(
            **_BASE, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        ),
        "llama-tied": lambda: LlamaConfig(**_BASE, tie_word_embeddings=True),
        # Biases on every projection, attention's and the MLP's.
        "llama-bias": lambda: LlamaConfig(**_BASE, attention_bias=True, mlp_bias=True),
        # Dynamic NTK: a 64-token pre-trained context that may stretch 4x.
        "llama-dynamic": lambda: LlamaConfig(**{**_BASE, "max_position_embeddings": 64},
                                             rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                              "factor": 4.0}),
        # Granite's multipliers, none of them 1 (the real models' values).
        "granite": lambda: GraniteConfig(**_BASE, embedding_multiplier=12.0, residual_multiplier=0.22,
                                         attention_multiplier=0.0078125, logits_scaling=8.0),
        # Phi-3: fused qkv and gate_up; Phi-3.5/4-mini: longrope over a 64-token original
        # context (1024 now), on 3/4 of each head (Phi-4-mini's partial rotary).
        "phi3": lambda: Phi3Config(**_BASE, sliding_window=None),
        "phi3-longrope": lambda: Phi3Config(
            **{**_BASE, "num_attention_heads": 2, "num_key_value_heads": 1}, partial_rotary_factor=0.75,
            original_max_position_embeddings=64, sliding_window=None,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0 + i / 10 for i in range(12)],
                             "long_factor": [1.0 + i for i in range(12)]}),
        # Gemma 2: GeGLU, (1 + w) norms around both blocks, scaled embeddings, soft caps low
        # enough to bend the tiny model's scores, query_pre_attn_scalar unlike head_dim, and
        # sliding (window 12) and full layers alternating.
        "gemma2": lambda: Gemma2Config(**{**_BASE, "num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=24,
                                       sliding_window=12, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        # Gemma 3: q/k norms, no soft caps, 5 local layers to 1 global, the local ones with a
        # rotary base of their own and the global ones' linearly scaled.
        "gemma3": lambda: Gemma3TextConfig(
            **{**_BASE, "num_hidden_layers": 6}, head_dim=32, query_pre_attn_scalar=24, sliding_window=12,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}),
        # Gemma 3 with a window as long as the context (a window that limits nothing, as when
        # a Gemma 3 is served with a context shorter than its 1024-token window): its local
        # layers keep their own rotary base all the same.
        "gemma3-long-window": lambda: Gemma3TextConfig(
            **{**_BASE, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=32,
            sliding_window=_BASE["max_position_embeddings"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
        "mistral": lambda: MistralConfig(**_BASE, sliding_window=None),
        # Sliding windows much shorter than the prompts: every layer (Mistral-7B-v0.1), and
        # Qwen2's use_sliding_window, where the first max_window_layers attend fully.
        "mistral-swa": lambda: MistralConfig(**_BASE, sliding_window=12),
        "qwen2-swa": lambda: Qwen2Config(**_BASE, tie_word_embeddings=False, use_sliding_window=True,
                                         sliding_window=12, max_window_layers=1),
        "qwen2": lambda: Qwen2Config(**_BASE, tie_word_embeddings=False),
        "qwen2-yarn": lambda: Qwen2Config(
            **_BASE, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64},
        ),
        # head_dim 32 differs from hidden/heads (16), as in real Qwen3 configs.
        "qwen3": lambda: Qwen3Config(**_BASE, head_dim=32, tie_word_embeddings=True),
        # Mixture of experts: 8 experts, top-2 (Mixtral renormalises the chosen gates).
        "mixtral": lambda: MixtralConfig(**{**_BASE, "intermediate_size": 96}, num_local_experts=8,
                                         num_experts_per_tok=2, sliding_window=None),
        # Qwen2-MoE: top-3 gates not renormalised, a shared expert behind a sigmoid gate.
        "qwen2_moe": lambda: Qwen2MoeConfig(**_BASE, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                            shared_expert_intermediate_size=96, norm_topk_prob=False,
                                            tie_word_embeddings=False),
        # Qwen3-MoE: q/k norm, renormalised gates, and layer 0 dense (mlp_only_layers).
        "qwen3_moe": lambda: Qwen3MoeConfig(**_BASE, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0],
                                            tie_word_embeddings=False),
        # OLMoE: q/k norms over the whole projection, top-2 gates not renormalised, and
        # clip_qkv low enough to clamp some of the tiny model's projections.
        "olmoe": lambda: OlmoeConfig(**{**_BASE, "intermediate_size": 48}, num_experts=8, num_experts_per_tok=2,
                                     clip_qkv=1.5),
        # GPT-OSS: biases everywhere, sinks, sliding (window 12) and full layers alternating,
        # yarn rope untruncated, top-2 of 8 experts with a clamped SwiGLU whose limit (1.5,
        # 7 in the real models) clamps the tiny model's activations.
        "gpt_oss": lambda: GptOssConfig(**{**_BASE, "intermediate_size": 48}, head_dim=16, num_local_experts=8,
                                        num_experts_per_tok=2, sliding_window=12, swiglu_limit=1.5),
    }


MOE_KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"]


MODEL_KINDS = list(_configs())
# Rotary scaling that transformers switches by each forward's length, and localserve by the
# served context (models/rope.py): compared with transformers in tests of their own.
SCALED_ROPE_KINDS = ["llama-dynamic", "phi3-longrope"]
# Sliding windows of 12 tokens, shorter than the test prompts.
SLIDING_KINDS = ["mistral-swa", "qwen2-swa", "gemma2", "gemma3", "gpt_oss"]


def reinitialise(model: torch.nn.Module, seed: int) -> None:
    """Weights at std 1/sqrt(fan_in) so logits are not flat; norms and biases
    random too, so that a weight loaded into the wrong place shows. MoE routers get
    4x that, so each token's gates are far from uniform and routing matters."""
    generator = torch.Generator().manual_seed(seed)
    # GPT-OSS stores its experts [E, in, out]: their fan-in is the middle dimension.
    inputs_first = getattr(getattr(model, "config", None), "model_type", None) == "gpt_oss"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                router = name.endswith(("mlp.gate.weight", "mlp.router.weight"))
                fan_in = param.shape[1] if inputs_first and param.dim() == 3 else param.shape[-1]
                param.normal_(0.0, (4.0 if router else 1.0) * fan_in**-0.5, generator=generator)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5, generator=generator)
            else:
                param.uniform_(0.5, 1.5, generator=generator)


class TinyModels:
    """Builds each kind once per session: (checkpoint folder, transformers model)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[tuple[str, str | None], tuple[Path, torch.nn.Module]] = {}

    def get(self, kind: str, save_dtype: torch.dtype = torch.float32, shard_size: str | None = None):
        key = (kind, f"{save_dtype}-{shard_size}")
        if key not in self.cache:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            config = _configs()[kind]()
            config._attn_implementation = "eager"
            model = AutoModelForCausalLM.from_config(config)
            # crc32, not hash(): str hashes change from one process to the next.
            reinitialise(model, seed=zlib.crc32(kind.encode()) % 1000)
            path = self.root / f"{kind}-{str(save_dtype).split('.')[-1]}-{shard_size}"
            model.to(save_dtype).save_pretrained(path, **({"max_shard_size": shard_size} if shard_size else {}))
            # The reference is the saved weights, in fp32.
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            self.cache[key] = (path, model.eval())
        return self.cache[key]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def llama(tiny_models: TinyModels):  # type: ignore[no-untyped-def]
    """The tiny Llama checkpoint and its transformers twin."""
    return tiny_models.get("llama")


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model: torch.nn.Module, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    return out[0, len(ids):].tolist()


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def spy_on(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Count the calls of ``module.name`` (still calling it); returns the count list."""
    calls: list[int] = []
    real = getattr(module, name)

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def triton_or_skip():  # type: ignore[no-untyped-def]
    """(triton, device, interpreted) for a kernel test module: compiled kernels on CUDA,
    the interpreter on CPU; skips the module when neither can run."""
    triton = pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    interpreted = not isinstance(triton.language.zeros, triton.runtime.JITFunction)
    if device.type == "cpu" and not interpreted:
        pytest.skip("no GPU and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
    return triton, device, interpreted
