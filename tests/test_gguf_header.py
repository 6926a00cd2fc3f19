"""quanta.model.gguf_header: the GGUF header as ``gguf.GGUFReader`` reports it, and malformed files
as one-line errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from quanta.model.gguf_header import GGUFHeader
from quanta.model.loader import embedded_model_path


class ArrayGGUFReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a plain ndarray view of its memory map, the reference reader of the
    embedded model: the stock reader slices a ``np.memmap`` hundreds of thousands of times while
    parsing the tokenizer arrays, and every memmap slice pays for ``memmap.__array_finalize__``; a
    base-class view of the same mapping parses about 3x faster (0.9 s instead of 3 s for SmolLM2)."""

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = np.asarray(value)


#: one scalar of every value type, and an array of each
SCALARS = {
    V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000, V.UINT32: 4_000_000_000,
    V.INT32: -2_000_000_000, V.UINT64: 2**64 - 1, V.INT64: -(2**63), V.FLOAT32: 1.5e-5,
    V.FLOAT64: -2.718281828459045, V.BOOL: True, V.STRING: "héllo, wörld 🤔",
}
ARRAYS = {
    V.UINT8: [0, 1, 255], V.INT8: [-128, 0, 127], V.UINT16: [0, 65535], V.INT16: [-32768, 5],
    V.UINT32: [1, 2**32 - 1], V.INT32: [-(2**31), 7, 2**31 - 1], V.UINT64: [0, 2**64 - 1],
    V.INT64: [-(2**63), 2**63 - 1], V.FLOAT32: [0.1, -2.5, 3e38], V.FLOAT64: [1e-300, -0.5],
    V.BOOL: [True, False, True], V.STRING: ["a", "", "Ġthe", "日本語", "<|im_end|>"],
}


def write_every_type(path: Path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> None:
    """A GGUF holding every value type, arrays of each, arrays of arrays, and tensors of several types."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for vtype, value in SCALARS.items():
        w.add_key_value(f"test.scalar.{vtype.name.lower()}", value, vtype)
    for vtype, values in ARRAYS.items():
        w.add_key_value(f"test.array.{vtype.name.lower()}", values, V.ARRAY, sub_type=vtype)
    w.add_key_value("test.nested.int", [[1, 2, 3], [4], [5, 6]], V.ARRAY, sub_type=V.ARRAY)
    w.add_key_value("test.nested.string", [["x", "yz"], ["日"]], V.ARRAY, sub_type=V.ARRAY)
    w.add_key_value("test.nested.deep", [[[1.5, 2.5], [3.5]], [[4.5]]], V.ARRAY, sub_type=V.ARRAY)
    w.add_key_value("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)], V.ARRAY, sub_type=V.STRING)
    w.add_tensor("f32.weight", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16.weight", rng.standard_normal((64,)).astype(np.float16))
    w.add_tensor("i32.weight", np.arange(24, dtype=np.int32).reshape(2, 3, 4))
    w.add_tensor("bf16.weight", gguf.quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), T.BF16), raw_dtype=T.BF16)
    for kind in (T.Q8_0, T.Q4_0):
        values = rng.standard_normal((4, 256)).astype(np.float32)
        w.add_tensor(f"{kind.name.lower()}.weight", gguf.quants.quantize(values, kind), raw_dtype=kind)
    # the reader does not look inside blocks: random ones for a type the gguf library cannot quantize
    w.add_tensor("q4_k.weight", rng.integers(0, 256, (4, 144), dtype=np.uint8), raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_same_as_reader(path: Path, reference: gguf.GGUFReader) -> GGUFHeader:
    header = GGUFHeader(path)
    assert list(header.fields) == list(reference.fields)
    for key, ref in reference.fields.items():
        field = header.get_field(key)
        assert field.types == ref.types, key
        assert field.contents() == ref.contents(), key
        if ref.types[0] == V.ARRAY and len(ref.data) > 2:
            for index in (0, -1, slice(1, 3), slice(None, None, -2)):
                assert field.contents(index) == ref.contents(index), (key, index)
    assert (header.alignment, header.data_offset) == (int(reference.alignment), reference.data_offset)
    assert [t.name for t in header.tensors] == [t.name for t in reference.tensors]
    for tensor, ref in zip(header.tensors, reference.tensors, strict=True):
        assert "data" not in tensor.__dict__  # mapped on first access only
        assert list(tensor.shape) == ref.shape.tolist(), ref.name
        assert tensor.tensor_type is ref.tensor_type, ref.name
        assert (tensor.n_elements, tensor.n_bytes, tensor.data_offset) == (ref.n_elements, ref.n_bytes, ref.data_offset)
        assert tensor.data.shape == ref.data.shape and tensor.data.dtype == ref.data.dtype, ref.name
        assert np.array_equal(tensor.data, ref.data), ref.name
        assert not tensor.data.flags.writeable
    return header


def test_the_embedded_model_reads_as_the_gguf_reader_reads_it():
    path = embedded_model_path()
    # ArrayGGUFReader: gguf.GGUFReader over a plain ndarray view, 3x faster than the stock one to parse
    header = assert_same_as_reader(path, ArrayGGUFReader(path))
    assert len(header.get_field("tokenizer.ggml.tokens").value) == 49152
    assert isinstance(header.get_field("tokenizer.ggml.token_type").value, np.ndarray)


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_reads_as_the_gguf_reader_reads_it(tmp_path, endianess, alignment):
    path = tmp_path / "every.gguf"
    write_every_type(path, endianess, alignment)
    header = assert_same_as_reader(path, gguf.GGUFReader(path))
    assert header.byte_order == ("<" if endianess == gguf.GGUFEndian.LITTLE else ">")
    assert header.alignment == (alignment or 32) and header.data_offset % header.alignment == 0
    for vtype, value in SCALARS.items():
        field = header.get_field(f"test.scalar.{vtype.name.lower()}")
        assert field.value == (float(np.float32(value)) if vtype == V.FLOAT32 else value)
    for vtype, values in ARRAYS.items():
        field = header.get_field(f"test.array.{vtype.name.lower()}")
        expected = np.array(values, dtype=np.float32).tolist() if vtype == V.FLOAT32 else values
        assert field.contents() == expected
        assert isinstance(field.value, list if vtype == V.STRING else np.ndarray)
    nested = header.get_field("test.nested.int")
    assert nested.types == [V.ARRAY, V.ARRAY, V.INT32]
    assert [v.tolist() for v in nested.value] == [[1, 2, 3], [4], [5, 6]]
    assert nested.contents() == [1, 2, 3, 4, 5, 6]  # flattened, as the reader gives it
    assert header.get_field("test.nested.string").value == [["x", "yz"], ["日"]]
    assert header.get_field("test.nested.deep").contents() == [1.5, 2.5, 3.5, 4.5]
    assert header.get_field("missing") is None


def test_an_empty_array_reads_as_the_gguf_reader_reads_it(tmp_path):
    """The writer refuses empty arrays: one written by hand (key, ARRAY, element type, count 0)."""
    path = tmp_path / "empty.gguf"
    key = b"test.empty"
    kv = len(key).to_bytes(8, "little") + key + int(V.ARRAY).to_bytes(4, "little")
    kv += int(V.INT32).to_bytes(4, "little") + (0).to_bytes(8, "little")
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little") + kv)
    header = assert_same_as_reader(path, gguf.GGUFReader(path))
    assert header.get_field("test.empty").contents() == [] and header.tensors == []


def _error(path: Path) -> str:
    with pytest.raises(ValueError) as err:
        GGUFHeader(path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message
    return message


def test_a_file_that_is_not_gguf_is_one_line(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file, not a model")
    assert "not a GGUF file" in _error(path)
    path.write_bytes(b"")
    assert "not a GGUF file" in _error(path)


def test_every_cut_through_the_header_is_one_line(tmp_path):
    whole = tmp_path / "whole.gguf"
    write_every_type(whole)
    data = whole.read_bytes()
    end = GGUFHeader(whole).data_offset
    path = tmp_path / "cut.gguf"
    for cut in range(end):
        path.write_bytes(data[:cut])
        message = _error(path)
        assert any(s in message for s in ("not a GGUF file", "truncated")), (cut, message)
    path.write_bytes(data[:end + 10])  # the header whole, tensor data cut
    assert "runs past the end of the file" in _error(path)


def _patched(tmp_path: Path, at: int, value: bytes) -> Path:
    whole = tmp_path / "whole.gguf"
    write_every_type(whole)
    data = bytearray(whole.read_bytes())
    data[at:at + len(value)] = value
    path = tmp_path / "patched.gguf"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(("at", "value", "message"), [
    (4, (1).to_bytes(4, "little"), "GGUF version 1 is not supported"),
    (4, (4).to_bytes(4, "little"), "GGUF version 4 is not supported"),
    (16, (2**60).to_bytes(8, "little"), "truncated"),  # key/value count
    (8, (2**40).to_bytes(8, "little"), "truncated"),  # tensor count
    (24, (2**63).to_bytes(8, "little"), "truncated"),  # first key's length
])
def test_garbage_in_the_header_is_one_line(tmp_path, at, value, message):
    assert message in _error(_patched(tmp_path, at, value))


def test_unknown_types_and_bad_strings_are_one_line(tmp_path):
    whole = tmp_path / "whole.gguf"
    write_every_type(whole)
    data = whole.read_bytes()
    key = b"test.scalar.uint8"
    at = data.index(key) + len(key)
    assert "key 'test.scalar.uint8' has unknown value type 99" in _error(_patched(tmp_path, at, (99).to_bytes(4, "little")))
    at = data.index(b"tok299")
    assert "string 299 is not UTF-8" in _error(_patched(tmp_path, at, b"\xff"))
    name = b"q8_0.weight"
    at = data.index(name) + len(name) + 4 + 8 * 2
    assert int.from_bytes(data[at:at + 4], "little") == T.Q8_0
    assert "tensor 'q8_0.weight' has unknown type 77" in _error(_patched(tmp_path, at, (77).to_bytes(4, "little")))
    at = data.index(b"f16.weight") + len(b"f16.weight") + 4 + 8
    assert int.from_bytes(data[at:at + 4], "little") == T.F16
    assert "tensor 'f16.weight' (Q4_K) has rows of 64 values, not a multiple of its block of 256" in _error(
        _patched(tmp_path, at, int(T.Q4_K).to_bytes(4, "little")))
