"""The benchmark scripts run end to end at small sizes (their numbers are not asserted: machines are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_dspark.resources import tool_path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_script(name: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args, "--json", str(out)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_prefill_small(tmp_path):
    result = run_script("bench_prefill.py", "--n-layer", "3", "--n-embd", "64", "--n-prompt", "64",
                        "--repeats", "1", tmp_path=tmp_path)
    for key in ("dense_over_plain", "all_logits_over_dense", "narrowed_over_unnarrowed"):
        assert result[key] > 0


def test_bench_overhead_small(tmp_path):
    if tool_path("llama-simple") is None:
        pytest.skip("llama-simple not built (install with -C cmake.define.PYLLAMA_DSPARK_TOOLS=llama-simple)")
    result = run_script("bench_overhead.py", "--n-predict", "32", "--repeats", "1", tmp_path=tmp_path)
    assert result["cpp_us_per_token"] > 0 and result["ours_us_per_token"] > 0


def test_bench_ceiling_small(tmp_path):
    result = run_script("bench_ceiling.py", "--n-layer", "2", "--n-embd", "64", "--n-predict", "16", "--n-draft", "2",
                        "--repeats", "1", tmp_path=tmp_path)
    assert result["speedup"]["spec_k2"] > 0


def test_bench_verify_cost_small(tmp_path, make_model):
    path = make_model(arch="llama", n_layer=2)
    result = run_script("bench_verify_cost.py", "--model", str(path), "--n", "1", "2", "4", "--repeats", "1",
                        "--ceiling-k", "1", "2", "--ceiling-repeats", "1", "--n-predict", "8", tmp_path=tmp_path)
    for mode in ("consistent", "fast"):
        assert set(result["decode"][mode]["relative"]) == {"1", "2", "4"}
        assert result["decode"][mode]["relative"]["1"] == 1.0
    assert set(result["ceiling"]["speedup"]) == {"k1", "k2"}


def test_bench_mode_cost_small(tmp_path, make_model):
    path = make_model(arch="llama", n_layer=2, n_embd=256, n_ff=512)
    result = run_script("bench_mode_cost.py", "--model", str(path), "--types", "q8_0", "q4_k_m", "--prefill", "16",
                        "70", "--n-cells", "300", "--repeats", "1", "--cache", str(tmp_path / "cache"),
                        tmp_path=tmp_path)
    assert set(result["types"]) == {"q8_0", "q4_k_m"}
    for entry in result["types"].values():
        assert set(entry["on_over_off"]) == {"prefill_16", "prefill_70", "decode_at_300"}
        assert all(ratio > 0 for ratio in entry["on_over_off"].values())
        assert set(entry["on_over_fast"]) == {"prefill_16", "prefill_70"}  # against a context without the mode
        assert entry["n_ubatch"] == {"on_off": 64, "fast": 512}
    assert result["cpu"]["simd"] is not None and "types" in result and result["command"]
    made = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert made == [f"{path.stem}-q4_k_m.gguf", f"{path.stem}-q8_0.gguf"], made


def test_bench_contention_small(tmp_path, make_pair):
    """One and two processes, plain and speculative, two policies, on the tiny pair (a fraction of a second each)."""
    from pyllama_dspark.testing import TinySpec

    target, drafter, _ = make_pair(TinySpec(arch="llama", n_layer=2, vocab="llama-spm", chat_template="chatml"))
    result = run_script("bench_contention.py", "--model", str(target), "--drafter", str(drafter), "--procs", "1,2",
                        "--seconds", "0.5", "--threads", "1", "--policies", "package,pure-spin", tmp_path=tmp_path)
    rows = {(r["mode"], r["policy"]): r for r in result["rows"]}
    assert set(rows) == {(m, p) for m in ("plain", "speculative") for p in ("package", "pure-spin")}
    for row in rows.values():
        assert len(row["procs_1"]["each"]) == 1 and len(row["procs_2"]["each"]) == 2
        assert row["procs_2"]["sum"] > 0 and all(r > 0 for r in row["procs_2"]["each"])
    assert rows["plain", "pure-spin"]["env"] == {"GGML_SPINS_BEFORE_YIELD": "-1"}


def test_make_varied_prompts_small(tmp_path, make_model):
    """The target writes prompts (tiny random model: noise, but the pipeline runs): written questions, two-turn
    chats and templates; the user-style held-out prompts are written beside them and never leak into training."""
    target = make_model(arch="llama", n_layer=2, vocab="llama-spm", chat_template="chatml")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "make_varied_prompts.py"), "--target", str(target),
                           "--out-dir", str(tmp_path / "p"), "--n-written", "24", "--n-multi-turn", "3",
                           "--n-templates", "5", "--parallel", "8"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sys.path.insert(0, str(SCRIPTS))
    try:
        import make_varied_prompts as mvp
    finally:
        sys.path.remove(str(SCRIPTS))
    train = [json.loads(line) for line in (tmp_path / "p" / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "p" / "held_out_user.jsonl").read_text().splitlines()]
    assert len(held) == len(mvp.HELD_OUT_USER) and len(train) >= 5
    assert all(m["role"] in ("user", "assistant") and isinstance(m["content"], str)
               for item in train for m in item["messages"])
    keywords = mvp.held_out_keywords()
    assert not [item for item in train if any(mvp.leaks(m["content"], keywords) for m in item["messages"]
                                               if m["role"] == "user")]
    assert (tmp_path / "p" / "templates" / "held_out.jsonl").is_file()


def test_bench_draft_vocab_small(tmp_path, make_pair):
    pytest.importorskip("torch",
                        reason="train --data-only needs PyTorch: pip install torch==2.13.0 && pip install '.[train]'")
    from pyllama_dspark.testing import TinySpec

    pair = make_pair(TinySpec(arch="llama", n_layer=3, vocab="llama-spm"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"story {i} about a cat"}) + "\n" for i in range(6)))
    data = subprocess.run([sys.executable, "-m", "pyllama_dspark", "train", "--target", str(pair.target), "--prompts",
                           str(prompts), "--n-predict", "12", "--block-size", "3", "--data-only", "--work-dir",
                           str(tmp_path / "w"), "--outfile", str(tmp_path / "x.gguf")], capture_output=True,
                          text=True, cwd=tmp_path, timeout=600)
    assert data.returncode == 0, data.stderr[-3000:]
    result = run_script("bench_draft_vocab.py", "--target", str(pair.target), "--drafter", str(pair.drafter),
                        "--data-dir", str(tmp_path / "w" / "data"), "--eval-prompts", str(prompts), "--sizes", "100",
                        "1000", "--n-predict", "8", "--repeats", "2", "--ks", "1", "2", tmp_path=tmp_path)
    assert set(result["sizes"]) == {"100", "1000"}
    for entry in result["sizes"].values():
        assert 0.0 <= entry["coverage"] <= 1.0 and set(entry["propose_ms"]) == {"1", "2"}
        assert entry["token_match"] == entry["prompts"] == 6
    assert result["sizes"]["1000"]["coverage"] >= result["sizes"]["100"]["coverage"]


def test_per_position_counts_add_prompts_that_never_drafted():
    """A prompt whose every round was a plain step has empty per-position lists (the cost-aware loop on a drafter
    it does not trust); the summary adds the others' counts (it raised a numpy casting error before)."""
    from pyllama_dspark.bench import BenchSummary, PromptResult
    from pyllama_dspark.stats import SpecStats

    drafted = SpecStats()
    drafted.observe_round(2, 1)
    drafted.observe_round(1, 0)
    summary = BenchSummary([PromptResult(0, 3, [1, 2], [1, 2], 0.1, drafted),
                            PromptResult(1, 3, [1, 2], [1, 2], 0.1, SpecStats())])
    accepted, reached = summary.per_position_counts()
    assert accepted.tolist() == [1, 0] and reached.tolist() == [2, 1]


def test_bench_server_small(tmp_path, make_pair):
    pytest.importorskip("uvicorn", reason="the server needs the [server] extra: pip install '.[server]'")
    pytest.importorskip("httpx", reason="bench_server.py needs httpx: pip install '.[test]'")
    from pyllama_dspark.testing import TinySpec

    pair = make_pair(TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"story {i} about a cat"}]})
                               + "\n" for i in range(5)))
    result = run_script("bench_server.py", "--model", str(pair.target), "--drafter", str(pair.drafter), "--prompts",
                        str(prompts), "--clients", "1", "3", "--max-tokens", "8", "-c", "256", tmp_path=tmp_path)
    assert [run["clients"] for run in result["runs"]] == [1, 3] and result["prompts"] == 5
    for run in result["runs"]:
        assert run["identical"] and run["throughput_ratio"] > 0
        for name in ("plain", "dspark"):
            figures = run[name]
            assert figures["requests"] == 5 and 0 < figures["generated_tokens"] <= 40
            assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
            assert figures["latency_p50_s"] <= figures["latency_p99_s"]
        assert run["plain"]["draft_tokens"] == 0


def test_bench_upstream_runs_our_side_small(tmp_path, make_pair):
    """bench_upstream.py's servers, requests and figures with our two configurations only (upstream's build takes
    minutes: it is built when an upstream configuration is asked for). Ours default must equal ours plain."""
    pytest.importorskip("uvicorn", reason="the server needs the [server] extra: pip install '.[server]'")
    pytest.importorskip("httpx", reason="bench_upstream.py needs httpx: pip install '.[test]'")
    from pyllama_dspark.testing import TinySpec

    pair = make_pair(TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"category": category, "id": f"{category}-{i}", "messages": [
        {"role": "user", "content": f"{category} {i}: tell a story about a cat"}]}) + "\n"
        for category in ("chat", "qa") for i in range(2)))
    try:
        import matplotlib  # noqa: F401  (the plot extra)
        plotting = ["--plot", str(tmp_path / "u.png")]
    except ImportError:
        plotting = []
    result = run_script("bench_upstream.py", "--model", str(pair.target), "--drafter", str(pair.drafter), "--tasks",
                        str(tasks), "--configs", "ours plain", "ours default", "--n-predict", "12", "--n-ctx", "512",
                        *plotting, tmp_path=tmp_path)
    assert result["questions"] == 4 and set(result["configs"]) == {"ours plain", "ours default"}
    ours = result["configs"]["ours default"]
    assert ours["replies"] == 4 and ours["equal_to_own_plain"] == 4 and ours["generated"] > 0
    assert ours["decode_tok_s"] > 0 and ours["decode_vs_upstream_plain"] is None  # no upstream plain ran
    assert set(result["categories"]) == {"chat", "qa"}
    assert [r["id"] for r in result["replies"]["ours plain"]] == ["chat-0", "chat-1", "qa-0", "qa-1"]
    if plotting:
        assert (tmp_path / "u.png").stat().st_size > 0


def test_bench_server_multi_turn_small(tmp_path, make_pair):
    pytest.importorskip("uvicorn", reason="the server needs the [server] extra: pip install '.[server]'")
    pytest.importorskip("httpx", reason="bench_server.py needs httpx: pip install '.[test]'")
    from pyllama_dspark.testing import TinySpec

    pair = make_pair(TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"story {i} about a cat"}]})
                               + "\n" for i in range(3)))
    result = run_script("bench_server.py", "--model", str(pair.target), "--drafter", str(pair.drafter), "--prompts",
                        str(prompts), "--clients", "1", "--turns", "3", "--max-tokens", "8", "-c", "512",
                        tmp_path=tmp_path)
    assert result["mode"] == "multi-turn" and result["identical"] and result["conversations"] == 3
    cache, no_cache = result["configs"]["cache"]["per_turn"], result["configs"]["no_cache"]["per_turn"]
    assert [t["turn"] for t in cache] == [1, 2, 3]
    assert [t["prompt_tokens"] for t in cache] == [t["prompt_tokens"] for t in no_cache]
    assert all(t["cached_tokens"] == 0 for t in no_cache)
    # from turn 2 on each conversation finds its previous prompt (at least) in the cache (one client: with
    # --parallel 1 conversations held side by side would share one memory)
    assert all(t["cached_tokens"] >= p["prompt_tokens"] - 3 for t, p in zip(cache[1:], cache))
    assert result["configs"]["cache"]["ttft_last_over_first"] > 0


def test_bench_batching_small(tmp_path, make_pair):
    from pyllama_dspark.testing import TinySpec

    pair = make_pair(TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"story {i} about a cat"}) + "\n" for i in range(5)))
    result = run_script("bench_batching.py", "--model", str(pair.target), "--drafter", str(pair.drafter), "--prompts",
                        str(prompts), "--concurrency", "1", "3", "--max-tokens", "8", "-c", "256", tmp_path=tmp_path)
    assert result["identical"] and set(result["modes"]) == {"plain", "dspark"}
    for entry in result["modes"].values():
        assert entry["one_after_another"]["generated_tokens"] == 40
        for run in entry["batched"].values():
            assert run["identical"] and run["generated_tokens"] == 40 and run["aggregate_tok_s"] > 0
            assert run["latency_p50_s"] <= run["latency_p99_s"] <= run["wall_s"] + 1e-9
    assert set(result["dspark_over_plain"]) == {"1", "3"}


def test_bench_rpc_small(tmp_path, make_pair):
    from pyllama_dspark import rpc
    from pyllama_dspark.testing import TinySpec

    if not rpc.available():
        pytest.skip("no RPC backend in this build (-DGGML_RPC=ON)")
    pair = make_pair(TinySpec(arch="llama", n_layer=4, vocab="llama-spm", chat_template="chatml"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"story {i} about a cat"}) + "\n" for i in range(3)))
    result = run_script("bench_rpc.py", "--model", str(pair.target), "--drafter", str(pair.drafter), "--prompts",
                        str(prompts), "--max-tokens", "8", "-c", "256", "-t", "1", tmp_path=tmp_path)
    assert result["identical"] and list(result["placements"]) == ["local", "one server", "two servers"]
    for placement, entry in result["placements"].items():
        for mode in ("plain", "dspark"):
            figures = entry[mode]
            assert figures["generated_tokens"] == 24 and figures["identical_to_local_plain"]
            remote = [name for name in figures["model_buffers_mib"] if name.startswith("RPC")]
            assert len(remote) == {"local": 0, "one server": 1, "two servers": 2}[placement], figures
            assert (figures["graphs_sent_per_token"] > 0) == (placement != "local")


def test_bench_tasks_small(tmp_path, make_pair):
    """The task-category benchmark on a tiny chat-templated pair and the committed prompt sets (three categories,
    structured extraction under its schemas among them, two prompts each, a few tokens): every configuration's
    output equals plain (constrained) decoding's, one at a time and batched."""
    from pyllama_dspark.testing import TinySpec

    pair = make_pair(TinySpec(arch="llama", n_layer=2, vocab="llama-spm", chat_template="chatml"))
    plot = tmp_path / "tasks.png"
    try:
        import matplotlib  # noqa: F401  (the plot extra)
        plotting = ["--plot", str(plot)]
    except ImportError:
        plotting = []
    result = run_script("bench_tasks.py", "--model", str(pair.target), "--drafter", str(pair.drafter),
                        "--categories", "qa", "code_edit", "structured", "--per-category", "2", "--n-predict", "12",
                        "--n-threads", "2", "--batched", "2", *plotting, tmp_path=tmp_path)
    categories = {"qa", "code_edit", "structured"}
    assert set(result["categories"]) == categories
    for category in result["categories"].values():
        assert set(category) == {"lookup", "history", "grammar", "dspark", "default"}
        assert all(f["token_match"] == f["prompts"] == 2 for f in category.values())
    assert set(result["control"]) == categories | {"all"}  # a second plain context, against the first
    assert all(f["token_match"] == f["prompts"] for f in result["control"].values())
    assert all(len(rows["plain-again"]) == 2 for rows in result["per_prompt"].values())
    # under a schema the grammar drafts its forced tokens (the key after "{" at least)
    assert all(row["forced"] > 0 for row in result["per_prompt"]["structured"]["grammar"])
    assert set(result["batched"]["2"]) == categories
    assert all(f["token_match"] == 2 for f in result["batched"]["2"].values())
    costs = result["proposal_us"]
    assert costs["history"]["store_tokens"] <= costs["history"]["budget"] and costs["history"]["median"] > 0
    assert not plotting or plot.stat().st_size > 0


def test_bench_batch_ceiling_small(tmp_path, make_model):
    path = make_model(arch="llama", n_layer=2)
    result = run_script("bench_batch_ceiling.py", "--model", str(path), "--sequences", "1", "3", "--rows", "2", "3",
                        "--contexts", "5", "40", "--repeats", "1", tmp_path=tmp_path)
    assert set(result["table"]) == {"1x5", "3x5", "1x40", "3x40"}
    for cost in result["table"].values():
        assert set(cost["relative"]) == {"1", "2", "3"} and cost["relative"]["1"] == 1.0
        assert cost["ceiling"]["2"] == pytest.approx(2 / cost["relative"]["2"])
        assert cost["tau_needed"]["3"] == pytest.approx(1.2 * cost["relative"]["3"])
