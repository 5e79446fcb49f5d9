"""Writers of GPTQ and AWQ tensors, following the format facts (GPTQ and AWQ as their packers write them) with numpy only.

Each writer starts from known integer codes, zero points and scales, so the dense
weight it returns (``scales * (q - zeros)`` in fp32) is an independent reference for
what a reader must reconstruct.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8c + AWQ_ORDER[i]


@dataclass
class QuantizedLayer:
    tensors: dict[str, np.ndarray]  # suffix -> array, as stored in the checkpoint
    dense: np.ndarray  # fp32 [out, in] in the layer's input order


def _pack_along_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """Rows r*per .. r*per+per-1 of ``values [R, C]`` into word row r, lowest bits first."""
    per = 32 // bits
    words = np.zeros((values.shape[0] // per, values.shape[1]), dtype=np.uint32)
    for j in range(per):
        words |= values[j::per].astype(np.uint32) << np.uint32(bits * j)
    return words.view(np.int32)


def _pack_along_cols(values: np.ndarray, bits: int) -> np.ndarray:
    return _pack_along_rows(values.T, bits).T.copy()


def _scales(rng: np.random.Generator, shape: tuple[int, int], bits: int, in_f: int) -> np.ndarray:
    # (q - zero) spreads over ~2**bits values; aim the weights at std ~1/sqrt(in_f).
    return (rng.uniform(0.5, 1.5, size=shape) / ((1 << bits) * 0.29 * np.sqrt(in_f))).astype(np.float16)


def gptq_layer(rng: np.random.Generator, out_f: int, in_f: int, bits: int, group_size: int,
               desc_act: bool, sym: bool, v1: bool) -> QuantizedLayer:
    gs = in_f if group_size == -1 else group_size
    groups = in_f // gs
    top = (1 << bits) - 1
    q = rng.integers(0, top + 1, size=(in_f, out_f))  # [K, N] as GPTQ stores it
    if sym:
        zeros = np.full((groups, out_f), 1 << (bits - 1))
    else:  # v1 stores zero - 1, so a true zero of 0 cannot be written there
        zeros = rng.integers(1 if v1 else 0, top + 1, size=(groups, out_f))
    scales = _scales(rng, (groups, out_f), bits, in_f)
    if desc_act:
        order = rng.permutation(in_f)
        g_idx = np.empty(in_f, dtype=np.int32)
        g_idx[order] = np.arange(in_f) // gs  # every group still has gs members
    else:
        g_idx = (np.arange(in_f) // gs).astype(np.int32)
    stored_zeros = (zeros - 1) & top if v1 else zeros
    dense = scales.astype(np.float32)[g_idx] * (q - zeros[g_idx]).astype(np.float32)  # [K, N]
    return QuantizedLayer(
        tensors={
            "qweight": _pack_along_rows(q, bits),
            "qzeros": _pack_along_cols(stored_zeros, bits),
            "scales": scales,
            "g_idx": g_idx,
        },
        dense=dense.T.copy(),
    )


def awq_layer(rng: np.random.Generator, out_f: int, in_f: int, group_size: int, zero_point: bool) -> QuantizedLayer:
    groups = in_f // group_size
    q = rng.integers(0, 16, size=(in_f, out_f))
    zeros = rng.integers(0, 16, size=(groups, out_f)) if zero_point else np.full((groups, out_f), 8)
    scales = _scales(rng, (groups, out_f), 4, in_f)

    def pack(values: np.ndarray) -> np.ndarray:
        words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
        for nibble, column in enumerate(AWQ_ORDER):
            words |= values[:, column::8].astype(np.uint32) << np.uint32(4 * nibble)
        return words.view(np.int32)

    g = np.arange(in_f) // group_size
    dense = (q - zeros[g]).astype(np.float32) * scales.astype(np.float32)[g]
    tensors = {"qweight": pack(q), "scales": scales}
    if zero_point:
        tensors["qzeros"] = pack(zeros)
    return QuantizedLayer(tensors=tensors, dense=dense.T.copy())


def numpy_unpack_gptq(tensors: dict[str, np.ndarray], bits: int, group_size: int, v1: bool) -> np.ndarray:
    """Dequantize stored GPTQ tensors by the format facts (for checkpoints we did not write)."""
    words = tensors["qweight"].view(np.uint32)
    per, mask = 32 // bits, (1 << bits) - 1
    k = words.shape[0] * per
    q = np.zeros((k, words.shape[1]), dtype=np.int64)
    for j in range(per):
        q[j::per] = (words >> np.uint32(bits * j)) & mask
    zwords = tensors["qzeros"].view(np.uint32)
    z = np.zeros((zwords.shape[0], zwords.shape[1] * per), dtype=np.int64)
    for j in range(per):
        z[:, j::per] = (zwords >> np.uint32(bits * j)) & mask
    if v1:
        z = z + 1
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        g_idx = np.arange(k) // (k if group_size == -1 else group_size)
    scales = tensors["scales"].astype(np.float32)
    return (scales[g_idx] * (q - z[g_idx]).astype(np.float32)).T.copy()
