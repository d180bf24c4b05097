"""Structured output: a grammar every generated token must meet, in plain and in speculative decoding.

The grammar engine is llguidance (the one vLLM and llama.cpp use): it compiles a JSON schema, a regex or a Lark
grammar against the model's vocabulary and gives, for the text so far, the set of tokens that may come next.

    grammar = Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    llm.generate(prompt, grammar=grammar)            # or response_format={"type": "json_schema", ...}

Speculative decoding keeps the output exactly that of plain constrained decoding (``Speculator``):

- a draft is cut before its first token the grammar refuses (``SpecStats.n_draft_invalid`` counts them);
- verify row i is masked with the grammar's state after the anchor and the drafts before it (all rows' masks in one
  llguidance call, ``GrammarState.row_bitmasks``); at temperature 0 a row's token is its raw argmax wherever the
  grammar allows it, and only the other rows are masked whole (``greedy_rows``: the same token, since the argmax is
  the first index of the maximum);
- the grammar advances only by committed tokens (drafts are consumed to compute the rows' masks, then rolled back).

End of generation (the model's end-of-generation tokens) is allowed exactly where the grammar accepts; once the
grammar is complete, only end of generation is.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .errors import GrammarError

# JSON is generated compactly (no whitespace between its tokens, e.g. {"a":1,"b":[2]}): a small model left free to
# emit whitespace can fill max_tokens with newlines inside an object, and the text is then never valid JSON.
JSON_OPTIONS = {"whitespace_flexible": False}

_vocabularies: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_vocabularies_lock = threading.Lock()
_executor_lock = threading.Lock()
_executors: list = []  # [(pid, llguidance's LLExecutor)]: made on first use and shared (its own thread pool)


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ImportError("structured output needs llguidance: pip install llguidance") from exc
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A compiled-on-use grammar: what the output must be.

    Attributes:
        kind: "json_object", "json_schema", "regex" or "lark".
        source: llguidance's grammar text (what ``LLMatcher`` compiles).

    Build one with ``json_object()``, ``json_schema(schema)``, ``regex(pattern)``, ``lark(text)`` or
    ``from_response_format(response_format)``; each checks the grammar and raises ``GrammarError`` (a
    ValueError) naming the problem.

    A Grammar holds no model: it is compiled against a model's vocabulary when a generation given it starts (the
    vocabulary is built once per Model, about 1 s for 50k tokens), which raises ``GrammarError`` for a model
    without a tokenizer. One Grammar may serve any number of generations and models.

    Example:
        ```python
        llm = pyllama_dspark.load("target.gguf", drafter="drafter.gguf")
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        result = llm.generate("A number as JSON: ", grammar=pyllama_dspark.Grammar.json_schema(schema), max_tokens=32)
        print(result.text)  # e.g. {"n":42}
        ```
    """

    kind: str
    source: str

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's JSON mode).

        Returns:
            A grammar of kind "json_object", written compactly (no whitespace between tokens).

        Raises:
            ImportError: llguidance is not installed.
        """
        return cls._checked("json_object", _llguidance().LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=JSON_OPTIONS))

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """JSON valid under ``schema`` (a dict or its JSON text). Keywords llguidance does not implement are
        refused, never ignored: the output always validates.

        Args:
            schema: a JSON schema, as a dict (or ``True``/``False``) or as its JSON text.

        Returns:
            A grammar of kind "json_schema", written compactly (no whitespace between tokens).

        Raises:
            GrammarError: text that is not JSON, a schema that is not an object, an invalid schema, or one with a
                keyword or format llguidance does not implement.

        Example:
            ```python
            Grammar.json_schema({"type": "array", "items": {"type": "string"}, "maxItems": 3})
            ```
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, Mapping) and not isinstance(schema, bool):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            source = _llguidance().LLMatcher.grammar_from_json_schema(dict(schema) if isinstance(schema, Mapping)
                                                                      else schema, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
        return cls._checked("json_schema", source)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching the regular expression (Rust ``regex`` syntax, matched whole).

        Args:
            pattern: the regular expression; the whole output must match it.

        Returns:
            A grammar of kind "regex".

        Raises:
            GrammarError: a pattern that is not a string or not a valid regex.

        Example:
            ```python
            Grammar.regex(r"(yes|no)")
            ```
        """
        if not isinstance(pattern, str):
            raise GrammarError(f"a regex must be a string, got {type(pattern).__name__}")
        return cls._checked("regex", _llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """Text of a Lark grammar (llguidance's dialect; ``start`` is the top rule). llama.cpp's GBNF is accepted
        too and converted.

        Args:
            text: the grammar: Lark, or GBNF (recognised by its ``::=``).

        Returns:
            A grammar of kind "lark".

        Raises:
            GrammarError: a grammar that is not a string, GBNF that cannot be converted, or an invalid grammar
                (an undefined rule, a syntax error...).

        Example:
            ```python
            Grammar.lark('start: "(" /[0-9]+/ ("," /[0-9]+/)* ")"')  # a tuple of numbers, e.g. (1,22,3)
            ```
        """
        if not isinstance(text, str):
            raise GrammarError(f"a grammar must be a string, got {type(text).__name__}")
        llg = _llguidance()
        if "::=" in text:  # GBNF (llama-server's grammar field)
            try:
                text = llg.gbnf_to_lark.any_to_lark(text)
            except Exception as exc:  # noqa: BLE001 - the converter raises plain Exceptions for bad input
                raise GrammarError(f"invalid GBNF grammar: {exc}") from None
        return cls._checked("lark", llg.LLMatcher.grammar_from_lark(text))

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any]) -> Grammar | None:
        """OpenAI's ``response_format``: ``{"type": "text"}`` (None: no grammar), ``{"type": "json_object"}``,
        or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. The schema
        is always enforced (``strict`` is accepted and changes nothing).

        Args:
            response_format: the ``response_format`` mapping of an OpenAI request.

        Returns:
            The grammar, or None for ``{"type": "text"}``.

        Raises:
            GrammarError: not a mapping, an unknown ``type``, a ``json_schema`` without ``schema``, a non-boolean
                ``strict``, or a schema that ``json_schema`` refuses.
        """
        if not isinstance(response_format, Mapping):
            raise GrammarError(f"response_format must be an object, got {type(response_format).__name__}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping) or "schema" not in spec:
                raise GrammarError("response_format json_schema needs {\"json_schema\": {\"schema\": {...}}}")
            if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
                raise GrammarError("response_format json_schema.strict must be a boolean")
            return cls.json_schema(spec["schema"])
        raise GrammarError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")

    @classmethod
    def _checked(cls, kind: str, source: str) -> Grammar:
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(source)
        if is_error:
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {messages[0].strip()}")
        return cls(kind, source)


def vocabulary(model):
    """llguidance's view of the model's vocabulary (every token's bytes, control tokens marked, the
    end-of-generation tokens as its EOS), built once per Model (about 1 s for 50k tokens) and cached."""
    with _vocabularies_lock:
        cached = _vocabularies.get(model)
        if cached is None:
            cached = _vocabularies[model] = _build_vocabulary(model)
        return cached


class _Tokenizer:
    """What llguidance's TokenizerWrapper reads: token bytes, special ids, and a text -> ids function (used for
    text the grammar forces)."""

    def __init__(self, model):
        self._model = model
        self.tokens, self.special_token_ids, eog = [], [], []
        for token in range(model.n_vocab):
            if model.is_control(token):
                # llguidance's convention: a control token's bytes begin with 0xff, so no text can spell it
                self.tokens.append(b"\xff" + model.token_to_piece(token, special=True))
                self.special_token_ids.append(token)
            else:
                self.tokens.append(model.token_to_piece(token))
            if model.is_eog(token):
                eog.append(token)
        special = model.special_tokens
        self.eog = eog or [special["eos"]]
        self.eos_token_id = self.eog[0]
        self.bos_token_id = special["bos"] if special["bos"] >= 0 else None

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = [int(t) for t in self._model.tokenize(data.decode("utf-8", "replace"), add_special=False)]
        if b"".join(self.tokens[t] for t in ids) == data:
            return ids
        # the tokenizer changed the text (SentencePiece vocabularies prefix a space): spell it by longest match
        return self._spelled(data)

    def _spelled(self, data: bytes) -> list[int]:
        if not hasattr(self, "_by_bytes"):
            self._by_bytes = {}
            for token, piece in enumerate(self.tokens):
                if piece and token not in self.special_token_ids:
                    self._by_bytes.setdefault(piece, token)
            self._longest = max(map(len, self._by_bytes))
        ids, at = [], 0
        while at < len(data):
            for size in range(min(self._longest, len(data) - at), 0, -1):
                token = self._by_bytes.get(data[at:at + size])
                if token is not None:
                    ids.append(token)
                    at += size
                    break
            else:
                raise GrammarError(f"the vocabulary cannot spell byte {data[at]:#04x} of {data!r}")
        return ids


def _build_vocabulary(model):
    llg = _llguidance()
    tokenizer = _Tokenizer(model)
    return llg.LLTokenizer(llg.TokenizerWrapper(tokenizer), n_vocab=model.n_vocab, eos_token=tokenizer.eog)


class GrammarState:
    """One generation's position in a grammar: which tokens may come next, advanced by committed tokens.

    Raises:
        GrammarError: the grammar does not compile against this vocabulary.
    """

    def __init__(self, grammar: Grammar, model):
        if not isinstance(grammar, Grammar):
            raise TypeError(f"grammar must be a Grammar (Grammar.json_schema(...), ...), got {type(grammar).__name__}")
        if not model.has_vocab:
            raise GrammarError(f"structured output needs a model with a vocabulary; {model.path.name} has none")
        llg = _llguidance()
        self.grammar, self.n_vocab = grammar, model.n_vocab
        self._is_eog = model.is_eog
        self._matcher = llg.LLMatcher(vocabulary(model), grammar.source, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"invalid {grammar.kind.replace('_', ' ')}: {self._matcher.get_error()}")
        self._n_words = (self.n_vocab + 31) // 32  # a mask: one bit per token, in 32-bit words

    def allowed(self) -> np.ndarray:
        """[n_vocab] bool: the tokens that may come next."""
        return _allowed(self._matcher, self.n_vocab)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` (one row) with the refused tokens at -inf."""
        out = np.array(logits, dtype=np.float32, copy=True)
        out[~self.allowed()] = -np.inf
        return out

    def valid_prefix(self, tokens) -> int:
        """How many of ``tokens`` the grammar accepts in a row from here (nothing is consumed). An end of
        generation where the grammar is complete counts (and nothing after it): llguidance's ``validate_tokens``
        refuses it once the grammar cannot grow, while its mask there allows it and ``consume_token`` takes it."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return 0
        n = int(self._matcher.validate_tokens(tokens))
        if n < len(tokens) and self._is_eog(tokens[n]):
            ahead = self._matcher.deep_copy()
            if all(ahead.consume_token(t) for t in tokens[:n]) and ahead.is_accepting():
                return n + 1
        return n

    def row_bitmasks(self, drafts) -> np.ndarray:
        """[len(drafts) + 1, words] uint32, one bit per token (token t: bit t % 32 of word t // 32): the tokens
        allowed here and after each of ``drafts`` (all accepted by the grammar), in one llguidance call that
        consumes the drafts on the state and rolls them back. A row never reached (after an end of generation, or
        after a draft token the row before refuses) is all zero; a row llguidance left out after a token its row
        allows is computed on a copy of the state.

        Raises:
            GrammarError: the grammar allows no token here (a matcher in its error state).
        """
        drafts = [int(t) for t in drafts]
        masks = np.zeros((len(drafts) + 1, self._n_words), dtype=np.uint32)
        if drafts:
            _executor().unsafe_compute_mask_ptr_with_draft_token([(self._matcher, 0, drafts)], masks.ctypes.data,
                                                                 self._n_words * 4, len(masks))
        else:  # (llguidance's call wants at least one draft token)
            _write_bitmask(masks, 0, self._matcher)
        if not masks[0].any():
            raise GrammarError(f"the grammar allows no token here: {self._matcher.get_error() or 'no continuation'}")
        for i in range(1, len(masks)):
            token = drafts[i - 1]
            if masks[i].any() or self._is_eog(token) or not (masks[i - 1][token >> 5] >> (token & 31)) & 1:
                continue  # computed, or never reached (after an end of generation or a token its row refuses)
            # llguidance stopped before a draft token its own mask allows: this row the slow way, as the state
            # would be after committing drafts[:i] (an error, as committing them would raise, if it refuses one)
            ahead = self._matcher.deep_copy()
            for earlier in drafts[:i]:
                if not ahead.consume_token(earlier):
                    raise GrammarError(f"draft token {earlier} is not allowed by the grammar: {ahead.get_error()}")
            _write_bitmask(masks, i, ahead)
        return masks

    def _masked_row_count(self, n_rows: int, drafts) -> int:
        """How many of the verify rows of [anchor, drafts] the grammar masks: up to the row after the first end of
        generation among the drafts (the output ends there: the rows after it are never handed out)."""
        end = next((i for i, token in enumerate(drafts) if self._is_eog(int(token))), None)
        return n_rows if end is None else min(n_rows, end + 1)

    def mask_rows(self, rows: np.ndarray, drafts) -> np.ndarray:
        """Verify rows masked for a draft (all of whose tokens the grammar accepts): row i with the state after
        ``drafts[:i]`` (refused tokens at -inf). This state does not move."""
        out = np.array(rows, dtype=np.float32, copy=True)
        n_masked = self._masked_row_count(len(out), drafts)
        masks = self.row_bitmasks(drafts[:n_masked])
        for i in range(n_masked):
            if masks[i].any():
                out[i][~_unpacked(masks[i], self.n_vocab)] = -np.inf
        return out

    def greedy_rows(self, rows: np.ndarray, drafts) -> np.ndarray:
        """Each verify row's greedy token under the grammar (as ``np.argmax(mask_rows(rows, drafts), axis=1)``):
        the row's raw argmax where the grammar allows it, which is most rows, else the argmax of the masked row."""
        choices = np.argmax(rows, axis=1)
        n_masked = self._masked_row_count(len(rows), drafts)
        masks = self.row_bitmasks(drafts[:n_masked])
        picked = choices[:n_masked]
        refused = (masks[np.arange(n_masked), picked >> 5] >> (picked & 31).astype(np.uint32)) & 1 == 0
        for i in np.flatnonzero(refused):
            if masks[i].any():
                choices[i] = int(np.argmax(np.where(_unpacked(masks[i], self.n_vocab), rows[i], -np.inf)))
        return choices

    def greedy(self, row: np.ndarray) -> int:
        """The greedy token of one logits row under the grammar here (as ``np.argmax(mask(row))``), its raw
        argmax when the grammar allows it."""
        token = int(np.argmax(row))
        words = self._matcher.compute_bitmask()
        if (words[token >> 3] >> (token & 7)) & 1:
            return token
        return int(np.argmax(np.where(_allowed(self._matcher, self.n_vocab, words), row, -np.inf)))

    def forced_draft(self, n_max: int, continuation=None, *, max_spans: int = 4) -> tuple[list[int], list[bool]]:
        """A draft that costs no drafter call: the tokens the grammar forces from here (llguidance's fast-forward
        tokens), then, where it is free again, ``continuation(tokens so far)``'s proposal cut before its first
        token the grammar refuses, then what the grammar forces after those, and so on (at most ``max_spans``
        forced spans), up to n_max tokens. Returns (tokens, forced: one flag per token). Empty when the grammar
        forces nothing here. Nothing is consumed: this state does not move.

        The forced tokens are llguidance's spelling of the forced bytes; the target may spell them otherwise
        (``{"`` as one token or two), so they are drafts, verified like any other."""
        if n_max <= 0 or self.finished:
            return [], []
        ahead = self._matcher.deep_copy()
        tokens: list[int] = []
        forced: list[bool] = []
        for _ in range(max_spans):
            span = [int(t) for t in ahead.compute_ff_tokens()][: n_max - len(tokens)]
            if not tokens and not span:
                return [], []  # nothing forced at the anchor: the other sources draft as usual
            span = span[: ahead.try_consume_tokens(span)] if span else span
            tokens += span
            forced += [True] * len(span)
            if len(tokens) >= n_max or continuation is None or ahead.is_stopped():
                break
            more = [int(t) for t in continuation(tokens)][: n_max - len(tokens)]
            more = more[: ahead.try_consume_tokens(more)] if more else more
            if not more:
                break
            tokens += more
            forced += [False] * len(more)
        return tokens, forced

    def advance(self, tokens) -> None:
        """Commit tokens (each allowed where it stands)."""
        for token in tokens:
            self._consume(int(token))

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed by the grammar here: {self._matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar (end of generation may come now)."""
        return bool(self._matcher.is_accepting())

    @property
    def finished(self) -> bool:
        """Nothing but end of generation may come (the grammar is complete and cannot grow)."""
        return bool(self._matcher.is_stopped())


def _executor():
    """The LLExecutor shared by every grammar of this process (made on first use, and again in a forked child,
    which has none of its parent's threads)."""
    with _executor_lock:
        if not _executors or _executors[0][0] != os.getpid():
            _executors[:] = [(os.getpid(), _llguidance().LLExecutor())]
        return _executors[0][1]


def _unpacked(words: np.ndarray, n_vocab: int) -> np.ndarray:
    """[n_vocab] bool from a bitmask (one bit per token, little-endian, in bytes or 32-bit words)."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")[:n_vocab].astype(bool)


def _write_bitmask(masks: np.ndarray, row: int, matcher) -> None:
    """The matcher's bitmask for its next token into ``masks[row]`` (32-bit words)."""
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)[: masks.shape[1] * 4]
    masks.view(np.uint8)[row, : len(words)] = words


def _allowed(matcher, n_vocab: int, words: bytes | None = None) -> np.ndarray:
    """[n_vocab] bool from the matcher's bitmask (``words``, when computed already)."""
    words = matcher.compute_bitmask() if words is None else words
    allowed = _unpacked(np.frombuffer(words, dtype=np.uint8), n_vocab)
    if not allowed.any():  # a matcher in its error state allows nothing: never sample from an empty row
        raise GrammarError(f"the grammar allows no token here: {matcher.get_error() or 'no continuation'}")
    return allowed
