"""Model: a loaded GGUF (weights + vocabulary + metadata)."""

from __future__ import annotations

import atexit
import functools
import os
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from . import _log, rpc
from . import chat as chat_templates
from ._lib import ffi, lib
from ._owned import Owned
from .errors import InvalidBatchError, LlamaError, ModelLoadError
from .gguf_header import GGUFHeader

_GGUF_MAGIC = b"GGUF"

# Models still open. At interpreter exit they are closed (their contexts first) while every object is still
# alive: left to the final garbage collection, a model could be freed before its contexts, whose native
# destructor then reads the freed model (AddressSanitizer saw exactly that).
_OPEN_MODELS: "weakref.WeakSet[Model]" = weakref.WeakSet()


@atexit.register
def _close_open_models() -> None:
    for model in list(_OPEN_MODELS):
        model.close()


class Model(Owned):
    """A GGUF model loaded by llama.cpp.

    Args:
        path: the .gguf file.
        n_gpu_layers: layers to offload to a GPU backend or the RPC servers (-1 = all). Default: all with
            ``rpc_servers``, else 0. 0 is the CPU alone, also in a GPU build: the model then gets no GPU device,
            so its contexts hold no GPU backend (llama.cpp would otherwise still send large batches' matrix
            products to the GPU and put the CPU's buffers in the GPU's pinned memory), and a context computes
            as in a CPU-only build.
        vocab_only: load only the vocabulary and metadata.
        use_extra_bufts: let llama.cpp repack weights for AMX / interleaved CPU kernels. Off by default:
            the repacked kernels differ between single-token and batched decodes (so speculative
            output could drift from plain greedy), and the AMX path raised SIGILL on our VMs
            (AMX listed by the CPU but not usable) for quantized weights and batches of ~32+ tokens.
            A context with consistent numerics (the default) refuses such a model.
        rpc_servers: ``"host:port"`` endpoints of rpc-servers (``pyllama-dspark rpc-server``; builds with
            ``-DGGML_RPC=ON``) whose devices hold the offloaded layers, as llama.cpp's ``--rpc``. The devices are
            this model's only: other models of the process stay local. Each endpoint first gets a HELLO from
            Python with a time limit, so an unreachable or incompatible server raises RpcError (llama.cpp
            would abort the process).
        tensor_split: the share of the offloaded layers per RPC device, in ``rpc_servers`` order, as llama.cpp's
            ``--tensor-split`` (default: by the devices' free memory).
        header: the file's header as ``read_header(path)`` returned it, when the caller read it already (the
            file is then not opened again in Python).

    Raises:
        FileNotFoundError: the file does not exist.
        ModelLoadError: llama.cpp refused the file (not GGUF, truncated, corrupt,
            unsupported architecture); ``log_tail`` has its reason.
        RpcError: an RPC server cannot be used (see ``rpc_servers``), or this build has no RPC backend.
        ValueError: a malformed endpoint, or a tensor_split whose length is not the number of RPC devices.

    Attributes:
        buffer_sizes: MiB of weights per buffer type as llama.cpp reported them at load (``CPU_Mapped``,
            ``RPC0[host:port]``, a GPU's): where the weights went.
        rpc_info: each RPC server's HELLO reply (``rpc.ServerInfo``), in ``rpc_servers`` order.

    Closing a model closes its contexts first. ``with Model(...) as m:`` works.
    """

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int | None = None, vocab_only: bool = False,
                 use_extra_bufts: bool = False, rpc_servers: Sequence[str] = (),
                 tensor_split: Sequence[float] | None = None, header=None):
        self.path = Path(path)
        self.vocab_only = bool(vocab_only)
        self.use_extra_bufts = bool(use_extra_bufts)
        self.rpc_servers = rpc.check_endpoints(rpc_servers)
        if n_gpu_layers is None:
            n_gpu_layers = -1 if self.rpc_servers else 0
        self.n_gpu_layers = int(n_gpu_layers)
        if tensor_split is not None and not self.rpc_servers:
            raise ValueError("tensor_split needs rpc_servers (it splits the offloaded layers between their devices)")
        if header is None:
            header = _check_gguf_file(self.path)
        elif not isinstance(header, GGUFHeader) or header.path != self.path:
            raise ValueError(f"header must be read_header({str(self.path)!r}), got "
                             f"{getattr(header, 'path', header)!r}'s")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = self.n_gpu_layers
        params.vocab_only = bool(vocab_only)
        params.use_extra_bufts = bool(use_extra_bufts)
        self.rpc_info: list = []
        keep_alive = []
        if self.rpc_servers:
            self.rpc_info, devices = rpc.model_devices(self.rpc_servers)
            keep_alive.append(ffi.new("ggml_backend_dev_t[]", devices + [ffi.NULL]))
            params.devices = keep_alive[-1]
            if tensor_split is not None:
                shares = [float(x) for x in tensor_split]
                if len(shares) != len(devices) or min(shares) < 0 or sum(shares) <= 0:
                    raise ValueError(f"tensor_split needs {len(devices)} non-negative shares (one per RPC device) "
                                     f"with a positive sum, got {list(tensor_split)}")
                keep_alive.append(ffi.new("float[]", shares + [0.0] * max(0, lib.llama_max_devices() - len(shares))))
                params.tensor_split = keep_alive[-1]
        elif self.n_gpu_layers == 0:
            keep_alive.append(ffi.new("ggml_backend_dev_t[]", [ffi.NULL]))  # no devices: the CPU alone
            params.devices = keep_alive[-1]
        _log.clear()
        with _log.collect() as lines:
            ptr = lib.llama_model_load_from_file(os.fsencode(self.path), params)
        if ptr == ffi.NULL:
            raise ModelLoadError(f"could not load model {str(self.path)!r}", op="llama_model_load_from_file",
                                 log_tail=_log.tail())
        self._set_ptr(ptr)
        _OPEN_MODELS.add(self)
        if self.rpc_servers:
            rpc.register_user(self)
        self.buffer_sizes = _model_buffer_sizes(lines)
        self._placement = keep_alive  # llama.cpp keeps the tensor_split pointer of the params it was given
        self._vocab = lib.llama_model_get_vocab(ptr)
        self._gguf_header = header

    def _free(self, ptr) -> None:
        lib.llama_model_free(ptr)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.arch}, {self.n_layer} layers, n_embd {self.n_embd}"
        return f"<Model {self.path.name}: {state}>"

    # --- sizes -------------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        """Number of layers (transformer blocks)."""
        return lib.llama_model_n_layer(self.ptr)

    @property
    def n_embd(self) -> int:
        """Width of the hidden states (embedding size)."""
        return lib.llama_model_n_embd(self.ptr)

    @property
    def n_head(self) -> int:
        """Number of attention heads."""
        return lib.llama_model_n_head(self.ptr)

    @property
    def n_head_kv(self) -> int:
        """Number of key/value heads (fewer than ``n_head`` with grouped-query attention)."""
        return lib.llama_model_n_head_kv(self.ptr)

    @property
    def n_ctx_train(self) -> int:
        """The context length the model was trained with (``Context(n_ctx=0)`` takes it)."""
        return lib.llama_model_n_ctx_train(self.ptr)

    @property
    def n_vocab(self) -> int:
        """Number of tokens in the vocabulary."""
        self.ptr
        return lib.llama_vocab_n_tokens(self._vocab)

    @property
    def n_params(self) -> int:
        """Number of parameters (weights)."""
        return lib.llama_model_n_params(self.ptr)

    @property
    def size(self) -> int:
        """Bytes of weights."""
        return lib.llama_model_size(self.ptr)

    @property
    def is_recurrent(self) -> bool:
        """True for a recurrent model (Mamba, RWKV...): its memory is a state, not a KV cache."""
        return bool(lib.llama_model_is_recurrent(self.ptr))

    @property
    def is_hybrid(self) -> bool:
        """True for a hybrid model (attention and recurrent layers, e.g. Qwen3.5's gated delta net)."""
        return bool(lib.llama_model_is_hybrid(self.ptr))

    @functools.cached_property
    def n_swa(self) -> int:
        """The sliding window of the model's sliding-window attention layers (``<arch>.attention.sliding_window``;
        Gemma 3: 512), 0 for a model without such layers."""
        return int(self.gguf_value(f"{self.arch}.attention.sliding_window", 0) or 0)

    @property
    def description(self) -> str:
        """llama.cpp's one-line description of the model: architecture, size and weight type."""
        buf = ffi.new("char[]", 256)
        lib.llama_model_desc(self.ptr, buf, 256)
        return ffi.string(buf).decode("utf-8", "replace")

    @property
    def target_layers(self) -> list[int]:
        """A draft model's target layer ids as stored in its GGUF (layer *inputs*, HF id + 1); [] otherwise."""
        n = lib.llama_dspark_model_n_target_layers(self.ptr)
        out = ffi.new("int32_t[]", max(n, 1))
        lib.llama_dspark_model_target_layers(self.ptr, out, n)
        return [int(out[i]) for i in range(n)]

    # --- metadata ----------------------------------------------------------------------
    @property
    def arch(self) -> str:
        """The architecture (``general.architecture``: "llama", "qwen3", "dflash"...), "unknown" if absent."""
        return self.meta("general.architecture") or "unknown"

    def meta(self, key: str) -> str | None:
        """A metadata value as llama.cpp renders it (string form), or None when absent.

        Arrays render abbreviated; use ``gguf_value`` for the full typed value.
        """
        return _read_string(lambda buf, n: lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, n))

    def metadata(self) -> dict[str, str]:
        """All metadata keys with their string values."""
        out = {}
        for i in range(lib.llama_model_meta_count(self.ptr)):
            key = _read_string(lambda buf, n: lib.llama_model_meta_key_by_index(self.ptr, i, buf, n))
            out[key] = _read_string(lambda buf, n: lib.llama_model_meta_val_str_by_index(self.ptr, i, buf, n))
        return out

    def gguf_value(self, key: str, default: Any = None) -> Any:
        """A GGUF key's typed value read from the file (ints, floats, strings, lists for arrays)."""
        return self.gguf_header.value(key, default)

    @property
    def gguf_header(self):
        """The file's GGUF header (``gguf_header.GGUFHeader``: metadata, tensor table), read once, before loading."""
        return self._gguf_header

    # --- vocabulary --------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        """Text -> token ids (int32 array). ``add_special`` adds BOS/EOS as the model asks.

        Args:
            text: the text to tokenize.
            add_special: add BOS/EOS as the model's tokenizer asks.
            parse_special: tokenize special-token text (``<|im_start|>``...) as those tokens, not as plain text.

        Returns:
            The token ids, int32.

        Raises:
            ValueError: the model has no tokenizer (vocabulary type none): pass token ids instead.
            ClosedHandleError: the model is closed.
        """
        if not self.has_vocab:  # llama.cpp would abort the process (GGML_ASSERT: tokenizer not initialized)
            raise ValueError(f"{self.path.name} has no tokenizer (its vocabulary type is none): pass token ids, "
                             "not text")
        data = text.encode("utf-8")
        n_max = len(data) + 16
        while True:
            out = ffi.new("llama_token[]", n_max)
            n = lib.llama_tokenize(self._live_vocab(), data, len(data), out, n_max, add_special, parse_special)
            if n >= 0:
                return np.frombuffer(ffi.buffer(out, 4 * n), dtype=np.int32).copy()
            if n == -(2**31):
                raise LlamaError("tokenization overflowed int32", op="llama_tokenize", code=n)
            n_max = -n

    def detokenize(self, tokens: Iterable[int], *, remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        """Token ids -> text (invalid UTF-8 sequences are replaced).

        Args:
            tokens: token ids.
            remove_special: leave out BOS/EOS as the tokenizer adds them.
            unparse_special: write special tokens as their text (else they are left out).

        Returns:
            The text, U+FFFD where the bytes are not valid UTF-8.

        Raises:
            InvalidBatchError: a token id outside the vocabulary.
        """
        ids = self._checked_tokens(tokens)
        arr = ffi.new("llama_token[]", ids.tolist())
        size = max(16, 8 * len(ids))
        while True:
            buf = ffi.new("char[]", size)
            n = lib.llama_detokenize(self._live_vocab(), arr, len(ids), buf, size, remove_special, unparse_special)
            if n >= 0:
                return ffi.buffer(buf, n)[:].decode("utf-8", "replace")
            size = -n

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """One token's bytes (a piece may be part of a UTF-8 sequence).

        Args:
            token: a token id.
            special: write a special (control) token as its text (else its piece is empty).

        Returns:
            The token's bytes.

        Raises:
            InvalidBatchError: a token id outside the vocabulary.
        """
        self._checked_tokens([token])
        size = 32
        while True:
            buf = ffi.new("char[]", size)
            n = lib.llama_token_to_piece(self._live_vocab(), int(token), buf, size, 0, special)
            if n >= 0:
                return ffi.buffer(buf, n)[:]
            size = -n

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest piece of the vocabulary in bytes (special tokens' text included): a text of b bytes takes at
        least b / max_token_bytes tokens."""
        return max(len(self.token_to_piece(t, special=True)) for t in range(self.n_vocab))

    def _special_text(self, kind: str) -> str:
        token = self.special_tokens[kind]
        return "" if token < 0 else self.token_to_piece(token, special=True).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...)."""
        return bool(lib.llama_vocab_is_eog(self._live_vocab(), int(token)))

    def is_control(self, token: int) -> bool:
        """True for control tokens (chat markers, BOS/EOS and other special tokens the tokenizer never writes
        from plain text)."""
        return bool(lib.llama_vocab_is_control(self._live_vocab(), int(token)))

    @property
    def special_tokens(self) -> dict[str, int]:
        """bos, eos, eot, nl, pad, mask ids (-1 where the vocabulary has none)."""
        v = self._live_vocab()
        return {"bos": lib.llama_vocab_bos(v), "eos": lib.llama_vocab_eos(v), "eot": lib.llama_vocab_eot(v),
                "nl": lib.llama_vocab_nl(v), "pad": lib.llama_vocab_pad(v), "mask": lib.llama_vocab_mask(v)}

    @property
    def has_vocab(self) -> bool:
        """Whether the model has a tokenizer (a vocabulary type other than none); without one, give token ids."""
        return lib.llama_vocab_type(self._live_vocab()) != lib.LLAMA_VOCAB_TYPE_NONE

    @property
    def chat_template(self) -> str | None:
        """The chat template stored in the file (``tokenizer.chat_template``), or None."""
        ptr = lib.llama_model_chat_template(self.ptr, ffi.NULL)
        return None if ptr == ffi.NULL else ffi.string(ptr).decode("utf-8", "replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_assistant: bool = True,
                            template: str | None = None, tools: Sequence[Mapping] | None = None) -> str:
        """Format chat messages ({"role", "content"}) with the model's (or the given) template.

        A Jinja template (what Hugging Face models store) is rendered as transformers renders it
        (``pyllama_dspark.chat``): its default system prompt and everything else it writes included.
        A llama.cpp template name ("chatml", "llama3", ...) goes through llama.cpp's formatter. A
        leading BOS the template writes is left out when the tokenizer adds one itself, so the text
        tokenizes (``add_special=True``) to exactly one BOS. ``tools`` (OpenAI's tool objects) go to a Jinja
        template's ``tools`` variable (``renders_tools`` says whether the template uses it).

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts of strings.
            add_assistant: end with the opening of the assistant's turn (the generation prompt).
            template: a Jinja template or a llama.cpp template name, instead of the model's.
            tools: OpenAI's tool objects, for a Jinja template that renders them.

        Returns:
            The formatted prompt, to tokenize with ``add_special=True`` (and ``parse_special=True``).

        Raises:
            ValueError: no template; ChatTemplateError (a ValueError): the template failed to render;
                llama.cpp does not know the template name.
        """
        tmpl = template if template is not None else self.chat_template
        if tmpl is None:
            raise ValueError(f"model {self.path.name} has no chat template; pass template=")
        if chat_templates.is_jinja(tmpl):
            bos, eos = self._special_text("bos"), self._special_text("eos")
            text = chat_templates.render(tmpl, messages, add_generation_prompt=add_assistant, bos_token=bos,
                                         eos_token=eos, tools=list(tools) if tools else None)
            if bos and text.startswith(bos) and lib.llama_vocab_get_add_bos(self._live_vocab()):
                text = text[len(bos):]
            return text
        tmpl_bytes = ffi.new("char[]", tmpl.encode())
        texts = [(m["role"].encode(), m["content"].encode()) for m in messages]
        # The native strings must outlive the call: ``keep`` owns every char[] the messages point into
        # (a pointer into a temporary bytes object would dangle as soon as the temporary is freed).
        keep = [(ffi.new("char[]", role), ffi.new("char[]", content)) for role, content in texts]
        chat = ffi.new("llama_chat_message[]", len(keep))
        for slot, (role, content) in zip(chat, keep):
            slot.role, slot.content = role, content
        size = 2 * sum(len(r) + len(c) for r, c in texts) + 256
        for _ in range(2):
            buf = ffi.new("char[]", size)
            n = lib.llama_chat_apply_template(tmpl_bytes, chat, len(keep), add_assistant, buf, size)
            if n < 0:
                raise ValueError("llama.cpp does not support this chat template")
            if n <= size:
                return ffi.buffer(buf, n)[:].decode("utf-8", "replace")
            size = n
        raise ValueError("chat template output size kept changing")  # pragma: no cover

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template is a Jinja template that reads ``tools``."""
        tmpl = self.chat_template
        return bool(tmpl) and chat_templates.is_jinja(tmpl) and "tools" in tmpl

    # --- helpers -----------------------------------------------------------------------
    def _live_vocab(self):
        self.ptr  # raises once closed: the vocab belongs to the model
        return self._vocab

    def _checked_tokens(self, tokens: Iterable[int]) -> np.ndarray:
        ids = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens, dtype=np.int64)
        n_vocab = self.n_vocab
        bad = ids[(ids < 0) | (ids >= n_vocab)]
        if bad.size:
            raise InvalidBatchError(f"token id {int(bad[0])} out of range [0, {n_vocab})", op="tokens")
        return ids.astype(np.int32)


def _model_buffer_sizes(lines: Sequence[str]) -> dict[str, float]:
    """{buffer type: MiB} from llama.cpp's "load_tensors: <buffer> model buffer size = <x> MiB" lines (e.g.
    ``CPU_Mapped``, ``RPC0[127.0.0.1:50052]``): where the weights went."""
    sizes: dict[str, float] = {}
    for line in lines:
        head, sep, tail = line.partition(" model buffer size = ")
        if sep and tail.endswith("MiB"):
            name = head.split(":", 1)[-1].strip()
            sizes[name] = sizes.get(name, 0.0) + float(tail[:-3])
    return sizes


def read_header(path: str | os.PathLike):
    """A model file's GGUF header, checked as ``Model`` checks it before loading; hand it to ``Model(path,
    header=...)`` (and ``DSparkDrafter``) so the file is opened once (``load`` does).

    Raises:
        FileNotFoundError, ModelLoadError: as ``Model``.
    """
    return _check_gguf_file(Path(path))


def _check_gguf_file(path: Path):
    """The file's parsed header, after the checks llama.cpp would fail an assertion on (and abort) rather than
    return an error: a header our reader cannot walk, and metadata numbers that are NaN or infinite, or a
    negative norm epsilon (GGML_ASSERT(eps >= 0) in the first decode). Raises ModelLoadError."""
    from .gguf_header import GGUFFormatError, GGUFHeader

    if not path.exists():
        raise FileNotFoundError(f"model file not found: {str(path)!r}")
    if not path.is_file():
        raise ModelLoadError(f"not a file: {str(path)!r}", op="open")
    with open(path, "rb") as fh:  # the one open of the file in Python: the header maps this handle
        magic = fh.read(4)
        if magic != _GGUF_MAGIC:
            raise ModelLoadError(f"{str(path)!r} is not a GGUF file (magic {magic!r})", op="open")
        try:
            header = GGUFHeader(path, file=fh)
        except GGUFFormatError as exc:
            raise ModelLoadError(str(exc), op="open") from None
    for key, value in header.fields.items():
        values = value if isinstance(value, np.ndarray) and value.dtype.kind == "f" else [value]
        if any(isinstance(v, (float, np.floating)) and not np.isfinite(v) for v in values):
            raise ModelLoadError(f"{path.name}: metadata {key} is not a finite number", op="open")
        if key.endswith("epsilon") and isinstance(value, (int, float)) and value < 0:
            raise ModelLoadError(f"{path.name}: metadata {key} = {value} must not be negative", op="open")
    _check_layer_and_expert_counts(path, header)
    tokens = header.raw_strings("tokenizer.ggml.tokens")
    duplicates = len(tokens) - len(set(tokens))
    if duplicates:  # llama.cpp's vocabulary asserts that every token text is unique
        raise ModelLoadError(f"{path.name}: tokenizer.ggml.tokens has {duplicates} duplicate token texts", op="open")
    return header


_MAX_LAYERS, _MAX_EXPERTS = 512, 1024  # llama-hparams.h: LLAMA_MAX_LAYERS, LLAMA_MAX_EXPERTS


def _check_layer_and_expert_counts(path: Path, header) -> None:
    """The counts llama.cpp's hyperparameter loading asserts on (llama_model::load_hparams) rather than
    rejecting: found by fuzzing (a block_count of 32767 aborted the process)."""
    arch = header.fields.get("general.architecture")
    if not isinstance(arch, str):
        return  # llama.cpp refuses a file without an architecture cleanly

    def count(name: str, default: int = 0) -> int:
        value = header.fields.get(f"{arch}.{name}", default)
        if isinstance(value, np.ndarray):
            value = int(value.max()) if value.size else 0
        return value if isinstance(value, int) else default

    def refuse(why: str) -> None:
        raise ModelLoadError(f"{path.name}: {why}", op="open")

    n_layer = count("block_count", 1)
    if not 0 < n_layer <= _MAX_LAYERS:
        refuse(f"{arch}.block_count {n_layer} is outside [1, {_MAX_LAYERS}]")
    if count("nextn_predict_layers") > n_layer:
        refuse(f"{arch}.nextn_predict_layers exceeds {arch}.block_count ({n_layer})")
    n_expert, n_used = count("expert_count"), count("expert_used_count")
    groups, groups_used = count("expert_group_count"), count("expert_group_used_count")
    if n_expert > _MAX_EXPERTS or n_used > n_expert:
        refuse(f"{arch}.expert_count {n_expert} / expert_used_count {n_used} out of range (at most {_MAX_EXPERTS}, "
               "used <= count)")
    if n_expert > 0 and (n_used == 0 or groups >= n_expert or (groups and (n_expert % groups or not
                                                                            0 < groups_used < groups))):
        refuse(f"{arch}: expert counts do not fit together (count {n_expert}, used {n_used}, groups {groups}, "
               f"groups used {groups_used})")
    if n_expert == 0 and (n_used or groups):
        refuse(f"{arch}: expert_used_count / expert_group_count set without experts")


def _read_string(call, size: int = 256) -> str | None:
    """Call a llama.cpp 'write into buf, return needed length' function; None if it returns < 0."""
    buf = ffi.new("char[]", size)
    n = call(buf, size)
    if n < 0:
        return None
    if n >= size:
        buf = ffi.new("char[]", n + 1)
        call(buf, n + 1)
    return ffi.string(buf).decode("utf-8", "replace")


QUANT_TYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "f16": "LLAMA_FTYPE_MOSTLY_F16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
               "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
               "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "bf16": "LLAMA_FTYPE_MOSTLY_BF16"}


def quantize(src: str | os.PathLike, dst: str | os.PathLike, qtype: str, *, n_threads: int = 0,
             allow_requantize: bool = False) -> Path:
    """Write a copy of GGUF ``src`` with its weight matrices in ``qtype`` (llama.cpp's llama-quantize).

    Args:
        qtype: one of f32, f16, bf16, q8_0, q5_0, q4_0, q4_1, q4_k_m (norms and other 1-D tensors stay f32; like
            llama-quantize, the 4-bit types keep the output head at q8_0 or a K-quant, and q4_k_m mixes
            q4_K with q6_K for the tensors llama-quantize gives more bits, hence "mostly").
        allow_requantize: accept a src whose weights are already quantized (they are dequantized first, so
            the copy can be no better than src); without it llama.cpp refuses such a src.

    Raises:
        ValueError: unknown qtype; FileNotFoundError / ModelLoadError: bad src;
        LlamaError: llama.cpp failed (``log_tail`` says why); dst is then not left behind.
    """
    if qtype not in QUANT_TYPES:
        raise ValueError(f"qtype must be one of {sorted(QUANT_TYPES)}, got {qtype!r}")
    src, dst = Path(src), Path(dst)
    _check_gguf_file(src)
    params = ffi.new("llama_model_quantize_params *", lib.llama_model_quantize_default_params())
    params.nthread = n_threads
    params.ftype = getattr(lib, QUANT_TYPES[qtype])
    params.allow_requantize = bool(allow_requantize)
    _log.clear()
    if lib.llama_model_quantize(os.fsencode(src), os.fsencode(dst), params) != 0:
        dst.unlink(missing_ok=True)
        raise LlamaError(f"quantizing {src.name} to {qtype} failed", op="llama_model_quantize", log_tail=_log.tail())
    return dst
