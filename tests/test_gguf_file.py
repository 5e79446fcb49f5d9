"""GGUF container parser: real files and gguf-py-written files agree with gguf-py's
GGUFReader (an independent reference); malformed files raise LocalserveError and nothing else."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from localserve.errors import LocalserveError
from localserve.formats.gguf_file import GGML_TYPES, GGUFFile, read_gguf

from .conftest import DATA

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError:  # only the reference comparisons need gguf-py
    gguf = None
try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:
    st = None

needs_gguf = pytest.mark.skipif(gguf is None, reason="gguf-py (the reference reader/writer) is not installed")

STORIES = DATA / "models" / "stories260K.gguf"
VOCABS = sorted((DATA / "tokenizers").glob("ggml-vocab-*.gguf"))

# GGUF metadata value type ids
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)


# -- reference: gguf-py's reader ------------------------------------------------------


def reference(path: Path) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int, bytes]]]:
    reader = gguf.GGUFReader(path)
    metadata = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = [
        (t.name, tuple(reversed([int(d) for d in t.shape])), int(t.tensor_type), int(t.data_offset),
         np.asarray(t.data).tobytes())
        for t in reader.tensors
    ]
    return metadata, tensors


def assert_matches_reference(path: Path, skip_keys: tuple[str, ...] = ()) -> GGUFFile:
    ours = read_gguf(path)
    ref_meta, ref_tensors = reference(path)
    assert list(ours.metadata) == list(ref_meta)
    for key, value in ref_meta.items():
        if key not in skip_keys:
            assert ours.metadata[key] == value, key
    assert list(ours.tensors) == [t[0] for t in ref_tensors]
    for name, shape, ggml_type, offset, data in ref_tensors:
        info = ours.tensors[name]
        assert (info.shape, info.ggml_type, info.offset) == (shape, ggml_type, offset), name
        assert info.type_name == QT(ggml_type).name
        assert info.nbytes == len(data)
        assert ours.tensor_bytes(name).tobytes() == data, name
    return ours


@needs_gguf
def test_type_table_matches_gguf_py() -> None:
    for type_id, (name, block, size) in GGML_TYPES.items():
        assert QT(type_id).name == name
        assert gguf.GGML_QUANT_SIZES[QT(type_id)] == (block, size), name


@needs_gguf
def test_stories_matches_reference() -> None:
    ours = assert_matches_reference(STORIES)
    assert ours.version == 3
    assert ours.metadata["general.architecture"] == "llama"
    assert ours.tensors["token_embd.weight"].shape == (512, 64)
    view = ours.tensor_bytes("token_embd.weight")
    # Zero-copy view into the read-only map, not a copy.
    assert view.dtype == np.uint8 and not view.flags.writeable and not view.flags.owndata
    ours.close()
    assert view.view(np.float32).shape == (512 * 64,)  # the view keeps the mapping alive
    with pytest.raises(LocalserveError, match="closed"):
        ours.tensor_bytes("token_embd.weight")


@needs_gguf
@pytest.mark.parametrize("path", VOCABS, ids=lambda p: p.stem)
def test_vocab_files_match_reference(path: Path) -> None:
    ours = assert_matches_reference(path)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) >= 32000
    assert not ours.tensors


# -- files written by gguf-py's writer --------------------------------------------------


def write_with_gguf_py(path: Path, alignment: int | None = None) -> dict:
    rng = np.random.default_rng(0)
    weights = {
        "f32": rng.standard_normal((3, 8)).astype(np.float32),
        "f16": rng.standard_normal((5, 16)).astype(np.float32),
        "q8": rng.standard_normal((4, 64)).astype(np.float32),
        "q4": rng.standard_normal((2, 3, 32)).astype(np.float32),
        "vec": rng.standard_normal((7,)).astype(np.float32),
    }
    types = {"f32": QT.F32, "f16": QT.F16, "q8": QT.Q8_0, "q4": QT.Q4_0, "vec": QT.F32}
    writer = gguf.GGUFWriter(path, arch="llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint32("llama.block_count", 2)
    writer.add_int32("test.int32", -7)
    writer.add_uint64("test.uint64", 2**64 - 1)
    writer.add_int64("test.int64", -(2**63))
    writer.add_float32("test.f32", 0.1)
    writer.add_float64("test.f64", 0.1)
    writer.add_bool("test.bool", True)
    writer.add_string("test.unicode", "héllo ▁wörld 🙂")
    writer.add_array("test.strings", ["a", "", "<0x0A>", "Ġthe"])
    writer.add_array("test.floats", [1.5, -2.25])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_array("test.nested", [[1, 2], [3]])
    for name, data in weights.items():
        quantized = gguf.quants.quantize(data, types[name])
        writer.add_tensor(name, quantized, raw_dtype=types[name] if types[name] not in (QT.F32, QT.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: (data.shape, types[name]) for name, data in weights.items()}


@needs_gguf
@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_gguf_py_written_file(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "w.gguf"
    expected = write_with_gguf_py(path, alignment)
    # gguf-py's reader cannot return nested arrays' contents; checked directly below.
    ours = assert_matches_reference(path, skip_keys=("test.nested",))
    assert ours.alignment == (alignment or 32)
    assert ours.metadata["test.nested"] == [[1, 2], [3]]
    assert ours.metadata["test.uint64"] == 2**64 - 1 and ours.metadata["test.int64"] == -(2**63)
    assert ours.metadata["test.f32"] == float(np.float32(0.1)) and ours.metadata["test.f64"] == 0.1
    assert ours.metadata["test.unicode"] == "héllo ▁wörld 🙂"
    for name, (shape, ggml_type) in expected.items():
        info = ours.tensors[name]
        assert info.shape == shape and info.ggml_type == ggml_type
        assert info.offset % ours.alignment == 0
        data = ours.tensor_bytes(name)
        restored = gguf.quants.dequantize(data.reshape(shape[:-1] + (-1,)), QT(ggml_type))
        assert restored.shape == shape


@needs_gguf
def test_big_endian_gguf_py_file_rejected(tmp_path: Path) -> None:
    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(path, arch="llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_uint32("llama.block_count", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LocalserveError, match="big-endian"):
        read_gguf(path)


# -- a precise byte-level writer for malformed files ----------------------------------


def u32(x: int) -> bytes:
    return struct.pack("<I", x)


def u64(x: int) -> bytes:
    return struct.pack("<Q", x)


def string(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return u64(len(raw) if length is None else length) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return string(key) + u32(vtype) + payload


def array(etype: int, items: list[bytes], count: int | None = None) -> bytes:
    return u32(etype) + u64(len(items) if count is None else count) + b"".join(items)


def tensor_info(name: str, ne: list[int], ggml_type: int, offset: int) -> bytes:
    return string(name) + u32(len(ne)) + b"".join(u64(d) for d in ne) + u32(ggml_type) + u64(offset)


def build(
    kvs: list[bytes], infos: list[bytes], data: bytes = b"", *, version: int = 3, magic: bytes = b"GGUF",
    alignment: int = 32, n_tensors: int | None = None, n_kv: int | None = None,
) -> bytes:
    head = magic + u32(version) + u64(len(infos) if n_tensors is None else n_tensors)
    head += u64(len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    return body + b"\0" * (-len(body) % alignment) + data


VALID_KVS = [
    kv("general.architecture", STR, string("llama")),
    kv("tokenizer.ggml.tokens", ARR, array(STR, [string("<unk>"), string("a"), string("▁b")])),
    kv("tokenizer.ggml.scores", ARR, array(F32, [struct.pack("<f", x) for x in (0.0, -1.5, 2.0)])),
    kv("test.flags", ARR, array(BOOL, [b"\x01", b"\x00"])),
    kv("test.nested", ARR, array(ARR, [array(U8, [b"\x05"]), array(STR, [string("x")])])),
    kv("llama.block_count", U32, u32(2)),
]
# "a": F32 2 rows of 4 (32 bytes at 0); "b": Q8_0 one row of 32 (34 bytes at 32), ending the file.
VALID_INFOS = [tensor_info("a", [4, 2], 0, 0), tensor_info("b", [32, 1], 8, 32)]
VALID_DATA = np.arange(8, dtype="<f4").tobytes() + bytes(range(34))


def valid_file() -> bytes:
    return build(VALID_KVS, VALID_INFOS, VALID_DATA)


def write(tmp_path: Path, blob: bytes, name: str = "t.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


@needs_gguf
def test_byte_writer_valid_file(tmp_path: Path) -> None:
    path = write(tmp_path, valid_file())
    ours = read_gguf(path)
    assert ours.metadata == {
        "general.architecture": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "a", "▁b"],
        "tokenizer.ggml.scores": [0.0, -1.5, 2.0],
        "test.flags": [True, False],
        "test.nested": [[5], ["x"]],
        "llama.block_count": 2,
    }
    assert ours.tensors["a"].shape == (2, 4) and ours.tensors["b"].shape == (1, 32)
    assert ours.tensors["b"].type_name == "Q8_0" and ours.tensors["b"].nbytes == 34
    assert ours.tensor_bytes("a").view("<f4").tolist() == list(range(8))
    assert ours.tensor_bytes("b").tobytes() == bytes(range(34))
    assert assert_matches_reference(path, skip_keys=("test.nested",)).data_offset == ours.data_offset


def test_every_scalar_value_type_and_version_2(tmp_path: Path) -> None:
    kvs = [
        kv("u8", U8, b"\xff"), kv("i8", I8, b"\xff"), kv("u16", U16, struct.pack("<H", 65535)),
        kv("i16", I16, struct.pack("<h", -2)), kv("u32", U32, u32(2**32 - 1)),
        kv("i32", I32, struct.pack("<i", -3)), kv("f32", F32, struct.pack("<f", 0.5)),
        kv("b", BOOL, b"\x00"), kv("s", STR, string("")), kv("u64", U64, u64(2**64 - 1)),
        kv("i64", I64, struct.pack("<q", -4)), kv("f64", F64, struct.pack("<d", -0.25)),
        kv("empty", ARR, array(I64, [])),
    ]
    ours = read_gguf(write(tmp_path, build(kvs, [], version=2)))
    assert ours.version == 2
    assert ours.metadata == {
        "u8": 255, "i8": -1, "u16": 65535, "i16": -2, "u32": 2**32 - 1, "i32": -3, "f32": 0.5,
        "b": False, "s": "", "u64": 2**64 - 1, "i64": -4, "f64": -0.25, "empty": [],
    }
    assert [type(v) for v in ours.metadata.values()] == [int] * 6 + [float, bool, str, int, int, float, list]


def test_unknown_tensor_type_fails_only_when_requested(tmp_path: Path) -> None:
    blob = build([], [tensor_info("a", [4], 0, 0), tensor_info("weird", [7, 3], 123, 32)], bytes(64))
    ours = read_gguf(write(tmp_path, blob))
    info = ours.tensors["weird"]
    assert (info.type_name, info.nbytes, info.shape) == ("type 123", None, (3, 7))
    assert ours.tensor_bytes("a").nbytes == 16
    with pytest.raises(LocalserveError, match="'weird'.*type 123"):
        ours.tensor_bytes("weird")
    with pytest.raises(LocalserveError, match="no tensor named"):
        ours.tensor_bytes("missing")


def test_zero_dimensional_tensor_is_a_scalar(tmp_path: Path) -> None:
    ours = read_gguf(write(tmp_path, build([], [tensor_info("s", [], 0, 0)], bytes(4))))
    assert ours.tensors["s"].shape == () and ours.tensors["s"].nbytes == 4


def test_every_truncation_is_rejected(tmp_path: Path) -> None:
    blob = valid_file()
    path = tmp_path / "cut.gguf"
    for cut in range(len(blob)):
        path.write_bytes(blob[:cut])
        with pytest.raises(LocalserveError):
            read_gguf(path)


BIG = 2**60
# (id, file bytes, message pattern)
MALFORMED: list[tuple[str, Callable[[], bytes], str]] = [
    ("empty", lambda: b"", "empty"),
    ("short-magic", lambda: b"GG", "not a GGUF"),
    ("bad-magic", lambda: b"GGML" + valid_file()[4:], "not a GGUF"),
    ("version-1", lambda: build(VALID_KVS, VALID_INFOS, VALID_DATA, version=1), "version 1"),
    ("version-99", lambda: build(VALID_KVS, VALID_INFOS, VALID_DATA, version=99), "version 99"),
    ("big-endian", lambda: b"GGUF" + struct.pack(">I", 3) + struct.pack(">QQ", 0, 0), "big-endian"),
    ("tensor-count-huge", lambda: build(VALID_KVS, VALID_INFOS, VALID_DATA, n_tensors=BIG), "more than"),
    ("metadata-count-huge", lambda: build(VALID_KVS, VALID_INFOS, VALID_DATA, n_kv=BIG), "more than"),
    ("metadata-count-too-many", lambda: build(VALID_KVS, [], n_kv=len(VALID_KVS) + 1, alignment=1), "truncated"),
    ("key-length-huge", lambda: build([string("k", 2**63) + u32(U8) + b"\0"], []), "limit"),
    ("key-longer-than-file", lambda: build([string("key", 1000) + u32(U8) + b"\0"], []), "truncated"),
    ("value-string-longer-than-file", lambda: build([kv("k", STR, string("v", 10**6))], []), "truncated"),
    ("value-string-huge", lambda: build([kv("k", STR, string("v", 2**62))], []), "limit"),
    ("array-length-huge", lambda: build([kv("k", ARR, array(U32, [u32(1)], count=2**62))], []), "limit"),
    ("array-longer-than-file", lambda: build([kv("k", ARR, array(STR, [string("x")], count=10**6))], []),
     "does not fit"),
    ("array-string-longer-than-file",
     lambda: build([kv("k", ARR, array(STR, [string("x"), string("y", 10**6)]))], []), "string #1 of 'k'"),
    ("array-string-huge", lambda: build([kv("k", ARR, array(STR, [string("y", 2**62)]))], []), "limit"),
    ("array-string-invalid-utf8",
     lambda: build([kv("k", ARR, array(STR, [string("ok"), string(b"\xc3(")]))], []), "string #1 .*UTF-8"),
    ("array-string-length-truncated",
     lambda: build([kv("k", ARR, array(STR, [string("abcdefghij"), u64(1)[:4]], count=2))], [], alignment=1),
     "length of string #1 of 'k'"),
    ("nested-array-too-deep", lambda: build([kv("k", ARR, _deep_array(50))], []), "deeper"),
    ("nested-array-count", lambda: build([kv("k", ARR, array(ARR, [array(U8, [])], count=10**5))], []),
     "does not fit"),
    ("array-unknown-element-type", lambda: build([kv("k", ARR, array(13, [b"\0"]))], []), "unknown value type 13"),
    ("unknown-value-type", lambda: build([kv("k", 13, b"\0" * 8)], []), "unknown value type 13"),
    ("unknown-value-type-huge", lambda: build([kv("k", 2**31, b"\0" * 8)], []), "unknown value type"),
    ("duplicate-key", lambda: build([kv("k", U8, b"\1"), kv("k", U8, b"\2")], []), "appears twice"),
    ("empty-key", lambda: build([kv("", U8, b"\1")], []), "empty"),
    ("invalid-utf8-key", lambda: build([kv(b"k\xff", U8, b"\1")], []), "UTF-8"),
    ("invalid-utf8-value", lambda: build([kv("k", STR, string(b"\xc3("))], []), "UTF-8"),
    ("bool-not-0-or-1", lambda: build([kv("k", BOOL, b"\x02")], []), "bool"),
    ("bool-array-not-0-or-1", lambda: build([kv("k", ARR, array(BOOL, [b"\1", b"\7"]))], []), "bool"),
    ("duplicate-tensor", lambda: build([], [tensor_info("a", [4], 0, 0), tensor_info("a", [4], 0, 32)],
                                       bytes(64)), "appears twice"),
    ("too-many-dims", lambda: build([], [tensor_info("a", [1] * 5, 0, 0)], bytes(32)), "5 dimensions"),
    ("absurd-dims", lambda: build([], [string("a") + u32(2**31)], bytes(32)), "dimensions"),
    ("dimension-zero", lambda: build([], [tensor_info("a", [4, 0], 0, 0)], bytes(32)), "dimension 1 is 0"),
    ("dimension-over-int64", lambda: build([], [tensor_info("a", [2**64 - 1], 0, 0)], bytes(32)), "dimension 0"),
    ("size-overflow", lambda: build([], [tensor_info("a", [2**62, 2**62, 2**62, 2**62], 0, 0)], bytes(32)),
     "too many"),
    ("size-past-end", lambda: build([], [tensor_info("a", [2**20, 2**20], 0, 0)], bytes(32)), "past the end"),
    ("offset-past-end", lambda: build([], [tensor_info("a", [4], 0, 2**40)], bytes(32)), "past the end"),
    ("offset-plus-size-past-end", lambda: build([], [tensor_info("a", [4], 0, 32)], bytes(40)), "past the end"),
    ("data-truncated", lambda: valid_file()[:-1], "past the end"),
    ("misaligned-offset", lambda: build([], [tensor_info("a", [4], 0, 4)], bytes(32)),
     "not a multiple of the alignment"),
    ("row-not-multiple-of-block", lambda: build([], [tensor_info("a", [30, 2], 8, 0)], bytes(96)), "block size 32"),
    ("alignment-0", lambda: build([kv("general.alignment", U32, u32(0))], []), "power of two"),
    ("alignment-3", lambda: build([kv("general.alignment", U32, u32(3))], [], alignment=3), "power of two"),
    ("alignment-uint64", lambda: build([kv("general.alignment", U64, u64(32))], []), "expected uint32"),
    ("alignment-string", lambda: build([kv("general.alignment", STR, string("32"))], []), "expected uint32"),
    ("tensor-name-longer-than-file", lambda: build([], [string("a", 500)], bytes(32)), "truncated"),
    ("tensor-infos-truncated", lambda: build([], VALID_INFOS, alignment=1)[:-10], "truncated"),
]


def _deep_array(depth: int) -> bytes:
    inner = array(U8, [b"\1"])
    for _ in range(depth):
        inner = array(ARR, [inner])
    return inner


@pytest.mark.parametrize(("make", "pattern"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_file_rejected(tmp_path: Path, make: Callable[[], bytes], pattern: str) -> None:
    path = write(tmp_path, make())
    with pytest.raises(LocalserveError, match=pattern) as info:
        read_gguf(path)
    assert str(path) in str(info.value)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(LocalserveError, match="cannot read"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(LocalserveError, match="cannot read"):
        read_gguf(tmp_path)


# -- fuzz ---------------------------------------------------------------------------------

if st is None:

    @pytest.mark.skip(reason="hypothesis is not installed")
    def test_fuzz_only_localserve_errors() -> None:
        pass

else:
    _POSITION = st.integers(min_value=0, max_value=2**16)
    _MUTATION = st.one_of(
        st.tuples(st.just("flip"), _POSITION, st.integers(1, 255)),
        st.tuples(st.just("truncate"), _POSITION),
        st.tuples(st.just("insert"), _POSITION, st.binary(min_size=1, max_size=12)),
        st.tuples(st.just("delete"), _POSITION, st.integers(1, 12)),
        # Interesting 64-bit values dropped onto counts, lengths, dims and offsets.
        st.tuples(st.just("put64"), _POSITION,
                  st.sampled_from([0, 1, 3, 31, 33, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1])),
    )

    def _mutate(blob: bytes, mutations: list[tuple]) -> bytes:
        data = bytearray(blob)
        for kind, position, *arg in mutations:
            at = position % (len(data) + 1)
            if kind == "flip" and at < len(data):
                data[at] ^= arg[0]
            elif kind == "truncate":
                del data[at:]
            elif kind == "insert":
                data[at:at] = arg[0]
            elif kind == "delete":
                del data[at:at + arg[0]]
            elif kind == "put64":
                data[at:at + 8] = u64(arg[0])
        return bytes(data)

    @pytest.fixture(scope="module")
    def fuzz_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tmp_path_factory.mktemp("fuzz") / "f.gguf"

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mutations=st.lists(_MUTATION, min_size=1, max_size=4))
    def test_fuzz_only_localserve_errors(fuzz_path: Path, mutations: list[tuple]) -> None:
        fuzz_path.write_bytes(_mutate(valid_file(), mutations))
        try:
            parsed = read_gguf(fuzz_path)
        except LocalserveError:
            return
        with parsed:
            for name, info in parsed.tensors.items():
                try:
                    view = parsed.tensor_bytes(name)
                except LocalserveError:
                    assert info.nbytes is None
                    continue
                assert view.nbytes == info.nbytes and info.offset + info.nbytes <= fuzz_path.stat().st_size
