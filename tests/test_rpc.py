"""A target split across two rpc-server processes (llama.cpp's RPC backend, patches 0020-0021), over loopback.

Needs a build with -DGGML_RPC=ON (CI: the AddressSanitizer job builds it); skipped elsewhere. Servers are
started here on 127.0.0.1 and stopped through their process handles. Exactness here means: batched rows equal
single-token rows on the split model, speculative greedy output equals plain greedy output, and captured rows,
logits and rollback equal a local run of the same model (the servers run the same CPU kernels).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import drafters
import token_scan
from conftest import ARCHS
from pyllama_dspark import Batch, Context, Model, RpcError, UnsupportedModeError, generate, rpc
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.testing import TinySpec

REQUIRE_RPC = os.environ.get("PYLLAMA_DSPARK_REQUIRE_RPC") == "1"  # set by scripts/asan_pytest.sh (CI)
pytestmark = [pytest.mark.skipif(not rpc.available() and not REQUIRE_RPC,
                                 reason="no RPC backend in this build (-DGGML_RPC=ON)"),
              pytest.mark.timeout(300)]

TOKENS = (np.arange(40) * 37 % 241 + 5).tolist()
PROMPTS = [[1, 17, 42, 99, 3, 250, 7], (np.arange(20) * 37 % 251 + 1).tolist(), [200, 13, 5]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One rpc-server process on a free loopback port."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        cmd, env = rpc.server_command(port=self.port, n_threads=1)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            self.info = rpc.wait_for_server(self.endpoint, self.proc)
        except RpcError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def servers():
    pair = [Server(), Server()]
    yield [s.endpoint for s in pair]
    for server in pair:
        server.stop()


def context(model, **kwargs):
    return Context(model, n_ctx=256, n_batch=64, n_threads=1, **kwargs)


def single_rows(model, tokens=TOKENS):
    with context(model) as ctx:
        return token_scan.single_rows(ctx, tokens)


def batched_rows(model, width, tokens=TOKENS):
    with context(model) as ctx:
        return token_scan.batched_rows(ctx, tokens, width)


def test_this_build_has_the_rpc_backend():
    """CI's ASan job builds with -DGGML_RPC=ON and sets PYLLAMA_DSPARK_REQUIRE_RPC=1: there, no backend fails."""
    assert rpc.available(), "PYLLAMA_DSPARK_REQUIRE_RPC=1 but this build has no RPC backend"
    assert rpc.server_path().exists()


def test_the_servers_say_they_have_the_mode(servers):
    for endpoint in servers:
        info = rpc.hello(endpoint)
        assert info.consistent_numerics and info.version[0] == 7


@pytest.mark.parametrize("arch", ARCHS)
def test_a_split_target_is_on_both_servers_and_batched_rows_equal_single_tokens(quantized, servers, arch):
    with Model(quantized(arch, "q8_0"), rpc_servers=servers) as model:
        for endpoint in servers:  # a model buffer on each endpoint: the split is real
            assert any(endpoint in name and size > 0 for name, size in model.buffer_sizes.items()), \
                model.buffer_sizes
        single = single_rows(model)
        for width in (2, 3, 5, 8, 16):
            np.testing.assert_array_equal(batched_rows(model, width), single, err_msg=f"{arch} width {width}")
    with Model(quantized(arch, "q8_0")) as local:
        np.testing.assert_array_equal(single_rows(local), single, err_msg=f"{arch}: split vs local")


def test_tensor_split_moves_layers_between_the_servers(make_model, servers):
    path = make_model(arch="llama", n_layer=4)
    sizes = {}
    for split in ([3, 1], [1, 3]):
        with Model(path, rpc_servers=servers, tensor_split=split) as model:
            sizes[tuple(split)] = [sum(v for k, v in model.buffer_sizes.items() if e in k) for e in servers]
    assert sizes[3, 1][0] > sizes[1, 3][0] and sizes[3, 1][1] < sizes[1, 3][1], sizes
    with pytest.raises(ValueError, match="tensor_split needs 2"):
        Model(path, rpc_servers=servers, tensor_split=[1.0])
    with pytest.raises(ValueError, match="needs rpc_servers"):
        Model(path, tensor_split=[1.0])


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_greedy_equals_plain_greedy_on_a_split_target(make_model, servers, arch):
    """Verify batches of every width from 2 to 8 (n_draft 1..7 spread over the prompts)."""
    with Model(make_model(arch=arch, n_layer=3), rpc_servers=servers) as model:
        for i, prompt in enumerate(PROMPTS):
            plain_ctx = context(model)
            expected = generate(plain_ctx, prompt, max_tokens=48, stop_at_eog=False).tokens
            plain_ctx.close()
            for n_draft in range(1 + i, 8, len(PROMPTS)):
                right = (3 * n_draft + i) % (n_draft + 1)
                drafter = drafters.prefix(list(prompt) + list(expected), model.n_vocab, right, block_size=7)
                ctx = context(model, n_rs_seq=Speculator.target_rs_seq(n_draft))
                spec = Speculator(ctx, drafter, n_draft=n_draft)
                steps = list(spec.run(np.asarray(prompt, dtype=np.int32), max_tokens=48, stop_at_eog=False))
                ctx.close()
                assert [t for s in steps for t in s.tokens] == list(expected), f"{arch} n_draft={n_draft}"
                assert any(s.n_draft == n_draft for s in steps), f"no verify of {n_draft + 1} rows"


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_converted_dspark_drafter_borrows_the_remote_head_and_stays_exact(make_pair, servers, arch):
    """A full-vocabulary drafter reads the target's output head, which sits on the second server: the drafter's
    model gets the target's devices, so its context can run that product where the weight lives."""
    from pyllama_dspark.drafter import DSparkDrafter

    pair = make_pair(TinySpec(arch=arch, n_layer=3), block_size=4)
    with Model(pair.target, rpc_servers=servers) as model:
        assert any(servers[-1] in name for name in model.buffer_sizes)
        for prompt in PROMPTS:
            plain_ctx = context(model)
            expected = generate(plain_ctx, prompt, max_tokens=48, stop_at_eog=False).tokens
            plain_ctx.close()
            for n_draft in (1, 2, 3):
                ctx = context(model, n_rs_seq=Speculator.target_rs_seq(n_draft))
                drafter = DSparkDrafter(pair.drafter, ctx, n_threads=1)
                assert drafter.model.rpc_servers == model.rpc_servers
                spec = Speculator(ctx, drafter, n_draft=n_draft)
                tokens = [t for s in spec.run(np.asarray(prompt, dtype=np.int32), max_tokens=48, stop_at_eog=False)
                          for t in s.tokens]
                ctx.close()
                assert tokens == list(expected), f"{arch} n_draft={n_draft} prompt={prompt[:3]}"


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_rows_and_rollback_equal_a_local_run(make_model, servers, arch):
    """Captured layer rows and logits after a seq_rm rollback and a different continuation, split vs local."""
    path = make_model(arch=arch, n_layer=4)

    def run(model):
        ctx = context(model, n_rs_seq=4)
        ctx.set_capture_layers([0, 2], masked=False)
        batch, out = Batch(64), []
        batch.add_tokens(TOKENS[:12], 0, logits="all")
        ctx.decode(batch)
        out += [ctx.capture().copy(), ctx.all_logits().copy()]
        batch.clear()
        batch.add_tokens(TOKENS[12:16], 12, logits="all")
        ctx.decode(batch)
        ctx.seq_rm(0, 13)  # keep one of the four, as a verify that accepted one draft
        batch.clear()
        batch.add_tokens([9, 8, 7], 13, logits="all")
        ctx.decode(batch)
        out += [ctx.capture().copy(), ctx.all_logits().copy(), np.array([ctx.seq_pos_max(0)])]
        ctx.close()
        return out

    with Model(path, rpc_servers=servers) as model:
        remote = run(model)
    with Model(path) as model:
        local = run(model)
    for i, (r, l) in enumerate(zip(remote, local)):
        np.testing.assert_array_equal(r, l, err_msg=f"{arch} output {i}")


def test_other_models_of_the_process_stay_local(make_model, servers):
    path = make_model(arch="llama", n_layer=3)
    with Model(path, rpc_servers=servers) as remote, Model(path) as local:
        assert not any("RPC" in name for name in local.buffer_sizes), local.buffer_sizes
        assert context(local).offloaded is False
        assert context(remote).offloaded is True
        assert rpc.local_gpu_devices() == [] or all("RPC" not in d for d in rpc.local_gpu_devices())


class FeaturelessProxy:
    """A loopback proxy in front of a patched server that clears the HELLO reply's feature bit: to the client,
    exactly an upstream rpc-server (same protocol, no consistent-numerics command)."""

    def __init__(self, target_endpoint: str):
        host, port = rpc.parse_endpoint(target_endpoint)
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    @staticmethod
    def _pump(src, dst, is_reply):
        seen = 0
        try:
            while data := src.recv(65536):
                if is_reply and seen <= 11 < seen + len(data):  # byte 11: the reply's padding (8-byte size first)
                    data = data[:11 - seen] + b"\0" + data[12 - seen:]
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def test_a_server_without_the_mode_is_refused_unless_the_mode_is_off(make_model, servers):
    proxy = FeaturelessProxy(servers[0])
    try:
        assert rpc.hello(proxy.endpoint).consistent_numerics is False
        with Model(make_model(arch="llama", n_layer=3), rpc_servers=[proxy.endpoint]) as model:
            with pytest.raises(UnsupportedModeError, match="RPC server lacks"):
                Context(model, n_ctx=64)
            ctx = Context(model, n_ctx=64, consistent_numerics=False)  # plain decoding still works there
            batch = Batch(8)
            batch.add_tokens([1, 2, 3], 0, logits="last")
            ctx.decode(batch)
            assert np.isfinite(ctx.logits(-1)).all()
            ctx.close()
    finally:
        proxy.close()


def test_bad_endpoints_are_refused_before_native_code(make_model):
    path = make_model(arch="llama", n_layer=3)
    with pytest.raises(ValueError, match="host:port"):
        Model(path, rpc_servers=["localhost"])
    with pytest.raises(TypeError, match="not one string"):
        Model(path, rpc_servers="127.0.0.1:5")
    with pytest.raises(ValueError, match="listed twice"):
        Model(path, rpc_servers=["127.0.0.1:5", "127.0.0.1:5"])


SUBPROCESS = textwrap.dedent("""
    import sys
    from pyllama_dspark import Model, RpcError
    try:
        Model(sys.argv[1], rpc_servers=[sys.argv[2]])
    except RpcError as exc:
        print("RpcError:", str(exc).splitlines()[0])
        sys.exit(0)
    sys.exit(3)
""")


def test_unreachable_and_silent_endpoints_raise_rpc_error_in_a_subprocess(make_model, tmp_path):
    """Run where an abort could only kill a child: a closed port, and a listener that never answers HELLO."""
    path = str(make_model(arch="llama", n_layer=3))
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never replies
    try:
        cases = {f"127.0.0.1:{free_port()}": "cannot connect",
                 f"127.0.0.1:{silent.getsockname()[1]}": "no reply within"}
        for endpoint, message in cases.items():
            out = subprocess.run([sys.executable, "-c", SUBPROCESS, path, endpoint], cwd=tmp_path,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])
            assert message in out.stdout, out.stdout
    finally:
        silent.close()


def test_a_server_killed_mid_generation_gives_rpc_error_and_a_fresh_model_loads(make_model):
    path = make_model(arch="llama", n_layer=3)
    first, second = Server(), Server()
    try:
        model = Model(path, rpc_servers=[first.endpoint, second.endpoint])
        ctx = context(model)
        events = generate(ctx, [1, 2, 3], max_tokens=200, stop_at_eog=False, stream=True)
        received = [next(events) for _ in range(3)]
        second.stop()
        with pytest.raises(RpcError, match="lost the connection"):
            for event in events:
                received.append(event)
        assert len(received) < 200
        model.close()
        assert ctx.closed
        restarted = Server(second.port)  # the same endpoint again
        with Model(path, rpc_servers=[first.endpoint, restarted.endpoint]) as fresh:
            expected = single_rows(fresh, TOKENS[:8])
        with Model(path) as local:
            np.testing.assert_array_equal(single_rows(local, TOKENS[:8]), expected)
        restarted.stop()
    finally:
        first.stop()
        second.stop()


def test_graph_counts_grow_with_decodes(make_model, servers):
    with Model(make_model(arch="llama", n_layer=3), rpc_servers=servers) as model:
        before = sum(rpc.graph_counts())
        single_rows(model, TOKENS[:4])
        assert sum(rpc.graph_counts()) >= before + 4 * len(servers)


def test_the_cli_rpc_server_and_generate_with_rpc_match_a_local_run(make_model, tmp_path):
    """`pyllama-dspark rpc-server` holds the layers of `pyllama-dspark generate --rpc`: the same text as local."""
    cli = str(Path(sys.executable).with_name("pyllama-dspark"))
    path = str(make_model(arch="llama", n_layer=3, vocab="llama-spm"))
    port = free_port()
    server = subprocess.Popen([cli, "rpc-server", "--port", str(port), "--threads", "1"], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert rpc.wait_for_server(f"127.0.0.1:{port}", server).consistent_numerics
        runs = {}
        for name, extra in (("local", []), ("remote", ["--rpc", f"127.0.0.1:{port}"])):
            out = subprocess.run([cli, "generate", "-m", path, "-p", "Once upon a time", "-n", "24", "-t", "1",
                                  *extra], cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr[-2000:]
            runs[name] = out.stdout
        assert runs["remote"] == runs["local"] and runs["local"].strip()
    finally:
        server.kill()
        server.wait(timeout=10)


def test_the_docs_rpc_example_runs_as_written(make_pair, tmp_path):
    """docs/building.md "Past one machine": its Python example, on two servers started here in place of
    50052/50053."""
    import re
    import shutil

    page = (Path(__file__).resolve().parent.parent / "docs" / "building.md").read_text()
    section = page.split("\n## Past one machine (RPC)\n", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S)
    pair = make_pair(TinySpec(arch="llama", n_layer=3, vocab="llama-spm"))
    shutil.copy(pair.target, tmp_path / "target.gguf")
    shutil.copy(pair.drafter, tmp_path / "drafter.gguf")
    first, second = Server(), Server()
    try:
        code = example.replace("127.0.0.1:50052", first.endpoint).replace("127.0.0.1:50053", second.endpoint)
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert first.endpoint in out.stdout and second.endpoint in out.stdout, out.stdout
    finally:
        first.stop()
        second.stop()
