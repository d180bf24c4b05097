"""The header-only GGUF reader (gguf_header.py) against gguf-py's full reader, and its refusals; a drafter
loads and samples without the full reader (which parses every tokenizer array: seconds per open)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pyllama_dspark.convert.converter import convert
from pyllama_dspark.gguf_header import GGUFFormatError, GGUFHeader, StringArray
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
