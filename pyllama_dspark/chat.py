"""Chat templates: the model's own Jinja template rendered as Hugging Face renders it.

A GGUF stores the Hugging Face tokenizer's ``chat_template`` (``tokenizer.chat_template``).
llama.cpp's ``llama_chat_apply_template`` does not run it: it recognises a few dozen
well-known templates by their text and formats with its own code, which drops what a template
adds beyond the common shape (SmolLM2's default system prompt, for one). Here the template
itself runs in a sandboxed Jinja environment configured like transformers' chat-template
renderer: ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter that keeps non-ASCII text, and the ``raise_exception`` and ``strftime_now`` helpers;
the variables are ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and
``tools`` (None unless given).
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Mapping, Sequence


class ChatTemplateError(ValueError):
    """The template failed to render (its own ``raise_exception``, or a Jinja error)."""


def is_jinja(template: str) -> bool:
    """A Jinja template (as Hugging Face stores them) rather than a llama.cpp template name like "chatml"."""
    return "{%" in template or "{{" in template


def render(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
           bos_token: str = "", eos_token: str = "", **variables: Any) -> str:
    """Render ``template`` for ``messages``.

    Raises:
        ChatTemplateError: the template raised, or is not valid Jinja.
    """
    import jinja2

    try:
        compiled = _compile(template)
        variables.setdefault("tools", None)
        return compiled.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template: {type(exc).__name__}: {exc}") from None


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII text; chat templates expect plain JSON
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template: {message}")
