"""Mutation fuzzing of model files and checkpoints (issue 14): each case mutates one input, a worker process
loads it and generates 4 tokens (or converts it), and the outcome is classified.

Outcomes: ``loaded`` (it worked), ``clean`` (one of our named exceptions, i.e. a class defined in
pyllama_dspark), ``foreign`` (any other exception: a bug, the message says where), ``crash`` (the worker died:
a signal or an abort; the worker is restarted and the next case runs), ``hang`` (no answer in time). One
worker runs many cases, so a case costs milliseconds, not an interpreter start.

Mutations are structure-aware where it pays: a GGUF header is walked to find every numeric slot (counts,
string lengths, value types, scalar values, tensor dims, types and offsets) and one slot gets an interesting
value; besides, random bytes of the header region flip, or the file is cut short. A checkpoint's config.json
gets a value of another type or size, or loses a key; its safetensors header gets a bad dtype, shape or data
offsets, a bad length prefix or broken JSON.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

WORKER = textwrap.dedent("""
    import json, sys
    import pyllama_dspark
    from pyllama_dspark import Context, DSparkDrafter, Model, Speculator, generate
    from pyllama_dspark.convert.converter import convert

    def speculate(target, drafter):
        with Model(target) as model:
            ctx = Context(model, n_ctx=64)
            spec = Speculator(ctx, DSparkDrafter(drafter, ctx), n_draft=3)
            spec.generate("Hello", max_tokens=4)

    def run(case):
        if case["kind"] == "target":
            with Model(case["path"]) as model:
                generate(Context(model, n_ctx=64), "Hello", max_tokens=4)
        elif case["kind"] == "drafter":
            speculate(case["target"], case["path"])
        else:
            out = convert(case["path"], case["out"], target_gguf=case["target"])
            speculate(case["target"], out.path)

    for line in sys.stdin:
        case = json.loads(line)
        try:
            run(case)
            result = {"outcome": "loaded"}
        except Exception as exc:
            ours = type(exc).__module__.startswith("pyllama_dspark")
            result = {"outcome": "clean" if ours else "foreign", "error": type(exc).__name__,
                      "message": str(exc).splitlines()[0][:300] if str(exc) else ""}
        print("FUZZ-RESULT " + json.dumps(result), flush=True)
""")
_MARK = "FUZZ-RESULT "

INTERESTING = [0, 1, 2, 3, 7, 8, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
               0x100000000, 0x7FFFFFFFFFFFFFFF, 0x8000000000000000, 0xFFFFFFFFFFFFFFFF]
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class Slot:
    offset: int
    size: int  # bytes: 1, 2, 4 or 8
    what: str  # for the report: "n_kv", "type of general.architecture", "llama.block_count", "dims of ...", ...
    is_float: bool = False


def gguf_slots(data: bytes) -> tuple[list[Slot], int]:
    """Every numeric slot of a well-formed GGUF header, and where the header ends."""
    slots, pos = [], 8

    def take(size: int, what: str, is_float: bool = False) -> int:
        nonlocal pos
        slots.append(Slot(pos, size, what, is_float))
        value = int.from_bytes(data[pos:pos + size], "little")
        pos += size
        return value

    def string(what: str) -> str:
        nonlocal pos
        n = take(8, f"length of {what}")
        text = data[pos:pos + n].decode("utf-8", "replace")
        pos += n
        return text

    n_tensors, n_kv = take(8, "n_tensors"), take(8, "n_kv")
    for _ in range(n_kv):
        key = string("a key")
        vtype = take(4, f"type of {key}")
        if vtype == 8:
            string(key)
        elif vtype == 9:
            etype, count = take(4, f"element type of {key}"), take(8, f"count of {key}")
            for i in range(count):
                if etype == 8:
                    n = int.from_bytes(data[pos:pos + 8], "little")
                    if i < 4:  # a few string lengths of each array are enough
                        take(8, f"length of {key}[{i}]")
                    else:
                        pos += 8
                    pos += n
                else:
                    size = _SCALAR_SIZES[etype]
                    if i < 4:
                        take(size, f"{key}[{i}]", etype in (6, 12))
                    else:
                        pos += size
        else:
            take(_SCALAR_SIZES[vtype], key, vtype in (6, 12))
    for _ in range(n_tensors):
        name = string("a tensor name")
        n_dims = take(4, f"n_dims of {name}")
        for d in range(n_dims):
            take(8, f"dim {d} of {name}")
        take(4, f"type of {name}")
        take(8, f"offset of {name}")
    return slots, pos


def _interesting(rng: random.Random, old: int, size: int) -> int:
    choices = [v for v in INTERESTING if v < 1 << (8 * size)]
    candidates = choices + [old + 1, old - 1, old * 2, old // 2, rng.randrange(1 << (8 * size))]
    return rng.choice(candidates) % (1 << (8 * size))


def mutate_gguf(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One mutation of a GGUF file's bytes and a description of it."""
    slots, header_end = gguf_slots(data)
    buf = bytearray(data)
    op = rng.choices(["slot", "slot-float", "bytes", "truncate"], weights=[6, 1, 2, 1])[0]
    if op == "slot" or op == "slot-float":
        pool = [s for s in slots if s.is_float] if op == "slot-float" else slots
        slot = rng.choice(pool or slots)
        if slot.is_float:
            fmt = "<f" if slot.size == 4 else "<d"
            value = rng.choice([0.0, -1.0, 1e30, -1e30, float("nan"), float("inf"), 1e-30])
            buf[slot.offset:slot.offset + slot.size] = struct.pack(fmt, value)
            return bytes(buf), f"{slot.what} = {value}"
        old = int.from_bytes(data[slot.offset:slot.offset + slot.size], "little")
        value = _interesting(rng, old, slot.size)
        buf[slot.offset:slot.offset + slot.size] = value.to_bytes(slot.size, "little")
        return bytes(buf), f"{slot.what}: {old} -> {value}"
    if op == "bytes":
        places = sorted(rng.randrange(4, header_end) for _ in range(rng.randint(1, 4)))
        for p in places:
            buf[p] = rng.randrange(256)
        return bytes(buf), f"random bytes at {places}"
    cut = rng.randrange(4, header_end) if rng.random() < 0.7 else rng.randrange(header_end, len(data))
    return bytes(buf[:cut]), f"cut at byte {cut} of {len(data)}"


# --- checkpoints ------------------------------------------------------------------------------------------
_ODD_VALUES = [None, -1, 0, 1, 10**12, 2**63, 1.5, "x", "", [], [1, 2], {}, True, False, float("nan")]
_DTYPES = ["F64", "F32", "F16", "BF16", "I8", "I64", "BOOL", "U8", "F8_E4M3", "bogus", ""]


def _json_paths(obj, prefix=()):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield prefix + (key,)
            yield from _json_paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield prefix + (i,)
            yield from _json_paths(value, prefix + (i,))


def _set_path(obj, path, value, delete: bool = False):
    for key in path[:-1]:
        obj = obj[key]
    if delete and isinstance(obj, dict):
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


def mutate_checkpoint(src: Path, dst: Path, rng: random.Random) -> str:
    """Copy the checkpoint folder src to dst with one mutation; a description of it."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    if rng.random() < 0.5:
        config = json.loads((dst / "config.json").read_text())
        path = rng.choice(list(_json_paths(config)))
        delete = rng.random() < 0.2
        value = rng.choice(_ODD_VALUES)
        _set_path(config, path, value, delete)
        (dst / "config.json").write_text(json.dumps(config))
        return f"config {'.'.join(map(str, path))} " + ("deleted" if delete else f"= {value!r}")
    st = next(dst.glob("*.safetensors"))
    data = st.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    op = rng.choice(["dtype", "shape", "offsets", "length", "json"])
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    if op == "dtype":
        header[name]["dtype"] = rng.choice(_DTYPES)
        what = f"{name} dtype {header[name]['dtype']}"
    elif op == "shape":
        shape = list(header[name]["shape"])
        choice = rng.randrange(4)
        shape = ([] if choice == 0 else shape + [1] if choice == 1 else
                 [rng.choice([0, -1, 10**9, 2**40]) if i == 0 else d for i, d in enumerate(shape)] if choice == 2
                 else shape[::-1])
        header[name]["shape"] = shape
        what = f"{name} shape {shape}"
    elif op == "offsets":
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice([[b, a], [a, b + 2], [a, len(body) + 64], [-4, b], [a, a],
                                                   [0, 2**62], ["x", b]])
        what = f"{name} data_offsets {header[name]['data_offsets']}"
    if op in ("dtype", "shape", "offsets"):
        raw = json.dumps(header).encode()
        st.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
        return f"safetensors {what}"
    if op == "length":
        value = rng.choice([0, 1, n - 1, n + 1, len(data), 2**40, 2**64 - 1])
        st.write_bytes(struct.pack("<Q", value) + data[8:])
        return f"safetensors header length {value}"
    raw = bytearray(data[8:8 + n])
    for p in rng.sample(range(len(raw)), 3):
        raw[p] = rng.choice(b'{}[]",:0x\x00\xff')
    st.write_bytes(data[:8] + bytes(raw) + body)
    return "safetensors header bytes"


# --- running ------------------------------------------------------------------------------------------------
@dataclass
class FuzzReport:
    counts: collections.Counter = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)  # "crash ..." / "foreign ..." lines, with the mutation
    errors: collections.Counter = field(default_factory=collections.Counter)  # clean error types

    def line(self, label: str) -> str:
        c = self.counts
        return (f"{label}: cases={sum(c.values())} clean_errors={c['clean']} loaded={c['loaded']} "
                f"foreign={c['foreign']} crashes={c['crash']} hangs={c['hang']}")


class Worker:
    """A worker process that runs cases one after another; restarted after a crash or a hang. Its address space
    is capped, so a mutated size that asks for terabytes fails to allocate instead of swapping the machine."""

    def __init__(self, memory_limit: int = 8 << 30):
        self.proc = None
        self.memory_limit = memory_limit

    def _limit(self) -> None:
        import resource

        if "libasan" in os.environ.get("LD_PRELOAD", ""):  # AddressSanitizer maps terabytes of shadow memory
            return
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_limit, self.memory_limit))

    def run(self, case: dict, timeout: float = 120.0) -> dict:
        import select

        if self.proc is None or self.proc.poll() is not None:
            # no gdb backtrace on an abort (ggml would attach gdb, slowly, and print to stdout)
            env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
            self.proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                         preexec_fn=self._limit, env=env, cwd=tempfile.gettempdir())
        try:
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()
            line = ""
            while not line.startswith(_MARK):  # skip anything else native code printed to stdout
                ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
                line = self.proc.stdout.readline() if ready else None
                if not line:
                    break
        except BrokenPipeError:
            line = ""
        if line:
            return json.loads(line[len(_MARK):])
        if line is None:  # no answer in time
            self.proc.kill()
        rc = self.proc.wait(timeout=60)
        tail = self.proc.stderr.read()[-600:].strip().splitlines()
        self.proc = None
        return {"outcome": "crash" if line is not None else "hang", "error": f"exit status {rc}",
                "message": tail[-1] if tail else ""}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.proc = None


def fuzz(cases, worker: Worker, report: FuzzReport) -> FuzzReport:
    """Run (case, mutation description) pairs (any iterable: cases may be made as they are needed) through the
    worker, adding to report."""
    for case, description in cases:
        result = worker.run(case)
        report.counts[result["outcome"]] += 1
        if result["outcome"] == "clean":
            report.errors[result["error"]] += 1
        elif result["outcome"] != "loaded":
            report.problems.append(f"{result['outcome']} [{case['kind']}: {description}] {result.get('error')}: "
                                   f"{result.get('message')}")
    return report
