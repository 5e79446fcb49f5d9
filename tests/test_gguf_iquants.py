"""GGUF's IQ and TQ types from llama.cpp's own quantizer: a tiny Llama quantized to each (every
matrix that type; the IQ1/IQ2/IQ3_XXS types with an importance matrix computed here from the
model's activations, as llama-imatrix would), then our logits against gguf-py's dequantization
(in transformers, exact mode) and against llama.cpp on the same file."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from .conftest import random_prompt
from .gguf_writers import gguf_name, tiny_llama, write_gguf
from .test_gguf_models import compare_with_oracles

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

# llama.cpp file type -> the tensor type it gives every matrix (with ``pure``; its IQ2_M files
# are the IQ2_S type).
FTYPES = {
    "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "IQ3_S": "IQ3_S", "IQ3_XXS": "IQ3_XXS", "IQ2_M": "IQ2_S",
    "IQ2_XS": "IQ2_XS", "IQ2_XXS": "IQ2_XXS", "IQ1_M": "IQ1_M", "IQ1_S": "IQ1_S", "TQ2_0": "TQ2_0", "TQ1_0": "TQ1_0",
}


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def source(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("iq") / "tiny-f32.gguf"
    write_gguf(path, model, gguf.GGMLQuantizationType.F32)
    return path


@pytest.fixture(scope="module")
def imatrix(model) -> dict[str, np.ndarray]:
    return importance_matrix(model)


def importance_matrix(model) -> dict[str, np.ndarray]:
    """Per matrix (the LM head included), the mean square of each input over a few prompts:
    what llama-imatrix collects (it weighs which columns' errors matter)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            target = gguf_name(f"{name}.weight")

            def record(_module, inputs, _output, target=target) -> None:
                x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
                sums[target] = sums.get(target, 0) + (x * x).sum(0)
                counts[target] = counts.get(target, 0) + x.shape[0]

            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        for seed in range(4):
            model(torch.tensor([random_prompt(64, seed=100 + seed)]))
    for hook in hooks:
        hook.remove()
    matrix = {name: (total / counts[name]).float().numpy() for name, total in sums.items()}
    # The embedding meets no activations: every column matters alike.
    return matrix | {"token_embd.weight": np.ones(model.config.hidden_size, dtype=np.float32)}


def quantize_with_imatrix(source, target, ftype: str, imatrix: dict[str, np.ndarray]) -> None:
    entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
    keep = []
    for entry, (name, values) in zip(entries, imatrix.items()):
        data = np.ascontiguousarray(values, dtype=np.float32)
        keep.append((name.encode(), data))
        entry.name, entry.data, entry.size = keep[-1][0], data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), data.size
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.pure = True
    params.nthread = 2
    params.imatrix = ctypes.cast(entries, type(params.imatrix))
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    assert status == 0, f"llama.cpp could not quantize to {ftype}"


@pytest.mark.parametrize("ftype", FTYPES)
def test_llama_cpp_quantized_file_matches_both_oracles(tmp_path, model, source, imatrix, ftype: str) -> None:
    path = tmp_path / f"tiny-{ftype}.gguf"
    quantize_with_imatrix(source, path, ftype, imatrix)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk.") and
             t.name.endswith("proj.weight") or ".attn_" in t.name and t.name.endswith(".weight") and "norm" not in t.name}
    assert types == {FTYPES[ftype]}, types
    versus_dequantized, versus_llama_cpp = compare_with_oracles(path, model)
    assert versus_dequantized <= 1e-4 and versus_llama_cpp <= 3e-2


@pytest.mark.parametrize("ftype", ["IQ4_XS", "IQ2_XXS", "TQ1_0"])
def test_show_and_fit_size_them_as_loaded(tmp_path, source, imatrix, ftype: str) -> None:
    """``show`` names the type; the loaded size ``fit`` plans with, from the headers alone,
    equals what loading the tensors takes."""
    from localserve.facts.checkpoint import model_info
    from localserve.formats import open_checkpoint
    from localserve.formats.weights import weight_sizes

    path = tmp_path / f"tiny-{ftype}.gguf"
    quantize_with_imatrix(source, path, ftype, imatrix)
    checkpoint = open_checkpoint(path)
    info, _ = model_info(checkpoint)
    assert str(info["quantization"]).startswith(FTYPES[ftype])
    loaded = sum(w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * 4 for _, w in checkpoint.weights())
    assert weight_sizes(checkpoint, torch.float32).loaded_bytes == loaded


def test_stored_grids_are_gguf_py_grids() -> None:
    """localserve/formats/iq_grids.py (written by scripts/make_iq_grids.py) holds ggml's grids."""
    from localserve.formats.gguf_iquants import _grid
    from localserve.formats.iq_grids import GRIDS

    for name, (values, rows, width, _) in GRIDS.items():
        reference = getattr(gguf.quants, name)
        reference.init_grid()
        expected = np.asarray(reference.grid, dtype=np.float32).reshape(reference.grid_shape)
        assert (rows, width) == expected.shape
        assert np.array_equal(np.array(values, dtype=np.float32)[_grid(name).numpy()], expected), name
