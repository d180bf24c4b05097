"""The header-only GGUF reader (gguf_header.py) against gguf-py's full reader, and its refusals; a drafter
loads and samples without the full reader (which parses every tokenizer array: seconds per open). Hand-built files
check every value type, the data alignment, the tensor types and every refusal's message byte by byte."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from pyllama_dspark.convert.converter import convert
from pyllama_dspark.gguf_header import GGUFFormatError, GGUFHeader, StringArray, TensorInfo
from pyllama_dspark.model import quantize
from pyllama_dspark.testing import TinySpec, tiny_model, write_tiny_dspark_checkpoint

SPEC = TinySpec(arch="llama", n_layer=3, vocab="llama-spm")


@pytest.fixture(scope="module")
def files(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-header")
    target = tiny_model(SPEC, cache_dir=model_dir)
    ck = write_tiny_dspark_checkpoint(folder / "ck", target=SPEC, target_cache_dir=model_dir)
    drafter = convert(ck, folder / "drafter-bf16.gguf", target_gguf=target).path  # bf16, with the vocabulary
    q8 = convert(ck, folder / "drafter-q8.gguf", outtype="q8_0", target_gguf=target).path
    q41 = quantize(tiny_model(TinySpec(arch="qwen35", n_layer=2), cache_dir=model_dir), folder / "q41.gguf", "q4_1")
    return {"target": target, "drafter": drafter, "q8_0 drafter": q8, "q4_1 qwen35": q41}


@pytest.mark.parametrize("which", ["target", "drafter", "q8_0 drafter", "q4_1 qwen35"])
def test_same_metadata_tensor_table_and_data_as_gguf_py(files, which):
    path = files[which]
    header, full = GGUFHeader(path), gguf.GGUFReader(path)
    keys = [k for k in full.fields if not k.startswith("GGUF.")]
    assert list(header.fields) == keys
    for key in keys:
        want = full.fields[key].contents()
        got = header.value(key)
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key
    assert list(header.tensors) == [t.name for t in full.tensors]
    for t in full.tensors:
        info = header.tensors[t.name]
        assert (info.shape, info.ggml_type, info.offset) == (tuple(int(n) for n in t.shape), t.tensor_type.value,
                                                             t.data_offset), t.name
        data = header.tensor_data(t.name)
        assert data.dtype == t.data.dtype and data.shape == t.data.shape, t.name
        np.testing.assert_array_equal(data, t.data, err_msg=t.name)
    if which == "target":  # the vocabulary is skipped until asked for
        assert isinstance(header.fields["tokenizer.ggml.tokens"], StringArray)
        assert header.fields["tokenizer.ggml.tokens"].count == 32000


def test_truncated_and_foreign_files_raise_a_format_error(files, tmp_path):
    data = files["target"].read_bytes()
    cases = {"short": data[:20], "magic": b"GGUX" + data[4:64], "version": data[:4] + b"\x09\x00\x00\x00" + data[8:64],
             "cut in the vocabulary": data[: len(data) // 10], "cut in a key": data[:40]}
    for name, content in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(GGUFFormatError):
            GGUFHeader(path)
    assert issubclass(GGUFFormatError, ValueError)


def test_a_drafter_loads_and_samples_without_the_full_reader(files, monkeypatch):
    from pyllama_dspark import Context, Model
    from pyllama_dspark.drafter import DSparkDrafter
    from pyllama_dspark.sampling import Sampler, SamplingParams

    def refuse(*args, **kwargs):
        raise AssertionError("gguf.GGUFReader parses every tokenizer array: the drafter must not open it")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    with Model(files["target"]) as model:
        ctx = Context(model, n_ctx=64)
        assert DSparkDrafter.peek_block_size(files["drafter"]) == 4
        drafter = DSparkDrafter(files["drafter"], ctx)
        ctx.set_capture_layers(drafter.capture_layers, masked=False)
        from pyllama_dspark import Batch

        batch = Batch(8)
        batch.add_tokens([1, 2, 3, 4], 0, logits="last")
        ctx.decode(batch)
        drafter.observe(np.array([1, 2, 3, 4]), ctx.capture().copy(), 0)
        draft = drafter.propose(5, 4, sampler=Sampler(SamplingParams(temperature=1.0, seed=0)))
        assert len(draft.tokens) == 4 and draft.probs is not None
        drafter.close()


# --- hand-built files: every value type, layout rule and refusal, byte by byte ------------------------------------
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def key_value(key: str, vtype: int, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", vtype) + payload


def array(key: str, etype: int, count: int, items: bytes) -> bytes:
    return key_value(key, ARRAY, struct.pack("<IQ", etype, count) + items)


def tensor_entry(name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return (gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", ggml_type, offset))


def gguf_bytes(keys=(), tensors=(), data=b"", *, version=3, n_tensors=None, n_kv=None, alignment=32) -> bytes:
    head = (b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                  len(keys) if n_kv is None else n_kv) + b"".join(keys) + b"".join(tensors))
    if data:
        head += b"\0" * (-len(head) % alignment)
    return head + data


def write(tmp_path, content: bytes, name: str = "x.gguf"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


def refused(tmp_path, content: bytes, message: str) -> None:
    with pytest.raises(GGUFFormatError) as caught:
        GGUFHeader(write(tmp_path, content))
    assert str(caught.value) == f"x.gguf: {message}"


def test_every_scalar_type_string_and_array_reads_back(tmp_path):
    keys = [key_value("u8", U8, struct.pack("<B", 255)), key_value("i8", I8, struct.pack("<b", -128)),
            key_value("u16", U16, struct.pack("<H", 65535)), key_value("i16", I16, struct.pack("<h", -32768)),
            key_value("u32", U32, struct.pack("<I", 2**32 - 1)), key_value("i32", I32, struct.pack("<i", -2**31)),
            key_value("f32", F32, struct.pack("<f", -0.375)), key_value("yes", BOOL, b"\x01"),
            key_value("no", BOOL, b"\x00"), key_value("two", BOOL, b"\x02"),
            key_value("u64", U64, struct.pack("<Q", 2**64 - 1)), key_value("i64", I64, struct.pack("<q", -2**63)),
            key_value("f64", F64, struct.pack("<d", 1e300)), key_value("text", STRING, gguf_string("héllo")),
            key_value("bad utf-8", STRING, gguf_string(b"a\xffb")),
            array("ints", I32, 3, struct.pack("<3i", 1, -2, 3)), array("halves", F32, 2, struct.pack("<2f", 0.5, 2)),
            array("none", U8, 0, b""), array("flags", BOOL, 2, b"\x01\x00"),
            array("words", STRING, 4, gguf_string("a") + gguf_string("bc") + gguf_string("") + gguf_string(b"\xfe")),
            array("big", U64, 1, struct.pack("<Q", 2**63 + 1))]
    header = GGUFHeader(write(tmp_path, gguf_bytes(keys)))
    assert header.version == 3 and header.tensors == {}
    want = {"u8": 255, "i8": -128, "u16": 65535, "i16": -32768, "u32": 2**32 - 1, "i32": -2**31, "f32": -0.375,
            "yes": True, "no": False, "two": True, "u64": 2**64 - 1, "i64": -2**63, "f64": 1e300, "text": "héllo",
            "bad utf-8": "a\ufffdb", "ints": [1, -2, 3], "halves": [0.5, 2.0], "none": [], "flags": [True, False],
            "words": ["a", "bc", "", "\ufffd"], "big": [2**63 + 1]}
    assert list(header.fields) == list(want)
    for key, value in want.items():
        got = header.value(key)
        assert got == value and type(got) is type(value), key
        if isinstance(value, list) and value:
            assert type(got[0]) is type(value[0]), key
    assert header.value("words") == ["a", "bc", "", "\ufffd"]  # asked twice, same answer
    assert header.raw_strings("words") == [b"a", b"bc", b"", b"\xfe"]
    assert header.raw_strings("ints") == [] and header.raw_strings("absent") == [] and header.raw_strings("text") == []
    assert header.value("absent") is None and header.value("absent", 7) == 7 and header.value("no", 7) is False
    words = header.fields["words"]
    assert isinstance(words, StringArray) and words.count == 4
    assert header.fields["ints"].dtype == np.dtype("<i4") and header.fields["halves"].dtype == np.dtype("<f4")


def test_data_starts_at_the_next_multiple_of_the_alignment(tmp_path):
    values = np.arange(6, dtype=np.float32)
    for alignment, extra in ((32, b""), (64, b""), (1, b""), (32, b"xxxxxx")):
        keys = [key_value("general.alignment", U32, struct.pack("<I", alignment))] if alignment != 32 else []
        keys.append(key_value("pad", STRING, gguf_string(extra)))
        tensors = [tensor_entry("w", (3, 2), 0, 0), tensor_entry("v", (2,), 0, 24)]
        content = gguf_bytes(keys, tensors, values.tobytes() + values[:2].tobytes(), alignment=alignment)
        header = GGUFHeader(write(tmp_path, content))
        assert header.data_offset % alignment == 0 and header.data_offset == len(content) - 32  # 32 data bytes
        assert header.tensors == {"w": TensorInfo("w", (3, 2), 0, header.data_offset),
                                  "v": TensorInfo("v", (2,), 0, header.data_offset + 24)}
        np.testing.assert_array_equal(header.tensor_data("w"), values.reshape(2, 3))
        np.testing.assert_array_equal(header.tensor_data("v"), values[:2])


def test_a_table_already_aligned_starts_its_data_right_there(tmp_path):
    # header 24 + key "k" (8 + 1 + 4 + 8 + len) + tensor "w" (8 + 1 + 4 + 8 + 4 + 8): pad the string to end at 96
    table = tensor_entry("w", (4,), 0, 0)
    head_len = 24 + len(key_value("k", STRING, gguf_string(""))) + len(table)
    content = gguf_bytes([key_value("k", STRING, gguf_string("x" * (96 - head_len)))], [table],
                         np.ones(4, np.float32).tobytes())
    header = GGUFHeader(write(tmp_path, content))
    assert header.data_offset == 96 and len(content) == 96 + 16


def test_an_empty_24_byte_header_is_valid(tmp_path):
    header = GGUFHeader(write(tmp_path, gguf_bytes(version=2)))
    assert (header.version, header.fields, header.tensors, header.data_offset) == (2, {}, {}, 32)


PLAIN = [(0, np.float32), (1, np.float16), (24, np.int8), (25, np.int16), (26, np.int32), (27, np.int64),
         (28, np.float64)]


@pytest.mark.parametrize("ggml_type, dtype", PLAIN, ids=[np.dtype(d).name for _, d in PLAIN])
def test_plain_tensors_come_back_typed_in_numpy_order(tmp_path, ggml_type, dtype):
    values = np.array([[1, -2, 3], [4, 5, -6]], dtype=dtype)
    header = GGUFHeader(write(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (3, 2), ggml_type, 0)],
                                                   data=values.tobytes())))
    data = header.tensor_data("w")
    assert data.dtype == dtype and data.shape == (2, 3)
    np.testing.assert_array_equal(data, values)
    dequantized = header.dequantized("w")
    assert dequantized.dtype == np.float64
    np.testing.assert_array_equal(dequantized, values.astype(np.float64))


def test_block_types_come_back_as_bytes_per_row_and_dequantize(tmp_path):
    quants = np.arange(-16, 16, dtype=np.int8)
    row = np.float16(0.5).tobytes() + quants.tobytes()  # one q8_0 block: scale, 32 int8
    bf16 = np.array([1.0, -2.0, 3.5, 0.25], np.float32).view(np.uint32) >> 16
    tensors = [tensor_entry("q", (32, 2), 8, 0), tensor_entry("b", (2, 2), 30, 2 * len(row) + 28)]
    data = row + row[:2] + (-quants).tobytes() + b"\0" * 28 + bf16.astype("<u2").tobytes()
    header = GGUFHeader(write(tmp_path, gguf_bytes(tensors=tensors, data=data)))
    q = header.tensor_data("q")
    assert q.dtype == np.uint8 and q.shape == (2, 34)
    np.testing.assert_array_equal(header.dequantized("q"), np.stack([quants, -quants]).astype(np.float64) / 2)
    b = header.tensor_data("b")
    assert b.dtype == np.uint8 and b.shape == (2, 4)
    np.testing.assert_array_equal(header.dequantized("b"), [[1.0, -2.0], [3.5, 0.25]])


def test_at_most_eight_dimensions(tmp_path):
    header = GGUFHeader(write(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (1,) * 7 + (2,), 0, 0)],
                                                   data=b"\0" * 8)))
    assert header.tensors["w"].shape == (1,) * 7 + (2,) and header.tensor_data("w").shape == (2,) + (1,) * 7
    refused(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (1,) * 9, 0, 0)], data=b"\0" * 4),
            "tensor w has 9 dimensions")


def test_refusals_name_the_file_and_what_is_wrong(tmp_path):
    valid = gguf_bytes([key_value("k", U32, b"\x01\0\0\0")])
    refused(tmp_path, valid[:23], "23 bytes is too short for a GGUF header")
    refused(tmp_path, b"GGUX" + valid[4:], "not a GGUF file (magic b'GGUX')")
    for version in (1, 4):
        refused(tmp_path, gguf_bytes(version=version), f"GGUF version {version} is not supported (2 or 3)")
    refused(tmp_path, gguf_bytes(n_tensors=10**6), "implausible counts (1000000 tensors, 0 keys)")
    refused(tmp_path, gguf_bytes(n_kv=10**6), "implausible counts (0 tensors, 1000000 keys)")
    refused(tmp_path, gguf_bytes([key_value("k", 13, b"\0" * 8)]), "unknown value type 13 at byte 33")
    refused(tmp_path, gguf_bytes([struct.pack("<Q", 50) + b"k"]),
            "a string of 50 bytes runs past the end of the file")
    refused(tmp_path, gguf_bytes([key_value("k", STRING, gguf_string("abc")[:-1])]),
            "a string of 3 bytes runs past the end of the file")
    refused(tmp_path, gguf_bytes([array("k", U32, 3, b"\0" * 11)]),
            "an array of 3 values runs past the end of the file")
    refused(tmp_path, gguf_bytes([array("k", STRING, 2, gguf_string("a") + struct.pack("<Q", 5) + b"abcd")]),
            "a string array runs past the end of the file")
    refused(tmp_path, gguf_bytes([array("k", ARRAY, 0, b"")]), "arrays of value type 9 are not supported")
    for alignment in (0, 48):
        refused(tmp_path, gguf_bytes([key_value("general.alignment", U32, struct.pack("<I", alignment))]),
                f"general.alignment {alignment} is not a power of two")
    refused(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (4,), 99, 0)], data=b"\0" * 16),
            "tensor w has unknown type 99")
    refused(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (16,), 8, 0)], data=b"\0" * 34),
            "tensor w of 16 values is not whole blocks of 32")
    refused(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (4,), 0, 0)], data=b"\0" * 15),
            "tensor w runs past the end of the file (truncated?)")
    refused(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (4,), 0, 4)], data=b"\0" * 16),
            "tensor w runs past the end of the file (truncated?)")
    with pytest.raises(GGUFFormatError, match=r"^x\.gguf: the header ends early \("):
        GGUFHeader(write(tmp_path, valid[:-1]))


def test_values_that_end_exactly_at_the_end_of_the_file_are_whole(tmp_path):
    for last in (key_value("s", STRING, gguf_string("abc")), array("a", U16, 2, b"\1\0\2\0"),
                 array("w", STRING, 2, gguf_string("x") + gguf_string("yz"))):
        header = GGUFHeader(write(tmp_path, gguf_bytes([last])))
        assert header.value(list(header.fields)[0]) in ("abc", [1, 2], ["x", "yz"])
    header = GGUFHeader(write(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (4,), 0, 0)], data=b"\0" * 16)))
    assert header.tensor_data("w").tolist() == [0.0] * 4
    # counts as large as the file are not refused as implausible: the header then ends early
    content = gguf_bytes()
    with pytest.raises(GGUFFormatError, match="ends early"):
        GGUFHeader(write(tmp_path, content[:16] + struct.pack("<Q", len(content))))
    with pytest.raises(GGUFFormatError, match="ends early"):
        GGUFHeader(write(tmp_path, content[:8] + struct.pack("<Q", len(content)) + content[16:]))


def test_counts_lengths_and_types_are_unsigned(tmp_path):
    """Every count, length, type and offset is an unsigned integer: values with the top bit set are huge, never
    negative (a negative length would walk the parser backwards)."""
    big32, big64 = 2**32 - 1, 2**64 - 1
    refused(tmp_path, gguf_bytes(version=2**31 + 3), f"GGUF version {2**31 + 3} is not supported (2 or 3)")
    refused(tmp_path, gguf_bytes(n_tensors=big64), f"implausible counts ({big64} tensors, 0 keys)")
    refused(tmp_path, gguf_bytes(n_kv=2**63), f"implausible counts (0 tensors, {2**63} keys)")
    refused(tmp_path, gguf_bytes([key_value("k", big32, b"\0" * 8)]), f"unknown value type {big32} at byte 33")
    refused(tmp_path, gguf_bytes([struct.pack("<Q", big64) + b"k" * 8]),
            f"a string of {big64} bytes runs past the end of the file")
    refused(tmp_path, gguf_bytes([array("k", big32, 0, b"")]), f"arrays of value type {big32} are not supported")
    refused(tmp_path, gguf_bytes([array("k", U8, big64, b"\0" * 8)]),
            f"an array of {big64} values runs past the end of the file")
    refused(tmp_path, gguf_bytes([array("k", STRING, 2, struct.pack("<Q", big64) + b"abcdefgh" * 4)]),
            "a string array runs past the end of the file")
    entry = gguf_string("w") + struct.pack("<I", big32) + struct.pack("<Q", 4) * 4
    refused(tmp_path, gguf_bytes(tensors=[entry], data=b"\0" * 64), f"tensor w has {big32} dimensions")
    refused(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (4,), big32, 0)], data=b"\0" * 16),
            f"tensor w has unknown type {big32}")
    refused(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (4,), 0, big64 - 15)], data=b"\0" * 64),
            "tensor w runs past the end of the file (truncated?)")
    # a size whose element count overflows 64 bits is still far past the end of the file
    refused(tmp_path, gguf_bytes(tensors=[tensor_entry("w", (2**32, 2**32), 0, 0)], data=b"\0" * 64),
            "tensor w runs past the end of the file (truncated?)")


def test_block_tensors_of_three_dimensions_and_dequantized_dtypes(tmp_path):
    block = np.float16(0.25).tobytes() + np.arange(32, dtype=np.int8).tobytes()
    header = GGUFHeader(write(tmp_path, gguf_bytes(tensors=[tensor_entry("q", (32, 2, 3), 8, 0)], data=block * 6)))
    data = header.tensor_data("q")
    assert data.shape == (3, 2, 34) and data.dtype == np.uint8
    dequantized = header.dequantized("q")
    assert dequantized.dtype == np.float64 and dequantized.shape == (3, 2, 32)
    np.testing.assert_array_equal(dequantized, np.broadcast_to(np.arange(32) / 4, (3, 2, 32)))
