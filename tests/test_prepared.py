"""The prepared CPU layout (models/prepared.py, engine/prepared_store.py): a GGUF model's
converted weights stored after its first load and mapped at the next. The mapped model
must compute exactly what the converted one does; a file that does not fit (another source
version, a damaged or doctored file) must never be read into the kernels, only replaced."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from localserve import Engine, EngineConfig
from localserve.engine import prepared_store
from localserve.kernels import cpu_library
from localserve.models import prepared

from .conftest import random_prompt
from .gguf_writers import tiny_llama, write_gguf
from .test_models import all_logits

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the CPU kernels were not built")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
PROMPTS = [[1, *random_prompt(30, seed=8)]]


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("prepared") / "tiny-f32.gguf"
    write_gguf(path, tiny_llama(), Q.F32)
    return path


@pytest.fixture
def q4_k_m(tmp_path, tiny_f32):  # type: ignore[no-untyped-def]
    from .test_gguf_models import llama_cpp_quantize

    path = tmp_path / "tiny-Q4_K_M.gguf"
    llama_cpp_quantize(tiny_f32, path, "Q4_K_M")
    return path


def engine(path, folder, **options) -> Engine:  # type: ignore[no-untyped-def]
    return Engine(path, EngineConfig(num_kv_blocks=16, prepared_cache=str(folder), **options), device="cpu",
                  dtype=torch.float32)


def stored_files(folder) -> list:  # type: ignore[no-untyped-def]
    return sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []


def test_the_mapped_model_computes_what_the_converted_one_does(tmp_path, q4_k_m, monkeypatch, caplog) -> None:
    folder = tmp_path / "prepared"
    converted = all_logits(engine(q4_k_m, folder), PROMPTS)
    assert len(stored_files(folder)) == 1
    # The second load reads no checkpoint weights at all.
    from localserve import models

    monkeypatch.setattr(models, "build", lambda *a, **k: pytest.fail("the checkpoint was converted again"))
    with caplog.at_level(logging.INFO, logger="localserve.engine"):
        mapped = engine(q4_k_m, folder)
    assert "mapped from the prepared layout" in caplog.text
    assert any(len(layer.attn.qkv.weights) > 1 for layer in mapped.model.layers)  # Q4_K_M's mixed parts, kept
    assert torch.equal(all_logits(mapped, PROMPTS)[0], converted[0])


def resident_bytes_of(path) -> int:  # type: ignore[no-untyped-def]
    """Bytes of this process's mappings of ``path`` that are in its page tables (Linux)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_a_mapped_layout_is_faulted_in_behind_the_load(tmp_path, q4_k_m, monkeypatch) -> None:
    """After a mapped load a thread asks the kernel to put the weights' pages in the page
    tables, so that the first request does not fault them in one by one: every stored byte."""
    import threading

    folder = tmp_path / "prepared"
    engine(q4_k_m, folder)
    [name] = stored_files(folder)
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(prepared_store, "populate", asked.extend)
    mapped = engine(q4_k_m, folder)
    for thread in threading.enumerate():
        if thread.name == "prefault-weights":
            thread.join(timeout=60)
    covered = sum(length for _, length in asked)
    weights = sum(t.numel() * t.element_size() for t in prepared.mapped_tensors(mapped.model))
    assert weights >= 0.95 * (folder / name).stat().st_size  # the file is its tensors, less the header
    assert covered >= weights and all(start % prepared_store._PAGE == 0 for start, _ in asked)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc")
def test_populate_puts_a_mapping_in_the_page_tables(tmp_path) -> None:
    import mmap

    path = tmp_path / "pages.bin"
    path.write_bytes(os.urandom(1 << 20) * 32)  # 32 MiB
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) as mapping:
        view = torch.frombuffer(mapping, dtype=torch.uint8)
        assert resident_bytes_of(path) < (8 << 20)  # nothing touched it yet
        prepared_store.populate(prepared_store.page_ranges([view]))
        assert resident_bytes_of(path) >= (31 << 20)
        del view


def test_page_ranges_merge_neighbours() -> None:
    page = prepared_store._PAGE
    buffer = torch.zeros(8 * page, dtype=torch.uint8)
    base = buffer.data_ptr()
    ranges = prepared_store.page_ranges([buffer[10 : page + 5], buffer[page + 9 : 2 * page], buffer[5 * page + 1 :]])
    first = base - base % page
    assert ranges[0][0] == first and ranges[0][0] + ranges[0][1] >= base + 2 * page
    assert len(ranges) == 2 and ranges[1][0] <= base + 5 * page + 1 < ranges[1][0] + ranges[1][1]
    assert all(start % page == 0 and length % page == 0 for start, length in ranges)


def test_a_dense_model_maps_too(tmp_path, tiny_f32) -> None:
    folder = tmp_path / "prepared"
    converted = all_logits(engine(tiny_f32, folder), PROMPTS)
    assert torch.equal(all_logits(engine(tiny_f32, folder), PROMPTS)[0], converted[0])


def test_a_changed_source_is_prepared_again_and_the_old_layout_removed(tmp_path, q4_k_m) -> None:
    folder = tmp_path / "prepared"
    engine(q4_k_m, folder)
    [before] = stored_files(folder)
    stat = q4_k_m.stat()
    os.utime(q4_k_m, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    engine(q4_k_m, folder)
    [after] = stored_files(folder)
    assert after != before and after.split("-")[0] == before.split("-")[0]


def damage_truncated(path) -> None:  # type: ignore[no-untyped-def]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def damage_shape(path) -> None:  # type: ignore[no-untyped-def]
    """A well-formed file whose first tiled codes are one tile short: the kernel would
    read past them."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name).clone() for name in handle.keys()}
    name = next(n for n in tensors if n.endswith(".codes"))
    tensors[name] = tensors[name][1:].contiguous()
    save_file(tensors, str(path), metadata=metadata)


def damage_format(path) -> None:  # type: ignore[no-untyped-def]
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name).clone() for name in handle.keys()}
    save_file(tensors, str(path), metadata={"format": "something else"})


@pytest.mark.parametrize("damage", [damage_truncated, damage_shape, damage_format])
def test_a_layout_that_does_not_fit_is_converted_again(tmp_path, q4_k_m, caplog, damage) -> None:
    folder = tmp_path / "prepared"
    converted = all_logits(engine(q4_k_m, folder), PROMPTS)
    [name] = stored_files(folder)
    damage(folder / name)
    with caplog.at_level(logging.WARNING, logger="localserve.engine"):
        reloaded = engine(q4_k_m, folder)
    assert "does not fit" in caplog.text
    assert torch.equal(all_logits(reloaded, PROMPTS)[0], converted[0])
    # Stored again, whole: the next load maps it.
    with safe_open(str(folder / name), framework="pt") as handle:
        assert handle.metadata()["format"] == prepared.FORMAT


def test_what_is_not_stored(tmp_path, tiny_f32, tiny_models) -> None:
    assert stored_files(tmp_path) == []
    engine(tiny_f32, tmp_path / "exact", exact_cpu_matmul=True)  # QuantWeights kept for fp32 activations
    assert stored_files(tmp_path / "exact") == []
    Engine(tiny_f32, EngineConfig(num_kv_blocks=16), device="cpu", dtype=torch.float32)  # no folder: off
    moe, _ = tiny_models.get("mixtral")  # HF checkpoints load by mapping already
    engine(moe, tmp_path / "hf")
    assert stored_files(tmp_path / "hf") == []


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_mixtures_of_experts_map_too(tmp_path, monkeypatch, kind: str) -> None:
    """Tiled expert stacks (and a shared expert, and GPT-OSS's expert biases and sinks) are
    stored and mapped back; the mapped model computes exactly what the converted one does."""
    from localserve import models

    from .gguf_writers import tiny_gpt_oss, tiny_moe

    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, tiny_gpt_oss() if kind == "gpt_oss" else tiny_moe(kind), Q.Q8_0)
    folder = tmp_path / "prepared"
    converted = engine(path, folder)
    assert all(experts.mlp.tiled for _, experts in converted.model.experts())
    expected = all_logits(converted, PROMPTS)[0]
    assert len(stored_files(folder)) == 1
    monkeypatch.setattr(models, "build", lambda *a, **k: pytest.fail("the checkpoint was converted again"))
    mapped = engine(path, folder)
    assert all(experts.mlp.tiled for _, experts in mapped.model.experts())
    assert torch.equal(all_logits(mapped, PROMPTS)[0], expected)


def test_stored_experts_that_do_not_fit_are_converted_again(tmp_path, caplog) -> None:
    """An expert stack one expert short (a doctored or foreign file) never reaches the kernel."""
    from .gguf_writers import tiny_moe

    path = tmp_path / "moe.gguf"
    write_gguf(path, tiny_moe("qwen3_moe"), Q.Q8_0)
    folder = tmp_path / "prepared"
    expected = all_logits(engine(path, folder), PROMPTS)[0]
    [name] = stored_files(folder)
    with safe_open(str(folder / name), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key).clone() for key in handle.keys()}
    table = json.loads(metadata["experts"])
    layer = next(iter(table))
    table[layer]["down"]["out_features"] -= 256  # one expert fewer, tensors cut to match
    for key in [k for k in tensors if k.startswith(f"{layer}.down.")]:
        tensors[key] = tensors[key][: tensors[key].shape[0] * 3 // 4].contiguous()
    save_file(tensors, str(folder / name), metadata={**metadata, "experts": json.dumps(table)})
    with caplog.at_level(logging.WARNING, logger="localserve.engine"):
        reloaded = engine(path, folder)
    assert "does not fit" in caplog.text
    assert torch.equal(all_logits(reloaded, PROMPTS)[0], expected)


def test_layouts_of_removed_sources_are_pruned(tmp_path, tiny_f32) -> None:
    source = tmp_path / "copy.gguf"
    source.write_bytes(tiny_f32.read_bytes())
    folder = tmp_path / "prepared"
    engine(source, folder)
    (folder / "left-over.safetensors.partial").write_bytes(b"partial")
    source.unlink()
    engine(tiny_f32, folder)  # storing another model prunes the folder
    [kept] = stored_files(folder)
    assert not (folder / "left-over.safetensors.partial").exists()
    assert kept.split("-")[0] == prepared_store.path_for(folder, [tiny_f32], {}).name.split("-")[0]


def test_the_cli_keeps_layouts_under_the_home_unless_told_not_to(tmp_path, monkeypatch) -> None:
    from localserve.cli.main import engine_config

    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path))
    assert engine_config({"prepared_cache": True}).prepared_cache == str(tmp_path / "prepared")
    assert engine_config({"prepared_cache": False}).prepared_cache is None
