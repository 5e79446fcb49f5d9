"""llama.cpp's vision projector files (``mmproj-*.gguf``, ``general.architecture`` ``clip``):
which GGUF file of a folder is the model and which its projector, what the projector
says about its image side (read in vision/config.py) and its tensors' names under
localserve's vision models (vision/gemma3.py, qwen_vl.py, qwen3_vl.py), without torch.

llama.cpp keeps a multimodal model in two files: the text model, and the vision tower
with its projector in a file of its own that ``llama-server --mmproj`` names. localserve
reads such a pair from one folder (the registry links a pulled pair into the model's
folder; ``--mmproj`` makes such a folder of links), so one path still names one model.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import LocalserveError
from .gguf_file import GGUFFile, read_gguf, split_paths

ARCHITECTURE = "clip"  # what llama.cpp's converter writes as a projector's general.architecture
# Projector types (clip.projector_type) localserve reads, by the model family they serve.
SUPPORTED_TYPES = {"gemma3": "Gemma 3", "qwen2.5vl_merger": "Qwen2.5-VL", "qwen3vl_merger": "Qwen3-VL"}

# A later shard of a split model (llama.cpp's <prefix>-00002-of-00003.gguf): part of the first.
_LATER_SHARD = re.compile(r".*-(\d{5})-of-\d{5}\.gguf", re.IGNORECASE)

# Gemma 3's projector file -> localserve's vision model (vision/gemma3.py), as llama.cpp's
# converter names the tensors of transformers' SigLIP tower and Gemma 3's projector.
_TOWER_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_TOWER_LAYER_NAME = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
_GEMMA3_NAMES = {
    "v.patch_embd.weight": "tower.embeddings.patch_embedding.weight",
    "v.patch_embd.bias": "tower.embeddings.patch_embedding.bias",
    "v.position_embd.weight": "tower.embeddings.position_embedding.weight",
    "v.post_ln.weight": "tower.post_layernorm.weight",
    "v.post_ln.bias": "tower.post_layernorm.bias",
    "mm.input_projection.weight": "projector.mm_input_projection_weight",  # stored [vision, text], as HF's
    "mm.soft_emb_norm.weight": "projector.mm_soft_emb_norm.weight",
}
# The converter stores Gemma's (1 + weight) norm as 1 + weight; the vision model keeps weight.
SHIFTED_BY_ONE = {"mm.soft_emb_norm.weight"}

# Qwen2.5-VL's projector file -> its tower's names (vision/qwen_vl.py: the checkpoint's below
# ``visual.``). The converter splits the fused q/k/v projection in three and the Conv3d's two
# frames in two 2-D kernels (``v.patch_embd.weight`` and ``.weight.1``): ``vision_name`` says
# which piece of the whole each tensor is, ``joined`` how the pieces go back together.
_QWEN25_LAYER = {"attn_q": ("attn.qkv", 0), "attn_k": ("attn.qkv", 1), "attn_v": ("attn.qkv", 2),
                 "attn_out": ("attn.proj", 0), "ln1": ("norm1", 0), "ln2": ("norm2", 0),
                 "ffn_gate": ("mlp.gate_proj", 0), "ffn_up": ("mlp.up_proj", 0), "ffn_down": ("mlp.down_proj", 0)}
_QWEN25_NAMES = {
    "v.patch_embd.weight": ("patch_embed.proj.weight", 0), "v.patch_embd.weight.1": ("patch_embed.proj.weight", 1),
    "v.post_ln.weight": ("merger.ln_q.weight", 0),
    "mm.0.weight": ("merger.mlp.0.weight", 0), "mm.0.bias": ("merger.mlp.0.bias", 0),
    "mm.2.weight": ("merger.mlp.2.weight", 0), "mm.2.bias": ("merger.mlp.2.bias", 0),
}
# Qwen3-VL's projector file -> its tower's names (vision/qwen3_vl.py), as the converter's
# Qwen3VLVisionModel names them: q/k/v stay fused, the Conv3d's frames are split as above,
# the main merger's norm is ``v.post_ln`` and its two layers ``mm.0`` and ``mm.2``.
_QWEN3_LAYER = {"attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2",
                "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_QWEN3_NAMES = {
    "v.patch_embd.weight": ("patch_embed.proj.weight", 0), "v.patch_embd.weight.1": ("patch_embed.proj.weight", 1),
    "v.patch_embd.bias": ("patch_embed.proj.bias", 0), "v.position_embd.weight": ("pos_embed.weight", 0),
    "v.post_ln.weight": ("merger.norm.weight", 0), "v.post_ln.bias": ("merger.norm.bias", 0),
    "mm.0.weight": ("merger.linear_fc1.weight", 0), "mm.0.bias": ("merger.linear_fc1.bias", 0),
    "mm.2.weight": ("merger.linear_fc2.weight", 0), "mm.2.bias": ("merger.linear_fc2.bias", 0),
}
# A deepstack merger is numbered by the tower block it reads (``v.deepstack.<block>.*``), the
# vision model's by its place among those blocks (``deepstack_blocks``).
_DEEPSTACK_NAME = re.compile(r"v\.deepstack\.(\d+)\.(norm|fc1|fc2)\.(weight|bias)")
_DEEPSTACK_PART = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
# How each projector type's split tensors join: along a dimension (Qwen2.5-VL's q, k and v
# rows), or stacked as a new one (the patch kernel's frames).
_JOINED = {
    "gemma3": {},
    "qwen2.5vl_merger": {"attn.qkv.weight": ("cat", 0), "attn.qkv.bias": ("cat", 0),
                         "patch_embed.proj.weight": ("stack", 2)},
    "qwen3vl_merger": {"patch_embed.proj.weight": ("stack", 2)},
}


def joined(name: str, kind: str) -> tuple[str, int] | None:
    """How the pieces of ``vision_name``'s ``name`` join in a projector of type ``kind``:
    ("cat" or "stack", dimension); None for a tensor held whole."""
    return next((how for suffix, how in _JOINED[kind].items() if name.endswith(suffix)), None)


def is_projector(gguf: GGUFFile) -> bool:
    return gguf.metadata.get("general.architecture") == ARCHITECTURE


def projector_type(gguf: GGUFFile) -> str:
    """The projector's family (``clip.projector_type``; files that hold audio too name the
    vision one ``clip.vision.projector_type``); refused unless localserve reads it."""
    kind = gguf.metadata.get("clip.vision.projector_type", gguf.metadata.get("clip.projector_type"))
    if kind not in SUPPORTED_TYPES:
        raise LocalserveError(f"{gguf.path}: a vision projector of type {kind!r}, which localserve does not read "
                              f"(it reads {', '.join(f'{t} ({f})' for t, f in SUPPORTED_TYPES.items())})")
    if gguf.metadata.get("clip.has_vision_encoder") is not True:
        raise LocalserveError(f"{gguf.path}: the projector file has no vision encoder")
    return kind


def vision_name(name: str, kind: str, deepstack: tuple[int, ...] = ()) -> tuple[str, int] | None:
    """The vision model's name for a projector file's tensor, and which piece of it the
    tensor is (0 but for the pieces ``joined`` puts together); None: not one it has.
    ``deepstack``: the file's ``deepstack_blocks`` (Qwen3-VL)."""
    match = _TOWER_LAYER_NAME.fullmatch(name)
    if kind == "gemma3":
        if name in _GEMMA3_NAMES:
            return _GEMMA3_NAMES[name], 0
        if match and match[2] in _TOWER_LAYER:
            return f"tower.encoder.layers.{match[1]}.{_TOWER_LAYER[match[2]]}.{match[3]}", 0
        return None
    if kind == "qwen3vl_merger":
        if name in _QWEN3_NAMES:
            return _QWEN3_NAMES[name]
        if match and match[2] in _QWEN3_LAYER:
            return f"blocks.{match[1]}.{_QWEN3_LAYER[match[2]]}.{match[3]}", 0
        if (merger := _DEEPSTACK_NAME.fullmatch(name)) and int(merger[1]) in deepstack:
            place = deepstack.index(int(merger[1]))
            return f"deepstack_merger_list.{place}.{_DEEPSTACK_PART[merger[2]]}.{merger[3]}", 0
        return None
    if name in _QWEN25_NAMES:
        return _QWEN25_NAMES[name]
    if match and match[2] in _QWEN25_LAYER:
        module, piece = _QWEN25_LAYER[match[2]]
        return f"blocks.{match[1]}.{module}.{match[3]}", piece
    return None


def deepstack_blocks(gguf: GGUFFile) -> tuple[int, ...]:
    """The tower blocks whose output also goes through a deepstack merger of its own, in
    order: found by their ``v.deepstack.<block>.*`` tensors, as llama.cpp finds them (the
    converter's ``clip.vision.is_deepstack_layers`` says the same)."""
    return tuple(sorted({int(match[1]) for name in gguf.tensors if (match := _DEEPSTACK_NAME.fullmatch(name))}))


def open_projector(path: Path) -> GGUFFile:
    """A projector file, parsed and checked to be one localserve reads."""
    gguf = read_gguf(path)
    try:
        if not is_projector(gguf):
            raise LocalserveError(f"{path}: not a vision projector (its general.architecture is "
                                  f"{gguf.metadata.get('general.architecture')!r}, not {ARCHITECTURE!r})")
        projector_type(gguf)
    except BaseException:
        gguf.close()
        raise
    return gguf


def gguf_folder_files(folder: Path) -> tuple[Path, Path | None] | None:
    """A folder's GGUF model file (a split model's first shard) and its projector file,
    told apart by their metadata; None when the folder holds no .gguf file. A folder with
    two models or two projectors is refused: which one is meant cannot be guessed."""
    candidates = sorted(entry for entry in folder.iterdir() if entry.suffix.lower() == ".gguf" and entry.is_file()
                        and not ((match := _LATER_SHARD.fullmatch(entry.name)) and match[1] != "00001"))
    if not candidates:
        return None
    models, projectors = [], []
    for path in candidates:
        with read_gguf(path) as gguf:
            (projectors if is_projector(gguf) else models).append(path)
    if len(models) != 1 or len(projectors) > 1:
        found = ", ".join(path.name for path in candidates)
        raise LocalserveError(f"{folder}: a folder of GGUF files must hold one model and at most one vision projector "
                              f"(found {found}); name the model's file instead")
    return models[0], projectors[0] if projectors else None


def pair_folder(model: Path, projector: Path, under: Path) -> Path:
    """A folder under ``under`` holding links to a GGUF model and its projector (what
    ``--mmproj`` names), so the pair opens as one model."""
    import hashlib
    import os

    model, projector = model.expanduser().resolve(), projector.expanduser().resolve()
    for path, what in ((model, "model"), (projector, "--mmproj")):
        if not path.is_file() or path.suffix.lower() != ".gguf":
            raise LocalserveError(f"{path}: the {what} must be a .gguf file")
    open_projector(projector).close()  # refused now, rather than at the model's load
    targets = [*split_paths(model), projector]  # every shard of a split model
    if len({target.name for target in targets}) != len(targets):
        raise LocalserveError(f"{model} and its projector {projector} have the same file name; rename one")
    key = hashlib.sha256(f"{model}\0{projector}".encode()).hexdigest()[:24]
    folder = under / f"mmproj-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    for target in targets:
        link = folder / target.name
        if link.is_symlink() and Path(os.readlink(link)) != target:
            link.unlink()
        if not link.is_symlink():
            os.symlink(target, link)
    return folder
