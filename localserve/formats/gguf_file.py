"""GGUF container parsing: header, metadata, tensor directory, memory-mapped tensor data.

Only the container is handled here: metadata becomes plain Python values and each tensor
becomes a ``GGUFTensorInfo`` plus a zero-copy view of its raw (possibly quantized) bytes.
Dequantization and the mapping of names onto a model live elsewhere.

Everything in the file is untrusted. Every count, length, dimension, offset and size is
checked against the file size before it is used, so a malformed or hostile file raises
``LocalserveError`` (naming the file and the problem) and never another exception type,
a huge allocation or a read past the end.

Decisions worth knowing:

* Versions 2 and 3 are read; version 1 (32-bit counts, 2023) and big-endian files are
  rejected with a message that says so.
* Strings are decoded as strict UTF-8. llama.cpp's converters write valid UTF-8
  everywhere (byte tokens are spelled ``<0xXX>``), so invalid UTF-8 means a damaged file.
* An unknown ggml type id does not fail the parse: the file can still be inspected
  (metadata, names, shapes), and newer llama.cpp types appear faster than readers learn
  them. Such a tensor gets ``type_name`` ``"type N"`` and ``nbytes`` ``None``; its offset is
  still checked (aligned, inside the file). ``tensor_nbytes`` / ``tensor_bytes`` raise
  ``LocalserveError`` naming the tensor and the type when one is asked for.
* Tensors may overlap or leave gaps in the data section: llama.cpp's writer never does
  that, but reading such a file is still safe, so it is not rejected here.
* Split models (llama.cpp's ``gguf-split``, gguf-py's ``split_max_tensors``): every shard
  is a complete GGUF file named ``<prefix>-%05d-of-%05d.gguf`` (1-based) and carries
  ``split.no`` (0-based), ``split.count`` and ``split.tensors.count`` (all shards' tensors);
  the first carries the model's metadata. ``read_gguf`` takes the first shard, as llama.cpp
  does, finds the others beside it by name, parses each like a single file and presents
  one model: the first shard's metadata, every shard's tensors, each read from its own
  file's memory map. The other shards' metadata is not kept.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LocalserveError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# ggml stores dimensions and element counts as int64.
MAX_INT64 = (1 << 63) - 1

# Caps that bound memory on top of the file-size checks. They are far above anything a
# real file needs (a 150k-token vocabulary with its merges, chat templates of tens of KiB)
# but keep a hostile file from asking for absurd objects.
MAX_KEY_BYTES = 65535
MAX_NAME_BYTES = 65535
MAX_STRING_BYTES = 16 << 20
MAX_ARRAY_ELEMENTS = 16 << 20
# Nested arrays are legal GGUF but unused in practice; the cap keeps recursion shallow.
MAX_ARRAY_DEPTH = 8

# The types localserve loads (formats/gguf_quants.py converts them): F32, F16, BF16, Q4_0,
# Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K ... Q6_K, MXFP4, the IQ types (IQ1_S ... IQ4_XS) and
# the ternary TQ1_0 and TQ2_0.
LOADABLE_TYPES = frozenset({0, 1, 30, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 39, 16, 17, 18, 19, 20, 21, 22, 23, 29, 34,
                            35})

# ggml type id -> (name, elements per block, bytes per block). Ids missing here are
# types llama.cpp has removed (4, 5, 31-33, 36-38) or ones newer than this table.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}

# Metadata value type ids (GGUF spec).
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)

VALUE_TYPE_NAMES = (
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
    "bool", "string", "array", "uint64", "int64", "float64",
)

# Fixed-size value types: struct format for scalars, numpy dtype for arrays (both
# little-endian, standard sizes; numpy's dtype.char is platform-sized, so not reused).
_FORMATS: dict[int, tuple[str, str]] = {
    UINT8: ("<B", "<u1"),
    INT8: ("<b", "<i1"),
    UINT16: ("<H", "<u2"),
    INT16: ("<h", "<i2"),
    UINT32: ("<I", "<u4"),
    INT32: ("<i", "<i4"),
    FLOAT32: ("<f", "<f4"),
    UINT64: ("<Q", "<u8"),
    INT64: ("<q", "<i8"),
    FLOAT64: ("<d", "<f8"),
}
_STRUCT: dict[int, struct.Struct] = {t: struct.Struct(fmt) for t, (fmt, _) in _FORMATS.items()}
_NUMERIC: dict[int, np.dtype] = {t: np.dtype(dt) for t, (_, dt) in _FORMATS.items()}

# The fewest bytes one value of each type can occupy: a string is at least its 8-byte
# length, an array its 4-byte element type and 8-byte count. An array's count times this
# must fit in what is left of the file before anything is allocated for it.
_MIN_VALUE_BYTES: dict[int, int] = {t: d.itemsize for t, d in _NUMERIC.items()}
_MIN_VALUE_BYTES.update({BOOL: 1, STRING: 8, ARRAY: 12})

# Lower bounds on one metadata entry (key length, key of >= 1 byte, value type, value of
# >= 1 byte) and one tensor info (name length, n_dims, type, offset), for capping counts.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Split models (gguf-py: Keys.Split; llama.cpp: LLM_KV_SPLIT_*). split.no and split.count
# are uint16, split.tensors.count int32.
SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"
MAX_SPLITS = 0xFFFF
MAX_INT32 = (1 << 31) - 1


@dataclass(slots=True, frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor directory.

    ``shape`` is in torch order: GGUF lists dimensions fastest-varying first, so a 2-D
    ``[ne0, ne1]`` (``ne1`` rows of ``ne0`` elements) is ``(ne1, ne0)``. ``offset`` is
    absolute in the file that holds the tensor, ``GGUFFile.paths[shard]`` (shard 0 unless
    the model is split). ``nbytes`` is ``None`` when ``ggml_type`` is unknown.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int
    nbytes: int | None
    shard: int = 0

    @property
    def n_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(slots=True, eq=False)
class GGUFFile:
    """A parsed GGUF file (or split model); tensor data stays in read-only memory maps
    until asked for. For a split model, ``path``, ``version``, ``metadata``, ``alignment``
    and ``data_offset`` are the first shard's."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    alignment: int
    data_offset: int
    # Every file the model is made of, in order: [path], or all shards of a split model.
    paths: list[Path] = field(default_factory=list)
    _buffers: list[mmap.mmap] = field(default_factory=list, repr=False)  # one per path; [] once closed

    def tensor_nbytes(self, name: str) -> int:
        """The tensor's size in bytes; raises for a missing tensor or an unknown type."""
        info = self.tensors.get(name)
        if info is None:
            raise LocalserveError(f"{self.path}: no tensor named {name!r}")
        if info.nbytes is None:
            raise LocalserveError(
                f"{self.path}: tensor {name!r} has ggml type {info.ggml_type}, which this "
                f"reader does not know (known: {', '.join(n for n, _, _ in GGML_TYPES.values())})"
            )
        return info.nbytes

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Zero-copy, read-only uint8 view of the tensor's raw bytes in its file."""
        nbytes = self.tensor_nbytes(name)
        if not self._buffers:
            raise LocalserveError(f"{self.path}: file is closed")
        info = self.tensors[name]
        # The parser checked offset + nbytes <= that file's size, so this cannot read past the end.
        return np.frombuffer(self._buffers[info.shard], dtype=np.uint8, count=nbytes, offset=info.offset)

    def drop_pages(self, name: str) -> None:
        """Done with a tensor's bytes (copied out): its pages leave this process's resident
        set, which a mapped file's pages would otherwise join for good (the page cache
        keeps them; a later read faults them back in)."""
        info = self.tensors[name]
        if not self._buffers or info.nbytes is None:
            return
        start = info.offset - info.offset % mmap.PAGESIZE
        self._buffers[info.shard].madvise(mmap.MADV_DONTNEED, start, info.offset + info.nbytes - start)

    def close(self) -> None:
        """Drop the memory maps (every shard's). Views handed out keep a mapping alive until they go."""
        buffers, self._buffers = self._buffers, []
        for buffer in buffers:
            _close_map(buffer)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_map(buffer: mmap.mmap) -> None:
    try:
        buffer.close()
    except BufferError:
        # Views (from tensor_bytes, or in a traceback's frames) still point into it; the
        # map is released when the last of them is garbage-collected.
        pass


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor directory (not the tensor data).

    Given the first shard of a split model (``<prefix>-00001-of-0000N.gguf``), every shard
    is parsed and the result is the whole model (see the module docstring).
    """
    first = _read_file(Path(path).expanduser())
    if SPLIT_COUNT not in first.metadata and SPLIT_NO not in first.metadata:
        return first
    try:
        return _join_shards(first)
    except BaseException:
        first.close()
        raise


def split_paths(path: str | Path) -> list[Path]:
    """Every file of the GGUF model at `path` (all shards in order if it is split; all are parsed and checked)."""
    with read_gguf(path) as gguf:
        return list(gguf.paths)


def _split_key(gguf: GGUFFile, key: str, low: int, high: int) -> int:
    value = gguf.metadata.get(key)
    if value is None:
        raise LocalserveError(f"{gguf.path}: a split GGUF model needs metadata {key}, which this file lacks")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LocalserveError(f"{gguf.path}: metadata {key} is {value!r}; expected an integer from {low} to {high}")
    return value


def _shard_suffix(number: int, count: int) -> str:
    """The end of shard `number` (1-based)'s file name, as llama.cpp's llama_split_path writes it."""
    return f"-{number:05d}-of-{count:05d}.gguf"


def _join_shards(first: GGUFFile) -> GGUFFile:
    """The split model whose first shard is `first`: its sibling shards found by name,
    read and checked, and the tensors of all of them in one directory."""
    count = _split_key(first, SPLIT_COUNT, 1, MAX_SPLITS)
    number = _split_key(first, SPLIT_NO, 0, count - 1)
    name = first.path.name
    if number != 0:
        suffix = _shard_suffix(number + 1, count)
        prefix = name[: -len(suffix)] if name.endswith(suffix) else "<prefix>"
        raise LocalserveError(
            f"{first.path}: this is shard {number + 1} of {count} of a split GGUF model; "
            f"pass the first shard, {prefix}{_shard_suffix(1, count)}"
        )
    expected_tensors = _split_key(first, SPLIT_TENSORS_COUNT, 0, MAX_INT32)
    paths = [first.path]
    if count > 1:
        suffix = _shard_suffix(1, count)
        if len(name) <= len(suffix) or not name.endswith(suffix):
            raise LocalserveError(
                f"{first.path}: the first shard of a {count}-file split GGUF model must be named "
                f"<prefix>{suffix} so that its other shards can be found beside it"
            )
        prefix = name[: -len(suffix)]
        paths += [first.path.with_name(prefix + _shard_suffix(n, count)) for n in range(2, count + 1)]
    shards = [first]
    try:
        for index, shard_path in enumerate(paths[1:], start=1):
            if not shard_path.is_file():
                raise LocalserveError(
                    f"{first.path}: shard {index + 1} of {count} of this split GGUF model is missing "
                    f"(expected {shard_path}); keep all shards in the same folder"
                )
            shard = _read_file(shard_path)
            shards.append(shard)
            found = (shard.metadata.get(SPLIT_NO), shard.metadata.get(SPLIT_COUNT))
            if found != (index, count):
                raise LocalserveError(
                    f"{shard_path}: expected shard {index + 1} of {count} (split.no {index}, split.count {count}) "
                    f"of {name}, but the file has split.no {found[0]!r}, split.count {found[1]!r}; "
                    "are the shards from different splits?"
                )
        tensors: dict[str, GGUFTensorInfo] = {}
        for index, shard in enumerate(shards):
            for tensor_name, info in shard.tensors.items():
                if tensor_name in tensors:
                    raise LocalserveError(
                        f"{shard.path}: tensor {tensor_name!r} is also in {paths[tensors[tensor_name].shard]}; "
                        "a split GGUF model holds each tensor once"
                    )
                tensors[tensor_name] = replace(info, shard=index)
        if len(tensors) != expected_tensors:
            raise LocalserveError(
                f"{first.path}: the {count} files of this split GGUF model hold {len(tensors)} tensors, "
                f"but {SPLIT_TENSORS_COUNT} says {expected_tensors}; are the shards from different splits?"
            )
    except BaseException:
        for shard in shards[1:]:
            shard.close()
        raise
    return GGUFFile(
        path=first.path,
        version=first.version,
        metadata=first.metadata,
        tensors=tensors,
        alignment=first.alignment,
        data_offset=first.data_offset,
        paths=paths,
        _buffers=[buffer for shard in shards for buffer in shard._buffers],
    )


def _read_file(path: Path) -> GGUFFile:
    """Parse one GGUF file, whether or not it is a shard."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            if size == 0:
                raise LocalserveError(f"{path}: empty file, not a GGUF file")
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise LocalserveError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except ValueError as exc:  # mmap refuses some special files
        raise LocalserveError(f"{path}: cannot memory-map ({exc})") from exc
    try:
        return _Parser(path, buffer).parse()
    except BaseException:
        _close_map(buffer)
        raise


class _Parser:
    """A cursor over the mapped file; every read is bounds-checked before it happens."""

    __slots__ = ("path", "buf", "size", "pos")

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    # -- primitives -------------------------------------------------------------

    def error(self, message: str) -> LocalserveError:
        return LocalserveError(f"{self.path}: {message}")

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> int:
        """Reserve n bytes at the cursor for `what`; return where they start."""
        if n > self.remaining:
            raise self.error(
                f"truncated or corrupt: {what} at byte {self.pos} needs {n} bytes "
                f"but only {self.remaining} remain"
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, what))[0]

    def string(self, what: str, limit: int) -> str:
        length = self.u64(f"length of {what}")
        if length > limit:
            raise self.error(f"{what} is {length} bytes long (limit {limit}); the file is corrupt")
        start = self.take(length, what)
        try:
            return self.buf[start:start + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"{what} at byte {start} is not valid UTF-8 ({exc.reason})") from None

    # -- file structure ---------------------------------------------------------

    def parse(self) -> GGUFFile:
        version, tensor_count, kv_count = self.header()
        metadata = self.metadata(kv_count)
        alignment = self.alignment(metadata)
        raw_infos = self.tensor_infos(tensor_count)
        # The data section starts at the next multiple of the alignment after the
        # directory. A file without tensors may end before that padding.
        data_offset = -(-self.pos // alignment) * alignment
        tensors = {
            name: self.tensor(name, dims, ggml_type, rel_offset, alignment, data_offset)
            for name, dims, ggml_type, rel_offset in raw_infos
        }
        return GGUFFile(
            path=self.path,
            version=version,
            metadata=metadata,
            tensors=tensors,
            alignment=alignment,
            data_offset=data_offset,
            paths=[self.path],
            _buffers=[self.buf],
        )

    def header(self) -> tuple[int, int, int]:
        if self.size < 4 or self.buf[0:4] != MAGIC:
            raise self.error(f"not a GGUF file (it does not start with GGUF's magic {MAGIC!r})")
        self.pos = 4
        version = self.u32("version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            # A big-endian writer puts the small version number in the high bytes.
            if version & 0xFFFF == 0 and swapped in (1, 2, 3):
                raise self.error(f"big-endian GGUF (version {swapped}) is not supported; "
                                 "convert it to little-endian")
            if version == 1:
                raise self.error("GGUF version 1 is not supported (supported: 2, 3); "
                                 "re-convert the model with a current llama.cpp")
            raise self.error(f"unsupported GGUF version {version} (supported: 2, 3)")
        tensor_count = self.u64("tensor count")
        kv_count = self.u64("metadata count")
        # Counts alone could make us loop (or allocate) for 2**64 entries; each entry has
        # a minimum encoded size, so both must fit in what is left of the file.
        if kv_count * _MIN_KV_BYTES + tensor_count * _MIN_TENSOR_INFO_BYTES > self.remaining:
            raise self.error(
                f"header claims {tensor_count} tensors and {kv_count} metadata entries, "
                f"more than the {self.size}-byte file can hold"
            )
        return version, tensor_count, kv_count

    def metadata(self, kv_count: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for index in range(kv_count):
            key = self.string(f"metadata key #{index}", MAX_KEY_BYTES)
            if not key:
                raise self.error(f"metadata key #{index} is empty")
            if key in metadata:
                raise self.error(f"metadata key {key!r} appears twice")
            value_type = self.u32(f"value type of {key!r}")
            if key == "general.alignment" and value_type != UINT32:
                # llama.cpp reads it as uint32 only; another type means a broken writer.
                name = VALUE_TYPE_NAMES[value_type] if value_type < len(VALUE_TYPE_NAMES) else value_type
                raise self.error(f"general.alignment has type {name}, expected uint32")
            metadata[key] = self.value(value_type, key, depth=0)
        return metadata

    def value(self, value_type: int, key: str, depth: int) -> Any:
        codec = _STRUCT.get(value_type)
        if codec is not None:
            return codec.unpack_from(self.buf, self.take(codec.size, f"value of {key!r}"))[0]
        if value_type == BOOL:
            byte = self.buf[self.take(1, f"value of {key!r}")]
            if byte > 1:
                raise self.error(f"bool value of {key!r} is {byte}, expected 0 or 1")
            return bool(byte)
        if value_type == STRING:
            return self.string(f"value of {key!r}", MAX_STRING_BYTES)
        if value_type == ARRAY:
            return self.array(key, depth)
        raise self.error(f"metadata {key!r} has unknown value type {value_type} (known: 0..12)")

    def array(self, key: str, depth: int) -> list[Any]:
        if depth >= MAX_ARRAY_DEPTH:
            raise self.error(f"metadata {key!r} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
        element_type = self.u32(f"array element type of {key!r}")
        count = self.u64(f"array length of {key!r}")
        if element_type not in _MIN_VALUE_BYTES:
            raise self.error(f"metadata {key!r} is an array of unknown value type {element_type} (known: 0..12)")
        if count > MAX_ARRAY_ELEMENTS:
            raise self.error(f"metadata {key!r} is an array of {count} elements (limit {MAX_ARRAY_ELEMENTS})")
        # Checked before anything is allocated: even the smallest encoding of `count`
        # elements must fit in the rest of the file.
        if count * _MIN_VALUE_BYTES[element_type] > self.remaining:
            raise self.error(
                f"metadata {key!r}: array of {count} {VALUE_TYPE_NAMES[element_type]} values "
                f"does not fit in the {self.remaining} bytes left in the file"
            )
        if count == 0:
            return []
        dtype = _NUMERIC.get(element_type)
        if dtype is not None or element_type == BOOL:
            dtype = dtype or np.dtype("u1")
            start = self.take(count * dtype.itemsize, f"array {key!r}")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=start)
            if element_type == BOOL:
                if values.max() > 1:
                    raise self.error(f"metadata {key!r}: bool array holds a value other than 0 or 1")
                return values.astype(bool).tolist()
            return values.tolist()
        if element_type == STRING:
            return self.string_array(key, count)
        return [self.value(element_type, key, depth + 1) for _ in range(count)]

    def string_array(self, key: str, count: int) -> list[str]:
        """``count`` strings: the same checks as ``string``, in one loop without a message built
        per element (a 128k-token vocabulary and its merges are most of a file's metadata)."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        values: list[str] = []
        append = values.append
        for index in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.take(8, f"length of string #{index} of {key!r}")  # raises with the position
            (length,) = unpack(buf, pos)
            pos += 8
            if length > MAX_STRING_BYTES or pos + length > size:
                self.pos = pos
                if length > MAX_STRING_BYTES:
                    raise self.error(f"string #{index} of {key!r} is {length} bytes long "
                                     f"(limit {MAX_STRING_BYTES}); the file is corrupt")
                self.take(length, f"string #{index} of {key!r}")
            try:
                append(buf[pos:pos + length].decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise self.error(f"string #{index} of {key!r} at byte {pos} is not valid UTF-8 ({exc.reason})") from None
            pos += length
        self.pos = pos
        return values

    def alignment(self, metadata: dict[str, Any]) -> int:
        if "general.alignment" not in metadata:
            return DEFAULT_ALIGNMENT
        # metadata() has checked that it is stored as uint32.
        value = metadata["general.alignment"]
        if value == 0 or value & (value - 1):
            raise self.error(f"general.alignment is {value!r}; expected a power of two (uint32)")
        return value

    def tensor_infos(self, tensor_count: int) -> list[tuple[str, list[int], int, int]]:
        infos: list[tuple[str, list[int], int, int]] = []
        seen: set[str] = set()
        for index in range(tensor_count):
            name = self.string(f"name of tensor #{index}", MAX_NAME_BYTES)
            if name in seen:
                raise self.error(f"tensor {name!r} appears twice")
            seen.add(name)
            n_dims = self.u32(f"dimension count of tensor {name!r}")
            if n_dims > MAX_DIMS:
                raise self.error(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            dims = [self.u64(f"dimension {axis} of tensor {name!r}") for axis in range(n_dims)]
            for axis, dim in enumerate(dims):
                if not 1 <= dim <= MAX_INT64:
                    raise self.error(f"tensor {name!r}: dimension {axis} is {dim}")
            ggml_type = self.u32(f"type of tensor {name!r}")
            rel_offset = self.u64(f"offset of tensor {name!r}")
            infos.append((name, dims, ggml_type, rel_offset))
        return infos

    def tensor(
        self, name: str, dims: list[int], ggml_type: int, rel_offset: int, alignment: int, data_offset: int
    ) -> GGUFTensorInfo:
        if rel_offset % alignment:
            raise self.error(f"tensor {name!r}: offset {rel_offset} is not a multiple of the alignment {alignment}")
        offset = data_offset + rel_offset
        if offset > self.size:
            raise self.error(f"tensor {name!r} starts at byte {offset}, past the end of the {self.size}-byte file")
        n_elements = 1
        for dim in dims:
            n_elements *= dim  # Python ints: no overflow, compared against limits below
        if n_elements > MAX_INT64:
            raise self.error(f"tensor {name!r}: shape {dims} has {n_elements} elements, too many")
        shape = tuple(reversed(dims))
        known = GGML_TYPES.get(ggml_type)
        if known is None:
            return GGUFTensorInfo(name, shape, ggml_type, f"type {ggml_type}", offset, None)
        type_name, block_elements, block_bytes = known
        row = dims[0] if dims else 1
        if row % block_elements:
            raise self.error(
                f"tensor {name!r}: rows of {row} elements are not a multiple of the "
                f"{type_name} block size {block_elements}"
            )
        nbytes = n_elements // block_elements * block_bytes
        if offset + nbytes > self.size:
            raise self.error(
                f"tensor {name!r} ({type_name}, shape {shape}) needs bytes {offset}..{offset + nbytes}, "
                f"past the end of the {self.size}-byte file (truncated?)"
            )
        return GGUFTensorInfo(name, shape, ggml_type, type_name, offset, nbytes)
