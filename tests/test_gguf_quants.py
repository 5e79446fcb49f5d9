"""GGUF block types re-packed into QuantWeight must dequantize bit-exactly like gguf-py."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as reference_dequantize  # noqa: E402
from gguf.quants import quantize as reference_quantize  # noqa: E402

from localserve.errors import LocalserveError  # noqa: E402
from localserve.formats import gguf_quants  # noqa: E402
from localserve.formats.gguf_quants import gguf_to_weight  # noqa: E402
from localserve.kernels.quant_weight import QuantWeight, dequantize  # noqa: E402

LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
IQ_TYPES = [T.IQ4_NL, T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.IQ2_S, T.IQ2_XS, T.IQ2_XXS, T.IQ1_M, T.IQ1_S, T.TQ2_0, T.TQ1_0]
# Byte offsets of the fp16 super-block scales (d, and dmin where present) in each block
# (IQ1_M spreads its d over the top nibbles of its last 8 bytes' four 16-bit words).
FP16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    **dict.fromkeys([T.IQ4_NL, T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.IQ2_S, T.IQ2_XS, T.IQ2_XXS, T.IQ1_S], (0,)),
    T.TQ2_0: (64,), T.TQ1_0: (52,), T.IQ1_M: (),
}


def random_blocks(qtype: T, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Valid raw data for any block type: random code/scale bytes, with the fp16 scale
    fields replaced by finite values of both signs and a spread of magnitudes (random
    bytes there would give NaN/inf, which compare unequal to themselves)."""
    rng = np.random.default_rng(seed)
    block_elements, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = shape[0] * shape[1] // block_elements
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        magnitude = 10.0 ** rng.uniform(-6, 1, size=n_blocks)
        value = (magnitude * rng.choice([-1.0, 1.0], size=n_blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = value.view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.IQ1_M:
        value = (10.0 ** rng.uniform(-6, 1, size=n_blocks) * rng.choice([-1.0, 1.0], size=n_blocks)).astype(np.float16)
        nibbles = (value.view(np.uint16)[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF
        words = blocks[:, 48:56].copy().view(np.uint16) & 0x0FFF | (nibbles << 12).astype(np.uint16)
        blocks[:, 48:56] = words.view(np.uint8)
    return blocks.reshape(-1)


def quantized_floats(qtype: T, shape: tuple[int, int], seed: int) -> np.ndarray | None:
    """gguf-py's own quantization of random floats, or None where it cannot quantize."""
    floats = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    try:
        return np.asarray(reference_quantize(floats, qtype)).reshape(-1)
    except (NotImplementedError, gguf.quants.QuantError):
        return None


def readonly(raw: np.ndarray) -> np.ndarray:
    """Like the loader's memmap view: 1-D uint8 and not writable."""
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    raw.setflags(write=False)
    return raw


def assert_matches_reference(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> QuantWeight:
    weight = gguf_to_weight("blk.0.ffn_up.weight", readonly(raw), int(qtype), shape)
    assert isinstance(weight, QuantWeight)
    assert weight.shape == shape
    expected = torch.from_numpy(reference_dequantize(raw, qtype).reshape(shape).copy())
    assert torch.equal(dequantize(weight), expected)
    return weight


SHAPES = [(3, 256), (8, 512)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS + IQ_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf_py(qtype: T, shape: tuple[int, int]) -> None:
    weight = assert_matches_reference(random_blocks(qtype, shape, seed=shape[0]), qtype, shape)
    # x meets it rounded to int8 per llama.cpp's block for the type: Q8_K for the 256-element
    # types (K-quants, IQ but IQ4_NL, TQ), else Q8_0/Q8_1.
    assert weight.int8_block == GGML_QUANT_SIZES[qtype][0]


# gguf-py quantizes only the legacy types; K-quants come from random blocks above and
# from llama.cpp's quantizer in test_gguf_models.py.
@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_gguf_py_quantized_floats_match(qtype: T) -> None:
    shape = (8, 512)
    raw = quantized_floats(qtype, shape, seed=1)
    assert raw is not None
    assert_matches_reference(raw, qtype, shape)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q6_K, T.IQ2_XXS, T.IQ3_S, T.IQ1_S], ids=lambda t: t.name)
def test_many_chunks_and_special_scales(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    # Force one row per chunk, and put zero, subnormal and large scales into the blocks.
    monkeypatch.setattr(gguf_quants, "_CHUNK_ELEMENTS", 1)
    shape = (5, 512)
    raw = random_blocks(qtype, shape, seed=7)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    specials = np.array([0.0, -0.0, 6e-8, -3e-5, 65504.0, -1000.0], dtype=np.float16).view(np.uint8).reshape(-1, 2)
    offset = FP16_FIELDS[qtype][0]
    blocks[: len(specials), offset:offset + 2] = specials
    assert_matches_reference(raw, qtype, shape)


def test_one_dimensional_tensor_is_one_row() -> None:
    raw = random_blocks(T.Q8_0, (1, 64), seed=3)
    weight = gguf_to_weight("v", readonly(raw), int(T.Q8_0), (64,))
    assert isinstance(weight, QuantWeight) and weight.shape == (1, 64)
    assert torch.equal(dequantize(weight).view(-1), torch.from_numpy(reference_dequantize(raw, T.Q8_0).copy()))


def test_result_does_not_alias_the_source() -> None:
    raw = random_blocks(T.Q4_K, (2, 256), seed=4)
    weight = gguf_to_weight("w", raw, int(T.Q4_K), (2, 256))
    before = dequantize(weight).clone()
    raw[:] = 0
    assert torch.equal(dequantize(weight), before)


@pytest.mark.parametrize(
    ("qtype", "dtype", "np_dtype"),
    [(T.F32, torch.float32, np.float32), (T.F16, torch.float16, np.float16), (T.BF16, torch.bfloat16, None)],
    ids=["F32", "F16", "BF16"],
)
@pytest.mark.parametrize("shape", [(3, 5), (7,)])
def test_dense_types(qtype: T, dtype: torch.dtype, np_dtype: type | None, shape: tuple[int, ...]) -> None:
    floats = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    if np_dtype is None:
        raw = np.asarray(reference_quantize(floats, T.BF16)).view(np.uint8).reshape(-1)
    else:
        raw = floats.astype(np_dtype).view(np.uint8).reshape(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's warning about non-writable numpy arrays
        tensor = gguf_to_weight("t", readonly(raw), int(qtype), shape)
    assert isinstance(tensor, torch.Tensor)
    assert tensor.dtype == dtype and tuple(tensor.shape) == shape
    expected = torch.from_numpy(reference_dequantize(raw, qtype).reshape(shape).copy())
    assert torch.equal(tensor.float(), expected)


def test_memory_ratio_against_raw_bytes() -> None:
    shape = (8, 512)
    ratios: dict[str, float] = {}
    for qtype in LEGACY + K_QUANTS:
        raw = random_blocks(qtype, shape, seed=0)
        weight = gguf_to_weight("w", raw, int(qtype), shape)
        assert isinstance(weight, QuantWeight)
        ratios[qtype.name] = weight.nbytes / raw.size
    print("QuantWeight bytes / GGUF bytes: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    assert ratios["Q4_0"] <= 1.1
    assert ratios["Q8_0"] <= 1.1


def test_wrong_byte_count() -> None:
    raw = random_blocks(T.Q4_K, (2, 256), seed=0)
    for bad in (raw[:-1], np.concatenate([raw, raw[:1]]), raw[:0]):
        with pytest.raises(LocalserveError, match="blk.3.attn_q.weight"):
            gguf_to_weight("blk.3.attn_q.weight", bad, int(T.Q4_K), (2, 256))
    with pytest.raises(LocalserveError, match="norm"):
        gguf_to_weight("norm", np.zeros(10, np.uint8), int(T.F32), (3,))


@pytest.mark.parametrize("type_id", [int(T.Q8_1), int(T.Q8_K), int(T.I8), int(T.I32), 999])
def test_unsupported_type(type_id: int) -> None:
    name = T(type_id).name if type_id in T._value2member_map_ else "999"
    with pytest.raises(LocalserveError, match=rf"token_embd\.weight.*{name}"):
        gguf_to_weight("token_embd.weight", np.zeros(1024, np.uint8), type_id, (1, 256))


@pytest.mark.parametrize(("qtype", "width"), [(T.Q4_0, 48), (T.Q8_0, 16), (T.Q4_K, 128), (T.Q6_K, 320)])
def test_row_not_whole_blocks(qtype: T, width: int) -> None:
    with pytest.raises(LocalserveError, match=r"w\.bad.*multiple"):
        gguf_to_weight("w.bad", np.zeros(4096, np.uint8), int(qtype), (2, width))
