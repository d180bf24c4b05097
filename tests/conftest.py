"""Shared fixtures: tiny deterministic models built once per session by the kit."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NamedTuple

import gguf
import pytest

from pyllama_dspark.model import quantize
from pyllama_dspark.testing import TinySpec, tiny_model

ARCHS = ["llama", "qwen3", "qwen35"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    # PYLLAMA_DSPARK_TEST_MODEL_DIR: a folder kept between sessions (scripts/mutation_check.py runs a session per
    # mutant); files are named by a hash of their spec and written atomically, so sessions can share it
    shared = os.environ.get("PYLLAMA_DSPARK_TEST_MODEL_DIR")
    return Path(shared) if shared else tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def make_model(model_dir):
    """make_model(arch=..., vocab=..., ...) -> path of a tiny GGUF, built once per spec."""

    def build(**fields):
        return tiny_model(TinySpec(**fields), cache_dir=model_dir)

    return build


class TinyPair(NamedTuple):
    target: Path  # the tiny target GGUF
    drafter: Path  # a random-weight DSpark drafter converted for it (with its vocabulary)
    checkpoint: Path  # the HF checkpoint the drafter was converted from


@pytest.fixture(scope="session")
def make_pair(model_dir, tmp_path_factory):
    """make_pair(spec, block_size=4) -> TinyPair, built once per (spec, block size)."""
    from pyllama_dspark.convert.converter import convert
    from pyllama_dspark.testing import write_tiny_dspark_checkpoint

    cache = {}

    def build(spec: TinySpec, block_size: int = 4) -> TinyPair:
        if (spec, block_size) not in cache:
            target = tiny_model(spec, cache_dir=model_dir)
            folder = tmp_path_factory.mktemp("pair")
            ck = write_tiny_dspark_checkpoint(folder / "ck", target=spec, block_size=block_size,
                                              target_cache_dir=model_dir)
            cache[spec, block_size] = TinyPair(target, convert(ck, folder / "drafter.gguf", target_gguf=target).path,
                                               ck)
        return cache[spec, block_size]

    return build


@pytest.fixture(scope="session")
def quantized(make_model, tmp_path_factory):
    """quantized(arch, qtype) -> a 3-layer tiny target with weights in qtype (f32 = unquantized)."""
    folder = tmp_path_factory.mktemp("quantized")
    cache = {}

    def get(arch, qtype):
        if (arch, qtype) not in cache:
            src = make_model(arch=arch, n_layer=3)
            cache[arch, qtype] = src if qtype == "f32" else quantize(src, folder / f"{arch}-{qtype}.gguf", qtype)
        return cache[arch, qtype]

    return get


def copy_with_value(src, dst, key: str, value: int):
    """A copy of the GGUF at src whose scalar metadata ``key`` holds ``value`` (rewritten in place)."""
    shutil.copy(src, dst)
    reader = gguf.GGUFReader(dst, "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    del reader  # flushes the memory map
    return dst
