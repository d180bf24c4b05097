"""Fuzzed model files and checkpoints fail with our named errors, never a crash (issue 14).

A fixed seed and 40 cases per input kind in CI; ``PYLLAMA_DSPARK_FUZZ_CASES=N`` (and
``PYLLAMA_DSPARK_FUZZ_SEED``) for a longer run. The counts are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import os
import random
import shutil

import pytest

from fuzzing import FuzzReport, Worker, fuzz, gguf_slots, mutate_checkpoint, mutate_gguf
from pyllama_dspark.testing import TinySpec

pytestmark = pytest.mark.fuzz
SPEC = TinySpec(arch="llama", n_layer=2, vocab="llama-spm")
N_CASES = int(os.environ.get("PYLLAMA_DSPARK_FUZZ_CASES", "40"))
SEED = int(os.environ.get("PYLLAMA_DSPARK_FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def inputs(make_pair):
    return make_pair(SPEC)._asdict()


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def test_the_unmutated_inputs_load(inputs, worker, tmp_path):
    report = fuzz([({"kind": "target", "path": str(inputs["target"])}, "none"),
                   ({"kind": "drafter", "path": str(inputs["drafter"]), "target": str(inputs["target"])}, "none"),
                   ({"kind": "checkpoint", "path": str(inputs["checkpoint"]), "out": str(tmp_path / "d.gguf"),
                     "target": str(inputs["target"])}, "none")], worker, FuzzReport())
    assert report.counts["loaded"] == 3, report.problems


def test_the_header_walk_finds_every_slot(inputs):
    data = inputs["drafter"].read_bytes()
    slots, header_end = gguf_slots(data)
    names = {s.what for s in slots}
    assert {"n_tensors", "n_kv", "type of general.architecture"} <= names
    assert any(w.startswith("dim 0 of ") for w in names) and any(w.startswith("offset of ") for w in names)
    assert header_end < len(data) and all(s.offset + s.size <= header_end for s in slots)


def _gguf_cases(kind: str, inputs: dict, folder, rng: random.Random):
    original = inputs[kind].read_bytes()
    for i in range(N_CASES):
        data, description = mutate_gguf(original, rng)
        path = folder / f"{kind}-{i % 4}.gguf"  # a few files in turn: the disk does not fill on long runs
        path.write_bytes(data)
        yield {"kind": kind, "path": str(path), "target": str(inputs["target"])}, description


def _checkpoint_cases(inputs: dict, folder, rng: random.Random):
    for i in range(N_CASES):
        dst = folder / f"ck-{i % 4}"
        description = mutate_checkpoint(inputs["checkpoint"], dst, rng)
        out = folder / f"out-{i % 4}.gguf"
        out.unlink(missing_ok=True)
        yield {"kind": "checkpoint", "path": str(dst), "out": str(out), "target": str(inputs["target"])}, description


# the checkpoint kind (the converter, in Python) takes 24 s here and 86 s under AddressSanitizer: slow
@pytest.mark.parametrize("kind", ["target", "drafter", pytest.param("checkpoint", marks=pytest.mark.slow)])
def test_mutated_inputs_fail_with_our_named_errors(inputs, worker, tmp_path, kind):
    rng = random.Random(f"{SEED}-{kind}")
    cases = (_checkpoint_cases(inputs, tmp_path, rng) if kind == "checkpoint"
             else _gguf_cases(kind, inputs, tmp_path, rng))
    report = fuzz(cases, worker, FuzzReport())
    shutil.rmtree(tmp_path, ignore_errors=True)
    summary = report.line(f"fuzz {kind} (seed {SEED})") + " " + dict(report.errors).__repr__()
    print(summary)
    assert sum(report.counts.values()) == N_CASES
    assert not report.problems, summary + "\n" + "\n".join(report.problems)
