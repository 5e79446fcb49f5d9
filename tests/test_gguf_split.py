"""Split GGUF models (llama.cpp's gguf-split, ``<prefix>-0000i-of-0000N.gguf``): given the
first shard, localserve reads one model from all of them, like llama.cpp does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from localserve import Engine, EngineConfig, LocalserveError
from localserve.formats import open_checkpoint
from localserve.formats.gguf_file import read_gguf, split_paths
from localserve.formats.weights import tensor_sizes
from localserve.facts.checkpoint import model_info

from .conftest import random_prompt, relative_error
from .gguf_writers import split_gguf, tiny_llama, write_gguf
from .test_gguf_models import llama_cpp_logits
from .test_models import all_logits

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A tiny Q8_0 llama as one file and split into three shards beside it."""
    folder = tmp_path_factory.mktemp("split")
    single = folder / "single.gguf"
    write_gguf(single, tiny_llama(), gguf.GGMLQuantizationType.Q8_0)
    return single, split_gguf(single, folder / "tiny-q8_0.gguf", parts=3)


def test_split_model_reads_as_the_single_file(model_files) -> None:
    single, shards = model_files
    assert [p.name for p in shards] == [f"tiny-q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    with read_gguf(single) as one, read_gguf(shards[0]) as split:
        assert one.paths == [single]
        assert split.paths == shards
        assert {info.shard for info in split.tensors.values()} == {0, 1, 2}
        assert list(split.tensors) == list(one.tensors)
        for name, info in one.tensors.items():
            other = split.tensors[name]
            assert (other.shape, other.ggml_type, other.nbytes) == (info.shape, info.ggml_type, info.nbytes)
            assert split.tensor_bytes(name).tobytes() == one.tensor_bytes(name).tobytes(), name
        assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")} == one.metadata
        assert (split.metadata["split.count"], split.metadata["split.tensors.count"]) == (3, len(one.tensors))
    assert split_paths(shards[0]) == shards
    assert split_paths(single) == [single]


def test_close_releases_every_shard(model_files) -> None:
    split = read_gguf(model_files[1][0])
    buffers = list(split._buffers)
    last = next(name for name, info in split.tensors.items() if info.shard == 2)
    assert split.tensor_nbytes(last) == split.tensor_bytes(last).nbytes
    split.close()
    assert len(buffers) == 3 and all(buffer.closed for buffer in buffers)
    with pytest.raises(LocalserveError, match="closed"):
        split.tensor_bytes(last)


def test_split_logits_equal_single_file_and_llama_cpp(model_files) -> None:
    single, shards = model_files
    prompt = [1, *random_prompt(23, seed=7)]
    logits = []
    for path in (single, shards[0]):
        engine = Engine(path, EngineConfig(num_kv_blocks=16), device="cpu", dtype=torch.float32)
        logits.append(all_logits(engine, [prompt])[0])
    assert torch.equal(logits[0], logits[1])
    pytest.importorskip("llama_cpp")
    # llama.cpp loads a split model from its first shard too.
    assert relative_error(logits[1], llama_cpp_logits(shards[0], prompt)) <= 3e-2


def test_model_info_and_sizes_cover_all_shards(model_files) -> None:
    single, shards = model_files
    one, _ = model_info(single)
    split, lines = model_info(shards[0])
    differing = {key for key in one if one[key] != split[key]}
    assert differing == {"path", "file_bytes"}
    assert split["file_bytes"] == sum(p.stat().st_size for p in shards)
    assert dict(lines)["model"] == str(shards[0])
    sizes = [list(tensor_sizes(open_checkpoint(path), torch.float16)) for path in (single, shards[0])]
    assert sizes[0] == sizes[1]


# -- broken splits ----------------------------------------------------------------------


def write_shards(folder: Path, prefix: str, shards: list[list[str]], *, count: int | None = None,
                 numbers: list[int] | None = None, total: int | None = None) -> list[Path]:
    """Shards holding the named 32-float tensors, with split keys as given (by default
    the right ones), named ``<prefix>-0000i-of-0000N.gguf``."""
    count = len(shards) if count is None else count
    numbers = list(range(len(shards))) if numbers is None else numbers
    total = sum(len(names) for names in shards) if total is None else total
    paths = []
    for index, names in enumerate(shards):
        path = folder / f"{prefix}-{index + 1:05d}-of-{len(shards):05d}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_uint16("split.no", numbers[index])
        writer.add_uint16("split.count", count)
        writer.add_int32("split.tensors.count", total)
        for name in names:
            writer.add_tensor(name, np.full(32, index, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    return paths


def test_hand_written_split_reads(tmp_path) -> None:
    paths = write_shards(tmp_path, "m", [["a"], [], ["b", "c"]])
    with read_gguf(paths[0]) as split:
        assert split.paths == paths
        assert {name: split.tensor_bytes(name).view("<f4")[0] for name in split.tensors} == {"a": 0, "b": 2, "c": 2}
    # One file that says it is a split of one (gguf-split writes these) needs no siblings.
    [alone] = write_shards(tmp_path, "alone", [["a"]])
    renamed = alone.rename(tmp_path / "renamed.gguf")
    assert read_gguf(renamed).paths == [renamed]


def test_missing_shard(tmp_path) -> None:
    paths = write_shards(tmp_path, "m", [["a"], ["b"], ["c"]])
    paths[1].unlink()
    with pytest.raises(LocalserveError,
                       match=r"m-00001-of-00003\.gguf: shard 2 of 3 .* missing .*m-00002-of-00003\.gguf"):
        read_gguf(paths[0])


def test_non_first_shard_says_to_pass_the_first(tmp_path) -> None:
    paths = write_shards(tmp_path, "m", [["a"], ["b"], ["c"]])
    with pytest.raises(LocalserveError, match=r"m-00002-of-00003\.gguf: this is shard 2 of 3 .*"
                                              r"pass the first shard, m-00001-of-00003\.gguf"):
        open_checkpoint(paths[1])


def test_shard_with_wrong_split_no_or_count(tmp_path) -> None:
    paths = write_shards(tmp_path, "m", [["a"], ["b"], ["c"]], numbers=[0, 2, 2])
    with pytest.raises(LocalserveError, match=r"m-00002-of-00003\.gguf: expected shard 2 of 3 .*split\.no 2"):
        read_gguf(paths[0])
    other = write_shards(tmp_path, "n", [["a"], ["b"]])
    bad = write_shards(tmp_path, "bad", [["b"]], count=4)[0]
    bad.replace(other[1])
    with pytest.raises(LocalserveError, match=r"n-00002-of-00002\.gguf: .*split\.count 4"):
        read_gguf(other[0])


def test_duplicate_tensor_across_shards(tmp_path) -> None:
    paths = write_shards(tmp_path, "m", [["a", "b"], ["c"], ["b"]])
    with pytest.raises(LocalserveError,
                       match=r"m-00003-of-00003\.gguf: tensor 'b' is also in .*m-00001-of-00003\.gguf"):
        read_gguf(paths[0])


def test_tensor_count_mismatch(tmp_path) -> None:
    paths = write_shards(tmp_path, "m", [["a"], ["b"]], total=3)
    with pytest.raises(LocalserveError,
                       match=r"m-00001-of-00002\.gguf: .* hold 2 tensors, but split\.tensors\.count says 3"):
        read_gguf(paths[0])


def test_first_shard_must_be_named_for_its_siblings(tmp_path) -> None:
    first = write_shards(tmp_path, "m", [["a"], ["b"]])[0]
    renamed = first.rename(tmp_path / "model.gguf")
    with pytest.raises(LocalserveError, match=r"model\.gguf: .*named <prefix>-00001-of-00002\.gguf"):
        read_gguf(renamed)
