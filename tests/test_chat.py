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


# The renderer itself, on templates written here (what chat templates use of it: tojson's options, the special
# tokens, tools, extra variables): a wrong default or a dropped argument changes the prompt the model sees.

def test_tojson_writes_plain_json_with_the_options_templates_pass():
    from pyllama_dspark.chat import render

    messages = [{"role": "user", "content": "héllo <b>&"}]
    as_json = "{{ messages[0] | tojson }}"
    assert render(as_json, messages, add_generation_prompt=False) == '{"role": "user", "content": "héllo <b>&"}'
    options = {
        "{{ messages[0] | tojson(indent=2) }}": '{\n  "role": "user",\n  "content": "héllo <b>&"\n}',
        "{{ messages[0] | tojson(sort_keys=true) }}": '{"content": "héllo <b>&", "role": "user"}',
        "{{ messages[0] | tojson(separators=(',', ':')) }}": '{"role":"user","content":"héllo <b>&"}',
        "{{ messages[0] | tojson(ensure_ascii=true) }}": '{"role": "user", "content": "h\\u00e9llo <b>&"}',
    }
    for template, expected in options.items():
        assert render(template, messages, add_generation_prompt=False) == expected, template


def test_the_special_tokens_tools_and_extra_variables_reach_the_template():
    from pyllama_dspark.chat import is_jinja, render

    template = "[{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ date_string | default('none') }}]"
    assert render(template, [], add_generation_prompt=False) == "[||True|none]"
    assert render(template, [], add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                  date_string="2 Dec 2026") == "[<s>|</s>|True|2 Dec 2026]"
    assert is_jinja("{{ bos_token }}hi") and is_jinja("{% if x %}{% endif %}") and not is_jinja("chatml")
