"""The README's Python examples run as written, on tiny models saved as target.gguf and drafter.gguf (so the
examples cannot drift from the API)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_dspark.convert.converter import convert
from pyllama_dspark.testing import TinySpec, tiny_model, write_tiny_dspark_checkpoint

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S)


@pytest.fixture(scope="module")
def workdir(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    spec = TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml")
    target = tiny_model(spec, cache_dir=model_dir)
    shutil.copy(target, folder / "target.gguf")
    ck = write_tiny_dspark_checkpoint(folder / "ck", target=spec, block_size=4, target_cache_dir=model_dir)
    convert(ck, folder / "drafter.gguf", target_gguf=target)
    return folder


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs(workdir, index):
    proc = subprocess.run([sys.executable, "-c", BLOCKS[index]], cwd=workdir, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"README python block {index + 1}:\n{BLOCKS[index]}\n{proc.stderr[-3000:]}"
