"""Drafter training (``pyllama-dspark train``): the PyTorch module against the runtime graph, learning,
resuming, and bad input. Needs the [train] extra (torch); skipped with the install command otherwise."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch: pip install torch==2.13.0 && pip install '.[train]'")

from pyllama_dspark import Batch, Context, DSparkDrafter, Model  # noqa: E402
from pyllama_dspark.testing import TinySpec, tiny_model  # noqa: E402
from pyllama_dspark.train.export import export_gguf  # noqa: E402
from pyllama_dspark.train.model import DraftConfig, DSparkDraft, load_frozen_target  # noqa: E402
from pyllama_dspark.train.pipeline import KILL_ENV, KILLED_STATUS  # noqa: E402

WORDS = ("apple banana cherry river mountain seven blue quick dog cat house tree sun moon star green red small big "
         "old new the a of and to in is was he she it").split()


def write_prompts(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = [json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))}) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllama_dspark", *args], capture_output=True, text=True,
                          errors="replace", cwd=tempfile.gettempdir(), timeout=900,
                          env={**os.environ, **(env or {})})


# --- the PyTorch module is a second reference of the dflash graph ---------------------------------------

@pytest.mark.parametrize("arch, n_vocab_draft", [("llama", None), ("qwen3", None), ("qwen35", None),
                                                  ("llama", 120), ("qwen35", 120)])
def test_module_slot_logits_equal_the_runtime_drafter(model_dir, tmp_path, arch, n_vocab_draft):
    spec = TinySpec(arch=arch, n_layer=4)
    target = tiny_model(spec, cache_dir=model_dir)
    frozen = load_frozen_target(target)
    n_vocab = frozen.token_embd.shape[0]
    config = DraftConfig(n_embd=spec.n_embd, n_taps=2, n_layer=2, n_head=frozen.n_head, n_head_kv=frozen.n_head_kv,
                         head_dim=spec.n_embd // frozen.n_head, n_ff=96, n_vocab=n_vocab, markov_rank=8, block_size=5,
                         mask_token=n_vocab - 1, eps=frozen.eps, rope_theta=frozen.rope_theta)
    torch.manual_seed(1)
    ids = None if n_vocab_draft is None else np.sort(np.random.default_rng(0).choice(n_vocab - 1, n_vocab_draft,
                                                                                     replace=False))
    module = DSparkDraft(config, frozen, ids)
    with torch.no_grad():  # away from the near-uniform init, so every term of the graph matters
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    export_gguf(module, (0, 2), tmp_path / "ck", tmp_path / "d.gguf", target, outtype="f32")
    prompt = (np.arange(40) * 37 % 250 + 1).tolist()
    with Model(target) as model:
        ctx = Context(model, n_ctx=256, n_batch=64)
        drafter = DSparkDrafter(tmp_path / "d.gguf", ctx, kv_type="f32", flash_attn=False)
        assert drafter.capture_layers == [0, 2]
        ctx.set_capture_layers(drafter.capture_layers, masked=False)
        batch = Batch(64)
        batch.add_tokens(prompt, 0, logits="last")
        ctx.decode(batch)
        rows = ctx.capture().copy()
        for n_context, anchor in [(3, 11), (17, 200), (40, 7)]:
            drafter.reset()
            drafter.observe(np.array(prompt[:n_context]), rows[:n_context], 0)
            draft = drafter.propose(anchor, n_context)
            logits, conf = module.propose(torch.from_numpy(rows[:n_context]), anchor)
            logits = logits.numpy()
            kept = np.arange(n_vocab) if ids is None else ids
            if ids is not None:  # the runtime scatters the draft rows to their target ids, -inf elsewhere
                assert drafter.info.n_vocab_draft == n_vocab_draft
                outside = np.setdiff1d(np.arange(n_vocab), ids)
                assert np.isneginf(draft.logits[:, outside]).all() and np.isneginf(logits[:, outside]).all()
            scale = float(np.abs(logits[:, kept]).max())
            assert np.abs(draft.logits[:, kept] - logits[:, kept]).max() <= 1e-3 * scale, (arch, n_context)
            assert draft.tokens.tolist() == logits.argmax(1).tolist()
            np.testing.assert_allclose(draft.confidence, conf.numpy(), atol=1e-4)


# --- the teacher: top-k probabilities stored by the data phase --------------------------------------------

def test_stored_top_k_equal_the_teacher_recomputed_from_the_last_layer(tmp_path, spm_target):
    """The data phase stores the target's top-32 next-token probabilities; the trainer's older path recomputes
    the teacher from the stored last-layer rows. Both describe the same distribution, and with k = the whole
    vocabulary the sparse loss terms equal the dense ones."""
    from pyllama_dspark.train import trainer
    from pyllama_dspark.train.data import Record, decode_rows, load_sequences, top_k_probabilities
    from pyllama_dspark.train.settings import WorkDir

    prompts = write_prompts(tmp_path / "p.jsonl", 4, 7)
    result = cli("train", "--target", str(spm_target), "--prompts", str(prompts), "--n-predict", "12",
                 "--block-size", "3", "--data-only", "--n-threads", "2", "--work-dir", str(tmp_path / "w"),
                 "--outfile", str(tmp_path / "unused.gguf"))
    assert result.returncode == 0, result.stderr[-2000:]
    records = load_sequences(WorkDir(tmp_path / "w"))
    frozen = load_frozen_target(spm_target)
    n_vocab = frozen.token_embd.shape[0]
    config = DraftConfig(n_embd=64, n_taps=2, n_layer=1, n_head=frozen.n_head, n_head_kv=frozen.n_head_kv,
                         head_dim=64 // frozen.n_head, n_ff=96, n_vocab=n_vocab, markov_rank=4, block_size=3,
                         mask_token=n_vocab - 1, eps=frozen.eps, rope_theta=frozen.rope_theta)
    module = DSparkDraft(config, frozen)
    for r in records:
        n_gen = len(r.tokens) - r.prompt_len
        assert r.top_ids.shape == (n_gen, 32) and r.top_p.dtype == np.float16
        rows = torch.from_numpy(decode_rows(r.last[r.prompt_len - 1:]))
        with torch.no_grad():
            teacher = torch.softmax(module.teacher_logits(rows), -1).numpy()
        np.testing.assert_allclose(r.top_p.astype(np.float32), np.take_along_axis(teacher, r.top_ids, 1),
                                   atol=2e-3)
        # greedy continuations: the generated token is the teacher's argmax (its top-1)
        assert (r.top_ids[:, 0] == r.tokens[r.prompt_len:]).all()
        # the whole vocabulary as "top k": sparse terms = dense terms
        logits = torch.from_numpy(teacher).log()
        full_ids, full_p = zip(*(top_k_probabilities(row, n_vocab) for row in logits.numpy()))
        whole = Record(r.tokens, r.prompt_len, r.taps, r.last, np.stack(full_ids), np.stack(full_p))
        positions = torch.arange(r.prompt_len, len(r.tokens) - 1)
        log_q = torch.log_softmax(torch.randn(len(positions), n_vocab), -1)
        sparse = trainer._sparse_teacher_terms(module, whole, positions, log_q)
        dense = trainer._dense_teacher_terms(module, whole, positions, log_q)
        for a, b in zip(sparse, dense):
            np.testing.assert_allclose(a.numpy(), b.numpy(), atol=5e-3)


def test_top_k_probabilities_are_the_softmax_of_the_whole_row():
    from pyllama_dspark.train.data import top_k_probabilities

    logits = np.array([0.5, 3.0, -1.0, 2.0, 2.0], dtype=np.float32)
    ids, p = top_k_probabilities(logits, 3)
    softmax = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert ids.tolist() == [1, 3, 4]  # most likely first; the tie in id order
    np.testing.assert_allclose(p.astype(np.float64), softmax[[1, 3, 4]], rtol=1e-3)


@pytest.mark.parametrize("n", [262_144, 49_152, 1_000, 300, 40])
def test_top_k_of_a_row_equals_a_full_sort_with_ties(n):
    """Only the chunks that can hold the top k are sorted: the ids equal a stable sort of the whole row (ties to
    the lower id, several tied at the top), for vocabularies that are and are not multiples of the chunk, and k
    above the number of chunks."""
    from pyllama_dspark.train.data import top_k_probabilities

    rng = np.random.default_rng(n)
    for k in (1, 5, 32, n):
        logits = (rng.standard_normal(n) * 4).astype(np.float32)
        logits[rng.integers(0, n, 6)] = logits.max()
        logits[rng.integers(0, n, 6)] = np.float32(-np.inf) if k == 5 else logits.min()
        ids, p = top_k_probabilities(logits, k)
        want = np.lexsort((np.arange(n), -logits))[:k]
        assert ids.tolist() == want.tolist()
        z = np.exp(logits.astype(np.float64) - logits.max())
        np.testing.assert_allclose(p.astype(np.float64), (z / z.sum())[want], rtol=2e-3, atol=1e-7)


def test_rows_beyond_float16_are_stored_as_bfloat16_rounded_to_nearest_even(tmp_path):
    """Gemma 3's layers reach 1e5 at the BOS position: float16 would store infinity. Rows that fit stay float16;
    others become bfloat16 bits equal to torch's own rounding, and decode to within 2^-8 of each value."""
    from pyllama_dspark.train.data import Record, _write_shard, decode_rows, encode_rows, load_sequences
    from pyllama_dspark.train.settings import TrainError, WorkDir

    rng = np.random.default_rng(0)
    small = (rng.standard_normal((7, 48)) * 300).astype(np.float32)
    stored = encode_rows(small)
    assert stored.dtype == np.float16 and np.array_equal(decode_rows(stored), small.astype(np.float16).astype(np.float32))
    large = small.copy()
    large[0, :5] = [1.0e5, -103772.0, 65505.0, 3.0e38, 1.0 + 2.0 ** -8]  # the last: a tie, rounded to even (1.0)
    stored = encode_rows(large)
    assert stored.dtype == np.uint16
    reference = torch.from_numpy(large).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(decode_rows(stored), reference)
    np.testing.assert_allclose(decode_rows(stored), large, rtol=2.0 ** -8)
    for bad in (np.nan, np.inf):
        broken = small.copy()
        broken[3, 3] = bad
        with pytest.raises(TrainError, match="NaN or infinity"):
            encode_rows(broken, "shard-00000.npz")

    work = WorkDir(tmp_path / "w")
    work.data.mkdir(parents=True)
    tokens = np.arange(8, dtype=np.int32)
    records = [Record(tokens, 3, large[:7, :32], large[:7, 32:]), Record(tokens, 2, small[:7, :32], small[:7, 32:])]
    info = _write_shard(work.data / "shard-00000.npz", records, range(2))
    # per shard and array: one large value makes the shard's taps bf16; its last-layer rows fit float16
    assert info["rows"] == {"taps": "bf16", "last": "f16"}
    (work.data / "manifest.json").write_text(json.dumps({"shards": {"shard-00000.npz": info}}))
    back = load_sequences(work)
    np.testing.assert_array_equal(decode_rows(back[0].taps), reference[:, :32])
    np.testing.assert_allclose(decode_rows(back[1].taps), small[:7, :32], rtol=2.0 ** -8)
    np.testing.assert_array_equal(decode_rows(back[1].last), small[:7, 32:].astype(np.float16).astype(np.float32))


def test_the_drafter_is_bf16_by_default_when_the_rows_left_float16s_range(tmp_path):
    from pyllama_dspark.train.pipeline import resolve_outtype
    from pyllama_dspark.train.settings import TrainError, WorkDir

    work = WorkDir(tmp_path / "w")
    work.data.mkdir(parents=True)
    shards = {"shard-00000.npz": {"rows": {"taps": "f16", "last": "f16"}}}
    (work.data / "manifest.json").write_text(json.dumps({"shards": shards}))
    assert [resolve_outtype(t, work) for t in ("auto", "f16", "bf16", "q8_0", "f32")] == \
        ["f16", "f16", "bf16", "q8_0", "f32"]
    shards["shard-00001.npz"] = {"rows": {"taps": "bf16", "last": "f16"}}
    (work.data / "manifest.json").write_text(json.dumps({"shards": shards}))
    assert [resolve_outtype(t, work) for t in ("auto", "bf16", "q8_0", "f32")] == ["bf16", "bf16", "q8_0", "f32"]
    with pytest.raises(TrainError, match="--outtype f16: the target's captured activations exceed"):
        resolve_outtype("f16", work)


def test_placeholder_control_tokens_are_not_required_in_a_draft_vocabulary():
    from pyllama_dspark.train.vocab import is_placeholder

    for name in ("<unused0>", "<unused6241>", "<|reserved_special_token_17|>", "[unused3]"):
        assert is_placeholder(name)
    for name in ("<mask>", "<start_of_turn>", "<|im_start|>", "<unused>", "<unused0> ", "unused0", "<pad>"):
        assert not is_placeholder(name)


# --- the reduced draft vocabulary: which tokens are kept ------------------------------------------------

def test_draft_vocabulary_keeps_required_tokens_then_the_most_frequent_never_the_mask():
    from pyllama_dspark.train.vocab import choose_draft_vocab, coverage, output_counts

    counts = output_counts([(np.array([9, 9, 1, 5, 5, 5, 7, 3, 3]), 2), (np.array([4, 4, 4, 4, 6]), 0)], 12)
    # generated parts only: [1, 5, 5, 5, 7, 3, 3] and [4, 4, 4, 4, 6]; the first prompt's two 9s do not count
    assert counts.tolist() == [0, 1, 0, 2, 4, 3, 1, 1, 0, 0, 0, 0]
    assert choose_draft_vocab(counts, 3, required=[], mask_token=11).tolist() == [3, 4, 5]
    # required ids go in first (the mask token never), then the most frequent; ties go to the lower id
    assert choose_draft_vocab(counts, 4, required=[10, 11], mask_token=11).tolist() == [3, 4, 5, 10]
    assert choose_draft_vocab(counts, 5, required=[], mask_token=4).tolist() == [1, 3, 5, 6, 7]
    # unseen placeholders fill after every other unseen id; a placeholder the target wrote ranks by its count
    assert choose_draft_vocab(counts, 9, required=[], mask_token=11, last=[0, 2, 7]).tolist() == [1, *range(3, 11)]
    assert choose_draft_vocab(counts, 10, required=[], mask_token=11, last=[0, 2]).tolist() == [0, 1, *range(3, 11)]
    assert coverage(np.array([3, 4]), [3, 4, 4, 5]) == 0.75
    with pytest.raises(ValueError, match="cannot hold the 2 control"):
        choose_draft_vocab(counts, 1, required=[1, 2], mask_token=11)
    with pytest.raises(ValueError, match="needs 1..11 tokens"):
        choose_draft_vocab(counts, 12, required=[], mask_token=11)


def test_required_tokens_hold_control_end_of_generation_and_chat_template_tokens(model_dir):
    from pyllama_dspark.train.vocab import required_tokens

    path = tiny_model(TinySpec(arch="llama", n_layer=2, vocab="llama-spm"), cache_dir=model_dir)
    with Model(path) as model:
        special = {t for t in range(model.n_vocab) if model.is_eog(t) or model.is_control(t)}
        assert model.special_tokens["eos"] in special and model.special_tokens["bos"] in special
        expected = special | {t for t in model.special_tokens.values() if t >= 0}
        if model.chat_template is not None:
            text = model.apply_chat_template([{"role": "user", "content": "Hi."}])
            expected |= set(model.tokenize(text, parse_special=True).tolist())
            assert required_tokens(model) >= expected
        else:
            assert required_tokens(model) == expected


def test_train_with_a_reduced_draft_vocabulary_writes_d2t_and_stays_exact(tmp_path, spm_target):
    """``--draft-vocab N``: the GGUF carries d2t (N ids, the generated outputs' most frequent first), its own
    output rows and a reduced markov_w2; the drafter loads, drafts only those ids, and the output is exact."""
    import gguf

    prompts, held_out = write_prompts(tmp_path / "p.jsonl", 16, 1), write_prompts(tmp_path / "e.jsonl", 4, 2)
    result = cli("train", "--target", str(spm_target), "--prompts", str(prompts), "--eval-prompts", str(held_out),
                 "--n-predict", "16", "--block-size", "3", "--markov-rank", "4", "--steps", "4", "--anchors", "4",
                 "--draft-vocab", "100", "--n-threads", "2", "--outtype", "f32", "--work-dir", str(tmp_path / "w"),
                 "--outfile", str(tmp_path / "d.gguf"), "--json", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr[-2000:]
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "d.gguf").tensors}
    ids = np.array(tensors["d2t"].data, dtype=np.int64)
    chosen = json.loads((tmp_path / "w/train/draft_vocab.json").read_text())["ids"]
    assert ids.tolist() == chosen and len(ids) == 100 and tensors["d2t"].tensor_type.name == "I64"
    assert tuple(tensors["output.weight"].shape) == (64, 100) and tuple(tensors["markov_w2.weight"].shape) == (4, 100)
    report = json.loads((tmp_path / "r.json").read_text())
    # the most frequent outputs cover more than a random 100 of the 256 ids would (this target's outputs are
    # nearly uniform: measured 0.43)
    assert report["data"]["draft_vocab"]["size"] == 100 and report["data"]["draft_vocab"]["train_coverage"] > 100 / 256
    assert report["evaluation"]["token_match"] == 4 and report["evaluation"]["drafted"] > 0
    assert report["evaluation"]["sources"] == ["dspark"]  # the drafter alone, never prompt lookup beside it


def test_a_shared_data_directory_has_one_writer_and_data_limit_stops_generation(tmp_path, spm_target):
    """``--data-dir`` shared by runs of other settings: ``--data-limit`` generates no further than it needs, a run
    that needs shards another run is writing is refused with one line, and one that needs none proceeds."""
    import fcntl

    prompts = write_prompts(tmp_path / "p.jsonl", 8, 4)
    common = ["--target", str(spm_target), "--prompts", str(prompts), "--n-predict", "12", "--block-size", "3",
              "--shard-size", "4", "--parallel", "4", "--n-threads", "2", "--data-dir", str(tmp_path / "data")]
    first = cli("train", *common, "--data-only", "--data-limit", "1", "--work-dir", str(tmp_path / "a"),
                "--outfile", str(tmp_path / "a.gguf"))
    assert first.returncode == 0, first.stderr[-2000:]
    manifest = json.loads((tmp_path / "data/manifest.json").read_text())
    assert list(manifest["shards"]) == ["shard-00000.npz"]
    assert manifest["key"]["n_predict"] == 12  # the data settings travel with the shards
    with open(tmp_path / "data" / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another writer
        blocked = cli("train", *common, "--data-only", "--work-dir", str(tmp_path / "b"),
                      "--outfile", str(tmp_path / "b.gguf"))
        assert blocked.returncode == 1 and "is being written by another run" in blocked.stderr
        reader = cli("train", *common, "--steps", "2", "--anchors", "2", "--data-limit", "1", "--work-dir",
                     str(tmp_path / "c"), "--outfile", str(tmp_path / "c.gguf"))
        assert reader.returncode == 0, reader.stderr[-2000:]


# --- bad input: one line, status 1, nothing at --outfile ------------------------------------------------

@pytest.fixture(scope="module")
def spm_target(model_dir):
    return tiny_model(TinySpec(arch="llama", n_layer=3, vocab="llama-spm"), cache_dir=model_dir)


def bad_input_cases(tmp: Path, target: Path, drafter_like: Path):
    good = write_prompts(tmp / "good.jsonl", 4, 0)
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "broken.jsonl").write_text('{"prompt": "a b c"}\n{"prompt": "unterminated\n')
    (tmp / "wrongkey.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    base = ["--target", str(target), "--prompts", str(good), "--steps", "1", "--n-predict", "16"]
    return [
        ("architecture", ["--target", str(drafter_like), "--prompts", str(good), "--steps", "1"],
         "train captures the target's last layer on every row"),
        ("tap range", base + ["--taps", "0,9"], "outside [0, 1]"),
        ("tap last layer", base + ["--taps", "2"], "last layer (2) cannot be tapped"),
        ("empty prompts", ["--target", str(target), "--prompts", str(tmp / "empty.jsonl"), "--steps", "1"],
         "no prompts"),
        ("malformed line", ["--target", str(target), "--prompts", str(tmp / "broken.jsonl"), "--steps", "1"],
         "broken.jsonl:2: not JSON"),
        ("wrong key", ["--target", str(target), "--prompts", str(tmp / "wrongkey.jsonl"), "--steps", "1"],
         "wrongkey.jsonl:2: expected"),
        ("missing prompts", ["--target", str(target), "--prompts", str(tmp / "nope.jsonl"), "--steps", "1"],
         "no such file"),
        ("missing target", ["--target", str(tmp / "nope.gguf"), "--prompts", str(good), "--steps", "1"],
         "no such file"),
        ("block vs n-predict", base[:-2] + ["--n-predict", "4", "--block-size", "7"], "must exceed --block-size"),
        ("draft vocabulary too small", base + ["--draft-vocab", "1"], "--draft-vocab 1: a draft vocabulary of 1 "
         "tokens cannot hold the"),
        ("draft vocabulary too large", base + ["--draft-vocab", "99999"], "--draft-vocab must be 0"),
        ("negative loss weight", base + ["--kl-weight", "-1"], "loss weights must be >= 0"),
        ("init layer", base + ["--init-layer", "7"], "--init-layer 7 outside"),
    ]


def test_bad_input_gets_one_line_and_status_1(tmp_path, spm_target, model_dir):
    from pyllama_dspark.convert.converter import convert
    from pyllama_dspark.testing import write_tiny_dspark_checkpoint

    spec = TinySpec(arch="llama", n_layer=3, vocab="llama-spm")
    ck = write_tiny_dspark_checkpoint(tmp_path / "ck", target=spec, target_cache_dir=model_dir)
    drafter_like = convert(ck, tmp_path / "dflash.gguf", target_gguf=spm_target).path
    for name, args, message in bad_input_cases(tmp_path, spm_target, drafter_like):
        out = tmp_path / f"{name.replace(' ', '-')}.gguf"
        proc = cli("train", *args, "--outfile", str(out))
        assert proc.returncode == 1, (name, proc.stderr[-2000:])
        errors = [line for line in proc.stderr.splitlines() if line.startswith("pyllama-dspark: error:")]
        assert len(errors) == 1 and message in errors[0], (name, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, name
        assert not out.exists(), name


def test_a_work_directory_of_other_settings_is_refused(tmp_path, spm_target):
    prompts = write_prompts(tmp_path / "p.jsonl", 4, 0)
    common = ["--target", str(spm_target), "--prompts", str(prompts), "--work-dir", str(tmp_path / "w"),
              "--n-predict", "12", "--block-size", "3", "--markov-rank", "4"]
    first = cli("train", *common, "--steps", "1", "--outfile", str(tmp_path / "a.gguf"))
    assert first.returncode == 0, first.stderr[-2000:]
    other = cli("train", *common, "--steps", "2", "--outfile", str(tmp_path / "b.gguf"))
    assert other.returncode == 1 and "was made for another target or other settings" in other.stderr
    assert "steps: 1 there, 2 now" in other.stderr
    assert not (tmp_path / "b.gguf").exists()


def test_missing_torch_names_the_install_command(tmp_path, spm_target):
    prompts = write_prompts(tmp_path / "p.jsonl", 4, 0)
    code = ("import sys; sys.modules['torch'] = None\n"
            "from pyllama_dspark.cli import main\n"
            f"sys.exit(main(['train', '--target', {str(spm_target)!r}, '--prompts', {str(prompts)!r}, "
            f"'--outfile', {str(tmp_path / 'd.gguf')!r}, '--steps', '1']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir())
    assert proc.returncode == 1
    assert "pip install torch==2.13.0" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "d.gguf").exists()


# --- resume: an interrupted run ends with the uninterrupted run's drafter, bit for bit -------------------

def test_interrupted_run_resumes_to_the_same_drafter(tmp_path, spm_target):
    prompts = write_prompts(tmp_path / "p.jsonl", 12, 3)
    common = ["--target", str(spm_target), "--prompts", str(prompts), "--n-predict", "12", "--block-size", "3",
              "--markov-rank", "4", "--steps", "12", "--anchors", "4", "--seqs-per-step", "2", "--shard-size", "4",
              "--parallel", "2", "--checkpoint-steps", "4", "--n-threads", "2", "--outtype", "f32"]

    def train(name, kill=None):
        env = {KILL_ENV: kill} if kill else {KILL_ENV: ""}
        return cli("train", *common, "--work-dir", str(tmp_path / name), "--outfile", str(tmp_path / f"{name}.gguf"),
                   env=env)

    whole = train("whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    cut = train("cut", "data:1")  # killed after its first shard (of three)
    assert cut.returncode == KILLED_STATUS and not (tmp_path / "cut.gguf").exists()
    assert len(json.loads((tmp_path / "cut/data/manifest.json").read_text())["shards"]) == 1
    cut = train("cut", "train:6")  # resumes the data, then killed at step 6: the checkpoint of step 4 survives
    assert cut.returncode == KILLED_STATUS and not (tmp_path / "cut.gguf").exists()
    assert torch.load(tmp_path / "cut/train/checkpoint.pt", weights_only=True)["step"] == 4
    cut = train("cut")
    assert cut.returncode == 0, cut.stderr[-2000:]

    for shard in sorted((tmp_path / "whole/data").glob("shard-*.npz")):
        with np.load(shard) as a, np.load(tmp_path / "cut/data" / shard.name) as b:
            assert all(np.array_equal(a[k], b[k]) for k in a.files), shard.name
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "whole/export" / name).read_bytes() == (tmp_path / "cut/export" / name).read_bytes()
    import gguf

    a, b = gguf.GGUFReader(tmp_path / "whole.gguf"), gguf.GGUFReader(tmp_path / "cut.gguf")
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all(np.array_equal(x.data, y.data) for x, y in zip(a.tensors, b.tensors))


# --- learning: a minute of CPU raises held-out acceptance far above the untrained drafter's -------------

@pytest.mark.slow
def test_training_raises_held_out_acceptance_and_output_stays_exact(tmp_path, model_dir):
    from pyllama_dspark.train.pipeline import TrainOptions, run

    # logit_std 8: peaked next-token distributions like a trained model's (the default 2 is nearly flat)
    spec = TinySpec(arch="llama", n_layer=3, vocab="llama-spm", logit_std=8.0)
    target = tiny_model(spec, cache_dir=model_dir)
    prompts, held_out = write_prompts(tmp_path / "p.jsonl", 512, 5), write_prompts(tmp_path / "e.jsonl", 12, 6)

    def train(name, steps):
        options = TrainOptions(target=target, prompts=prompts, outfile=tmp_path / f"{name}.gguf",
                               eval_prompts=held_out, n_predict=48, steps=steps, block_size=4, markov_rank=32,
                               lr=0.1, anchors=32, n_threads=2, progress=False)
        return run(options)

    untrained, trained = train("untrained", 0), train("trained", 200)
    u, t = untrained.evaluation, trained.evaluation
    # measured on the 2-core VM: untrained accept 0.000-0.001; trained 0.025 (slot 0: 0.09), 200 steps in ~60 s
    assert t["drafted"] > 200 and u["drafted"] > 200
    assert t["accepted"] >= 10 and t["accept"] >= 0.01, t
    assert t["accepted"] >= 5 * max(u["accepted"], 1), (u, t)
    # exactness: the trained drafter's speculative output is the plain greedy output on every held-out prompt
    assert t["token_match"] == t["prompts"] == 12
    assert trained.training["acc0"] > 0.1
    # the data phase used the capture API: f16 taps + last layer, (n_taps + 1) * n_embd * 2 bytes per token, plus
    # the teacher's top 32 (int32 id + f16 probability) per generated token
    assert trained.data["bytes_per_token"] < (3 * 64 * 2 + 32 * 6) * 1.2


def test_without_a_markov_head_the_confidence_head_is_not_exported():
    """The runtime reads a confidence head only as [h_k ; markov_w1[prev]]: ``--markov-rank 0`` trained to its end
    and then failed in the converter; now the GGUF is written without the head."""
    from pyllama_dspark.train.export import checkpoint_config

    base = dict(n_embd=64, n_taps=2, n_layer=1, n_head=4, n_head_kv=2, head_dim=16, n_ff=96, n_vocab=100,
                block_size=4, mask_token=99, eps=1e-6, rope_theta=1e4)
    with_markov = checkpoint_config(DraftConfig(markov_rank=8, **base), (1, 2))
    without = checkpoint_config(DraftConfig(markov_rank=0, **base), (1, 2))
    assert with_markov["enable_confidence_head"] and with_markov["confidence_head_with_markov"]
    assert not without["enable_confidence_head"] and not without["confidence_head_with_markov"]
