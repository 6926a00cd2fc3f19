"""The header of a GGUF file: metadata key/values and tensor infos, parsed in one pass.

``gguf.GGUFReader`` makes numpy views per value while parsing, a quarter of a million of them
for SmolLM2's 49k tokens and merges (3 s; 1 s over a plain ndarray instead of its ``np.memmap``;
12 s and 3.6 s for Llama 3's 128k tokens and 280k merges). :class:`GGUFHeader` reads the same
header from one read-only ``mmap`` with ``struct`` and ``bytes.decode`` in a tight loop per
string array, and turns a numeric array into a numpy array in one ``np.frombuffer`` call:
0.035 s and 0.15 s.

It offers what quanta used of ``GGUFReader``: :attr:`GGUFHeader.fields` (with the reader's
``GGUF.version`` / ``GGUF.tensor_count`` / ``GGUF.kv_count`` entries first) and
:meth:`GGUFHeader.get_field` give :class:`GGUFField` with ``types`` and ``contents()`` as the
reader has them; :attr:`GGUFHeader.tensors` gives :class:`GGUFTensorInfo` with ``name``,
``shape`` (ggml order, innermost first), ``tensor_type``, ``n_elements``, ``n_bytes``,
``data_offset`` (from the start of the file) and ``data``, a read-only view of the tensor's
bytes in the file, mapped on first access. The reader's ``parts`` / ``data`` indices are not
kept. Files in either byte order are read, as the reader reads them.

Every malformed file is one ``ValueError`` line naming the file: not GGUF, an unsupported
version, a header cut short, an unknown value or tensor type, a duplicate key or tensor,
a bad ``general.alignment``, a quantized tensor whose rows are not whole blocks, a tensor whose
data runs past the end of the file.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

__all__ = ["GGUFField", "GGUFHeader", "GGUFTensorInfo"]

#: GGUF versions read (1 used 32-bit counts and lengths)
SUPPORTED_VERSIONS = (2, 3)
#: alignment of the tensor data when ``general.alignment`` is absent
DEFAULT_ALIGNMENT = 32

_STRING, _ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)
#: scalar value type -> (struct format, numpy dtype), byte order added per file
_SCALARS = {
    int(GGUFValueType.UINT8): ("B", "u1"),
    int(GGUFValueType.INT8): ("b", "i1"),
    int(GGUFValueType.UINT16): ("H", "u2"),
    int(GGUFValueType.INT16): ("h", "i2"),
    int(GGUFValueType.UINT32): ("I", "u4"),
    int(GGUFValueType.INT32): ("i", "i4"),
    int(GGUFValueType.FLOAT32): ("f", "f4"),
    int(GGUFValueType.BOOL): ("?", "?"),
    int(GGUFValueType.UINT64): ("Q", "u8"),
    int(GGUFValueType.INT64): ("q", "i8"),
    int(GGUFValueType.FLOAT64): ("d", "f8"),
}
#: tensor types whose ``data`` is typed values (as the reader gives them); others are bytes
_TENSOR_DTYPES = {
    GGMLQuantizationType.F16: "f2",
    GGMLQuantizationType.F32: "f4",
    GGMLQuantizationType.F64: "f8",
    GGMLQuantizationType.I8: "i1",
    GGMLQuantizationType.I16: "i2",
    GGMLQuantizationType.I32: "i4",
    GGMLQuantizationType.I64: "i8",
}


class _Truncated(Exception):
    """The header ends (or the file does) before the value being read."""


class GGUFField:
    """One metadata key and its value, as ``gguf.ReaderField`` reports it.

    Attributes:
        name: the key (``tokenizer.ggml.tokens``).
        types: the value type, then for an array its element type (and theirs, for an array of
            arrays, taken from the first element), as in ``ReaderField.types``.
        value: the value: ``int`` / ``float`` / ``bool`` / ``str`` for a scalar, a read-only numpy
            array for an array of numbers or bools, ``list[str]`` for an array of strings, a
            ``list`` of those for an array of arrays.
    """

    __slots__ = ("name", "types", "value")

    def __init__(self, name: str, types: list[GGUFValueType], value: Any) -> None:
        self.name, self.types, self.value = name, types, value

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """The value as ``ReaderField.contents`` gives it: a Python scalar or ``str``; for an array
        a ``list`` (an array of arrays flattened to its elements' elements), or one element of it."""
        if self.types[0] != GGUFValueType.ARRAY:
            return self.value
        value = self.value
        if self.types[1:2] == [GGUFValueType.ARRAY]:
            value = _flatten(value)
        if isinstance(value, np.ndarray):
            return value[index_or_slice].tolist()
        return value[index_or_slice]

    def __repr__(self) -> str:
        return f"GGUFField({self.name!r}, {'/'.join(t.name for t in self.types)})"


def _flatten(values: list) -> list:
    """The leaves of an array of arrays, in order, as ``ReaderField.contents`` lists them."""
    out: list = []
    for v in values:
        if isinstance(v, np.ndarray):
            out += v.tolist()
        elif v and isinstance(v[0], str):
            out += v
        else:
            out += _flatten(v)
    return out


class GGUFTensorInfo:
    """One tensor's entry in the header, with ``gguf.ReaderTensor``'s attributes.

    Attributes:
        name: ``blk.0.attn_q.weight``.
        shape: dimensions in ggml order, innermost first (``[in, out]`` for a matrix).
        tensor_type: its ``GGMLQuantizationType``.
        n_elements: values in the tensor.
        n_bytes: bytes of its data.
        data_offset: where its data starts, from the start of the file.
    """

    def __init__(self, path: str, name: str, shape: tuple[int, ...], tensor_type: GGMLQuantizationType,
                 n_elements: int, n_bytes: int, data_offset: int, byte_order: str) -> None:
        self.path, self.name, self.shape, self.tensor_type = path, name, shape, tensor_type
        self.n_elements, self.n_bytes, self.data_offset = n_elements, n_bytes, data_offset
        self._byte_order = byte_order

    @functools.cached_property
    def data(self) -> np.ndarray:
        """Read-only view of the tensor's data in the file (mapped on first access), shaped as
        ``ReaderTensor.data``: values for float and integer types (outermost dimension first),
        bytes per row of blocks for quantized ones."""
        dims = tuple(reversed(self.shape))
        dtype = _TENSOR_DTYPES.get(self.tensor_type)
        if dtype is None:
            dtype, dims = "u1", quant_shape_to_byte_shape(dims, self.tensor_type)
        dtype = np.dtype(self._byte_order + dtype)
        if self.n_bytes == 0:
            return np.empty(dims, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_offset, shape=dims).view(np.ndarray)

    def __repr__(self) -> str:
        return f"GGUFTensorInfo({self.name!r}, {self.tensor_type.name}, shape={list(self.shape)})"


class GGUFHeader:
    """The parsed header of GGUF file ``path`` (see the module docstring).

    Attributes:
        path: the file.
        version: 2 or 3.
        byte_order: ``<`` or ``>``, of every number in the file.
        fields: key -> :class:`GGUFField`, in file order after ``GGUF.version``,
            ``GGUF.tensor_count`` and ``GGUF.kv_count``.
        tensors: :class:`GGUFTensorInfo` in file order.
        alignment: of the tensor data (``general.alignment``, else 32).
        data_offset: where the tensor data starts.

    Raises:
        ValueError: one line naming the file and what is wrong with it.
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(4)
            if head != b"GGUF":
                raise ValueError(f"{self.path}: not a GGUF file (starts with {head!r}, not b'GGUF')")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                parser = _Parser(self.path, buf, size)
                parser.header()
        self.version, self.byte_order, self.fields = parser.version, parser.byte_order, parser.fields
        self.alignment, self.data_offset = parser.alignment, parser.data_offset
        self.tensors = parser.tensors()

    def get_field(self, key: str) -> GGUFField | None:
        return self.fields.get(key)

    def __repr__(self) -> str:
        return f"GGUFHeader({self.path!r}, v{self.version}, {len(self.fields) - 3} keys, {len(self.tensors)} tensors)"


@functools.lru_cache(maxsize=2)
def _cached_header(path: str, mtime_ns: int, size: int) -> GGUFHeader:
    return GGUFHeader(path)


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The parsed header of ``path`` (:class:`GGUFHeader`), shared by the calls of one load (the
    tensor types, the config, the weights and the tokenizer, on its own thread). Keyed by the file's
    modification time and size, so a rewritten file is parsed again.

    Raises:
        ValueError: the file is not GGUF, its header is cut short or malformed, or a tensor's data
            runs past its end (one line naming the file).
    """
    st = os.stat(path)
    return _cached_header(os.path.realpath(path), st.st_mtime_ns, st.st_size)


def forget_headers() -> None:
    """Drop the parsed headers :func:`read_header` keeps, and with them the memory maps of the tensors
    read through them (~0.14 GB resident for SmolLM2 once its weights were read): for a process done loading."""
    _cached_header.cache_clear()


class _Parser:
    """One pass over the header in ``buf`` (the mapped file of ``size`` bytes)."""

    def __init__(self, path: str, buf: mmap.mmap, size: int) -> None:
        self.path, self.buf, self.size = path, buf, size
        self.where = "the version"  # what is being read, for the truncation message

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what}")

    def header(self) -> None:
        """Parse the version, counts, key/values and tensor infos; set the alignment and data start."""
        try:
            self._header()
        except (_Truncated, struct.error, OverflowError):
            raise self.fail(f"truncated GGUF header: the file ({self.size} bytes) ends within {self.where}") from None

    def _header(self) -> None:
        buf, size = self.buf, self.size
        if size < 8:
            raise _Truncated
        (version,) = struct.unpack_from("<I", buf, 4)
        bo = "<"
        if version & 0xFFFF == 0:  # written in big-endian byte order
            (version,) = struct.unpack_from(">I", buf, 4)
            bo = ">"
        if version not in SUPPORTED_VERSIONS:
            raise self.fail(f"GGUF version {version} is not supported (only {' and '.join(map(str, SUPPORTED_VERSIONS))})")
        self.version, self.byte_order = version, bo
        self.u32, self.u64 = struct.Struct(bo + "I").unpack_from, struct.Struct(bo + "Q").unpack_from
        self.scalars = {t: (struct.Struct(bo + fmt).unpack_from, struct.calcsize(fmt)) for t, (fmt, _) in _SCALARS.items()}
        self.dtypes = {t: np.dtype(bo + dt) for t, (_, dt) in _SCALARS.items()}

        self.where = "the tensor and key counts"
        n_tensors, n_kv = self.u64(buf, 8)[0], self.u64(buf, 16)[0]
        u32, u64 = [GGUFValueType.UINT32], [GGUFValueType.UINT64]
        self.fields = {
            "GGUF.version": GGUFField("GGUF.version", u32, version),
            "GGUF.tensor_count": GGUFField("GGUF.tensor_count", u64, n_tensors),
            "GGUF.kv_count": GGUFField("GGUF.kv_count", u64, n_kv),
        }
        # a key/value takes at least 12 bytes, a tensor info 24: garbage counts stop here
        if n_kv * 12 + n_tensors * 24 > size - 24:
            self.where = f"the {n_kv} key/values and {n_tensors} tensor infos it announces"
            raise _Truncated
        pos = 24
        for i in range(n_kv):
            self.where = f"key/value {i}"
            key, pos = self.string(pos)
            self.where = f"key {key!r}"
            (vtype,) = self.u32(buf, pos)
            value, types, pos = self.value(vtype, pos + 4)
            if key in self.fields:
                raise self.fail(f"duplicate key {key!r}")
            self.fields[key] = GGUFField(key, types, value)

        self.infos = []
        for i in range(n_tensors):
            self.where = f"tensor info {i}"
            name, pos = self.string(pos)
            self.where = f"tensor info {name!r}"
            (n_dims,) = self.u32(buf, pos)
            if 8 * n_dims > size - pos:
                raise _Truncated
            dims = struct.unpack_from(f"{bo}{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            (raw_type,), (offset,) = self.u32(buf, pos), self.u64(buf, pos + 4)
            pos += 12
            self.infos.append((name, dims, raw_type, offset))

        self.alignment = DEFAULT_ALIGNMENT
        align = self.fields.get("general.alignment")
        if align is not None:
            if align.types != [GGUFValueType.UINT32]:
                raise self.fail(f"general.alignment is {'/'.join(t.name for t in align.types)}, not UINT32")
            if align.value == 0 or align.value & (align.value - 1):
                raise self.fail(f"general.alignment {align.value} is not a power of two")
            self.alignment = align.value
        self.data_offset = -(-pos // self.alignment) * self.alignment

    def tensors(self) -> list[GGUFTensorInfo]:
        """The tensor infos read by :meth:`header`, checked: known type, unique name, data inside the file."""
        tensors, names = [], set()
        for name, dims, raw_type, offset in self.infos:
            if name in names:
                raise self.fail(f"duplicate tensor {name!r}")
            names.add(name)
            try:
                kind = GGMLQuantizationType(raw_type)
                block, type_size = GGML_QUANT_SIZES[kind]
            except (ValueError, KeyError):
                raise self.fail(f"tensor {name!r} has unknown type {raw_type}") from None
            if dims and dims[0] % block:
                raise self.fail(f"tensor {name!r} ({kind.name}) has rows of {dims[0]} values, not a multiple of its block of {block}")
            n_elements = 1
            for d in dims:
                n_elements *= d
            n_bytes = n_elements * type_size // block
            start = self.data_offset + offset
            if start + n_bytes > self.size:
                raise self.fail(f"the data of tensor {name!r} ({kind.name}, bytes {start}..{start + n_bytes}) "
                                f"runs past the end of the file ({self.size} bytes): truncated")
            tensors.append(GGUFTensorInfo(self.path, name, dims, kind, n_elements, n_bytes, start, self.byte_order))
        return tensors

    def string(self, pos: int) -> tuple[str, int]:
        """``(string, position after it)`` at ``pos``."""
        (n,) = self.u64(self.buf, pos)
        end = pos + 8 + n
        if end > self.size:
            raise _Truncated
        try:
            return self.buf[pos + 8:end].decode(), end
        except UnicodeDecodeError as e:
            raise self.fail(f"{self.where}: a string is not UTF-8 ({e.reason} at offset {pos + 8 + e.start})") from None

    def value(self, vtype: int, pos: int) -> tuple[Any, list[GGUFValueType], int]:
        """``(value, types, position after it)`` of the value of type ``vtype`` at ``pos``."""
        scalar = self.scalars.get(vtype)
        if scalar is not None:
            unpack, n = scalar
            return unpack(self.buf, pos)[0], [GGUFValueType(vtype)], pos + n
        if vtype == _STRING:
            value, pos = self.string(pos)
            return value, [GGUFValueType.STRING], pos
        if vtype != _ARRAY:
            raise self.fail(f"{self.where} has unknown value type {vtype}")
        (etype,), (count,) = self.u32(self.buf, pos), self.u64(self.buf, pos + 4)
        pos += 12
        types = [GGUFValueType.ARRAY]
        dtype = self.dtypes.get(etype)
        if dtype is not None:
            end = pos + count * dtype.itemsize
            if end > self.size:
                raise _Truncated
            values = np.frombuffer(self.buf, dtype, count, pos).astype(dtype.newbyteorder("="))
            values.flags.writeable = False
            return values, types + [GGUFValueType(etype)] if count else types, end
        if etype == _STRING:
            strings, pos = self.strings(pos, count)
            return strings, types + [GGUFValueType.STRING] if count else types, pos
        if etype != _ARRAY:
            raise self.fail(f"{self.where} is an array of unknown value type {etype}")
        if count * 12 > self.size - pos:  # an inner array takes at least 12 bytes
            raise _Truncated
        items = []
        for i in range(count):
            item, item_types, pos = self.value(_ARRAY, pos)
            if i == 0:
                types += item_types
            items.append(item)
        return items, types, pos

    def strings(self, pos: int, count: int) -> tuple[list[str], int]:
        """``count`` strings from ``pos``: the loop the header's time goes to (tokens and merges)."""
        buf, u64 = self.buf, self.u64
        if count * 8 > self.size - pos:
            raise _Truncated
        out = [""] * count
        i = start = 0
        try:
            for i in range(count):
                start = pos + 8
                pos = start + u64(buf, pos)[0]
                out[i] = buf[start:pos].decode()
        except UnicodeDecodeError as e:
            if pos > self.size:  # a character cut by the end of the file
                raise _Truncated from None
            raise self.fail(f"{self.where}: string {i} is not UTF-8 ({e.reason} at offset {start + e.start})") from None
        if pos > self.size:  # the last string ran past the end (the slice stopped there)
            raise _Truncated
        return out, pos
