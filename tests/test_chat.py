"""Chat templates: the model's Jinja template rendered like transformers renders it (SmolLM2's default system
prompt included), llama.cpp template names through llama.cpp, template errors as ChatTemplateError."""

from __future__ import annotations

import pytest

from pyllama_dspark import Model, bundled
from pyllama_dspark.chat import ChatTemplateError
from pyllama_dspark.testing import TinySpec, tiny_model

# exercises what transformers' renderer sets up: bos_token, loop controls, trim_blocks/lstrip_blocks,
# tojson keeping non-ASCII text, raise_exception, add_generation_prompt
TEMPLATE = """{{ bos_token }}{% for m in messages %}
  {% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
  {% if m['role'] == 'system' %}{% continue %}{% endif %}
[{{ m['role'] | upper }}] {{ m['content'] | tojson }}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""


@pytest.fixture(scope="module")
def jinja_model(model_dir):
    return tiny_model(TinySpec(arch="llama", vocab="llama-spm", chat_template=TEMPLATE), cache_dir=model_dir)


def test_a_jinja_template_renders_like_transformers(jinja_model):
    messages = [{"role": "system", "content": "skipped"}, {"role": "user", "content": "héllo \"you\""},
                {"role": "assistant", "content": "hi"}]
    with Model(jinja_model) as model:
        text = model.apply_chat_template(messages)
        # the leading "<s>" is left to the tokenizer, which adds BOS itself: exactly one BOS
        assert text == '[USER] "héllo \\"you\\""\n[ASSISTANT] "hi"\n[ASSISTANT]'
        ids = model.tokenize(text, parse_special=True).tolist()
        assert ids.count(model.special_tokens["bos"]) == 1 and ids[0] == model.special_tokens["bos"]
        assert model.apply_chat_template(messages[:2], add_assistant=False) == '[USER] "héllo \\"you\\""\n'
        with pytest.raises(ChatTemplateError, match="chat template: no tools here"):
            model.apply_chat_template([{"role": "tool", "content": "x"}])
        with pytest.raises(ChatTemplateError, match="TemplateSyntaxError"):
            model.apply_chat_template(messages, template="{% for m in messages %}")
        # a llama.cpp template name still goes through llama.cpp's formatter
        assert model.apply_chat_template([{"role": "user", "content": "Hi"}], template="chatml") == \
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert issubclass(ChatTemplateError, ValueError)


@pytest.mark.skipif(not bundled.smollm2_installed(), reason=f"SmolLM2 not installed ({bundled.SMOLLM2_INSTALL})")
def test_smollm2_gets_its_default_system_prompt():
    with Model(bundled.smollm2_path()) as model:
        assert model.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        assert model.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}]) == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
