"""localserve's compiled CPU kernels (``csrc/``): the library this CPU runs best, via ctypes.

The package build compiles the sources once per instruction set (see setup.py); this
picks the first of them, best first, whose instructions this CPU has. Nothing is compiled
at run time. Without a usable library, ``available()`` is False and every caller keeps
its torch reference, after one warning line.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# Each library and the CPU flags (as /proc/cpuinfo names them) it needs, best first.
VARIANTS: dict[str, tuple[str, ...]] = {
    "avx512_vnni": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "generic": (),
}

_f32p = ctypes.POINTER(ctypes.c_float)


class TiledWeightDesc(ctypes.Structure):
    """``ls_tiled_weight`` in csrc/api.h."""

    _fields_ = [("n", ctypes.c_int64), ("k", ctypes.c_int64), ("bits", ctypes.c_int32), ("group", ctypes.c_int32),
                ("groups_per_super", ctypes.c_int32), ("zero", ctypes.c_int32), ("x_block", ctypes.c_int32),
                ("codes", ctypes.c_void_p), ("high", ctypes.c_void_p), ("super_scales", ctypes.c_void_p), ("sub_scales", ctypes.c_void_p),
                ("super_mins", ctypes.c_void_p), ("sub_mins", ctypes.c_void_p), ("levels", ctypes.c_void_p),
                ("level_scale", ctypes.c_float)]


class Factors(ctypes.Structure):
    """``ls_factors``: an [n, width] array of one dtype (data 0: absent)."""

    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("width", ctypes.c_int64)]


class QuantWeightDesc(ctypes.Structure):
    """``ls_quant_weight``."""

    _fields_ = [("n", ctypes.c_int64), ("k", ctypes.c_int64), ("bits", ctypes.c_int32), ("group_size", ctypes.c_int32),
                ("groups_per_super", ctypes.c_int32), ("mins", ctypes.c_int32), ("codes", ctypes.c_void_p),
                ("scales", Factors), ("offsets", Factors), ("super_scales", Factors), ("super_offsets", Factors)]


class LinearDesc(ctypes.Structure):
    """``ls_linear``: up to four weights side by side."""

    _fields_ = [("parts", ctypes.c_int32), ("tiled", ctypes.POINTER(TiledWeightDesc) * 4), ("dense", ctypes.c_void_p * 4),
                ("n", ctypes.c_int64 * 4), ("bias", ctypes.c_void_p)]


class MoeDesc(ctypes.Structure):
    """``ls_moe``."""

    _fields_ = [("router", LinearDesc), ("experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
                ("intermediate", ctypes.c_int64), ("renormalize", ctypes.c_int32), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p)]


class DecoderLayerDesc(ctypes.Structure):
    """``ls_decoder_layer``."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("qkv", LinearDesc), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("o", LinearDesc), ("attn_out_norm", ctypes.c_void_p),
                ("pre_mlp_norm", ctypes.c_void_p), ("gate_up", LinearDesc), ("down", LinearDesc),
                ("mlp_out_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("kv_type", ctypes.c_int32), ("scale", ctypes.c_float), ("window", ctypes.c_int64), ("softcap", ctypes.c_float),
                ("sinks", ctypes.c_void_p), ("rope", ctypes.c_int32), ("activation", ctypes.c_int32),
                ("residual_scale", ctypes.c_float), ("moe", ctypes.POINTER(MoeDesc))]


class DecoderShapeDesc(ctypes.Structure):
    """``ls_decoder_shape``."""

    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("rotary_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("eps", ctypes.c_float)]


class DecoderBatchDesc(ctypes.Structure):
    """``ls_decoder_batch``."""

    _fields_ = [("tokens", ctypes.c_int64), ("cos", ctypes.c_void_p * 2), ("sin", ctypes.c_void_p * 2),
                ("slot_mapping", ctypes.c_void_p), ("block_size", ctypes.c_int64), ("block_tables", ctypes.c_void_p),
                ("max_blocks", ctypes.c_int64), ("query_start", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p),
                ("batch", ctypes.c_int64)]


_SIGNATURES = {
    "ls_variant": (ctypes.c_char_p, []),
    "ls_lanes": (ctypes.c_int32, []),
    "ls_set_threads": (None, [ctypes.c_int32]),
    "ls_int8_matmul": (None, [ctypes.POINTER(TiledWeightDesc), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]),
    "ls_grouped_int8_matmul": (None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p]),
    "ls_tiled_dequantize_rows": (None, [ctypes.POINTER(TiledWeightDesc), ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_void_p]),
    "ls_float_matmul": (None, [ctypes.POINTER(QuantWeightDesc), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]),
    "ls_dense_matmul": (None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p]),
    "ls_decoder_layers": (None, [ctypes.POINTER(DecoderShapeDesc), ctypes.POINTER(DecoderLayerDesc), ctypes.c_int64,
                                 ctypes.POINTER(DecoderBatchDesc), ctypes.c_void_p, ctypes.c_void_p]),
    "ls_decoder_profile": (None, [ctypes.c_int32, ctypes.c_void_p]),
    "ls_argmax_rows": (None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]),
    "ls_sample_rows": (None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]),
    "ls_paged_attention": (None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64,
                                  ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]),
}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def library_path(variant: str) -> Path:
    return Path(__file__).parent / f"_cpu_{variant}.so"


def choose_variant(flags: set[str], built: set[str]) -> str | None:
    """The best built library whose instructions are all among ``flags``."""
    return next((name for name, needs in VARIANTS.items() if name in built and set(needs) <= flags), None)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The best library for this CPU, loaded once (None: none usable). Whether an engine
    uses it is its choice (kernels/dispatch.py)."""
    built = {name for name in VARIANTS if library_path(name).is_file()}
    variant = choose_variant(cpu_flags(), built)
    if variant is None:
        log.warning("no compiled CPU kernels for this CPU (built: %s); using the slower torch references. "
                    "Reinstall localserve with a C++ compiler (g++ or clang++) present to build them.",
                    ", ".join(sorted(built)) or "none")
        return None
    lib = load(variant)
    lib.ls_set_threads(_threads())
    return lib


def load(variant: str) -> ctypes.CDLL:
    """One library by name, with its functions' signatures (the tests load each variant)."""
    lib = ctypes.CDLL(str(library_path(variant)))
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def available() -> bool:
    return library() is not None


def set_threads(count: int) -> None:
    """The kernels' thread count (``--threads``); torch's intra-op pool gets the same."""
    import torch

    torch.set_num_threads(count)
    if (lib := library()) is not None:
        lib.ls_set_threads(count)


def variant() -> str | None:
    lib = library()
    return None if lib is None else lib.ls_variant().decode()


def lanes() -> int:
    lib = library()
    assert lib is not None
    return int(lib.ls_lanes())
