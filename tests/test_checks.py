"""The public API's argument checks (pyllama_dspark/checks.py): what each returns, and the exact message of each
refusal, since the message is what a user reads (they name the argument, the type and a shortened value)."""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark import checks


def test_show_names_the_type_and_cuts_reprs_longer_than_40_characters():
    assert checks._show(5) == "int 5"
    assert checks._show(None) == "NoneType None"
    fits = "a" * 38  # its repr, quotes included, is 40 characters: shown whole
    assert checks._show(fits) == f"str '{fits}'"
    cut = "b" * 39  # 41: the first 37 characters of the repr, then "..."
    assert checks._show(cut) == "str '" + "b" * 36 + "..."


def test_integer_accepts_ints_and_numpy_integers_and_returns_a_python_int():
    assert checks.integer("n", 3) == 3
    value = checks.integer("n", np.int64(7))
    assert value == 7 and type(value) is int
    assert checks.integer("n", -5) == -5  # no minimum given: any int


@pytest.mark.parametrize("value, shown", [(True, "bool True"), (2.0, "float 2.0"), ("3", "str '3'"),
                                          (None, "NoneType None")])
def test_integer_refuses_other_types_naming_the_argument(value, shown):
    with pytest.raises(TypeError) as err:
        checks.integer("max_tokens", value)
    assert str(err.value) == f"max_tokens must be an int, got {shown}"


def test_integer_minimum_is_inclusive():
    assert checks.integer("n", 0, minimum=0) == 0
    with pytest.raises(ValueError) as err:
        checks.integer("n_draft", -1, minimum=0)
    assert str(err.value) == "n_draft must be >= 0, got -1"


def test_optional_integer_passes_none_and_checks_the_rest():
    assert checks.optional_integer("seed", None) is None
    assert checks.optional_integer("seed", 4, minimum=4) == 4
    with pytest.raises(ValueError) as err:
        checks.optional_integer("seed", 3, minimum=4)
    assert str(err.value) == "seed must be >= 4, got 3"
    with pytest.raises(TypeError) as err:
        checks.optional_integer("seed", 1.5)
    assert str(err.value) == "seed must be an int, got float 1.5"


def test_number_accepts_reals_and_returns_a_float():
    value = checks.number("temperature", 1)
    assert value == 1.0 and type(value) is float
    assert checks.number("temperature", np.float32(0.5)) == 0.5
    for bad, shown in ((True, "bool True"), ("1", "str '1'"), (1j, "complex 1j")):
        with pytest.raises(TypeError) as err:
            checks.number("temperature", bad)
        assert str(err.value) == f"temperature must be a number, got {shown}"


def test_stop_strings_normalise_to_a_list_without_empty_strings():
    assert checks.stop_strings(None) == []
    assert checks.stop_strings(()) == []
    assert checks.stop_strings("") == []
    assert checks.stop_strings("\n\n") == ["\n\n"]
    assert checks.stop_strings(["a", "", "b"]) == ["a", "b"]
    assert checks.stop_strings(("x",)) == ["x"]


@pytest.mark.parametrize("stop, shown", [(b"x", "bytes b'x'"), (bytearray(b"x"), "bytearray bytearray(b'x')"),
                                         (5, "int 5"), (["a", 1], "list ['a', 1]"), ({"a"}, "set {'a'}")])
def test_stop_strings_refuse_what_is_not_text(stop, shown):
    with pytest.raises(TypeError) as err:
        checks.stop_strings(stop)
    assert str(err.value) == f"stop must be a string or a list of strings, got {shown}"


def test_prompt_keeps_text_and_turns_token_ids_into_an_int64_array():
    assert checks.prompt("hi") == "hi"
    for ids in ([1, 2, 3], (1, 2, 3), np.array([1, 2, 3], dtype=np.int32)):
        out = checks.prompt(ids)
        assert out.dtype == np.int64 and out.tolist() == [1, 2, 3]
    for empty in ([], np.array([], dtype=np.float64)):  # an empty array of any dtype is no token ids
        out = checks.prompt(empty)
        assert out.dtype == np.int64 and out.size == 0


@pytest.mark.parametrize("value, message", [
    (b"hi", "prompt must be text (str) or token ids, got bytes: decode it first, e.g. prompt.decode('utf-8')"),
    (bytearray(b"hi"), "prompt must be text (str) or token ids, got bytes: decode it first, "
                       "e.g. prompt.decode('utf-8')"),
    (np.zeros((2, 2), dtype=np.int64), "prompt token ids must be a 1-D integer array, got 2-D int64"),
    (np.array([1.0, 2.0]), "prompt token ids must be a 1-D integer array, got 1-D float64"),
    ([1, True], "prompt token ids must be ints, got bool True"),
    ([1, 2.0, 3.5], "prompt token ids must be ints, got float 2.0"),
    (5, "prompt must be text (str) or a sequence of token ids, got int 5"),
])
def test_prompt_refusals(value, message):
    with pytest.raises(TypeError) as err:
        checks.prompt(value)
    assert str(err.value) == message


def test_messages_keep_role_and_content_only():
    given = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi", "name": "x"}]
    assert checks.messages(given) == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert checks.messages(()) == []


@pytest.mark.parametrize("value, message", [
    ("hi", "messages must be a list of {'role': ..., 'content': ...} dicts, got str 'hi'; "
           "for one user turn: [{'role': 'user', 'content': text}]"),
    (b"hi", "messages must be a list of {'role': ..., 'content': ...} dicts, got bytes b'hi'; "
            "for one user turn: [{'role': 'user', 'content': text}]"),
    (7, "messages must be a list of {'role': ..., 'content': ...} dicts, got int 7; "
        "for one user turn: [{'role': 'user', 'content': text}]"),
    ([{"role": "user", "content": "a"}, "b"], "messages[1] must be a dict with string 'role' and 'content', got str 'b'"),
    ([{"role": 1, "content": "a"}], "messages[0] must be a dict with string 'role' and 'content', "
                                    "got dict {'role': 1, 'content': 'a'}"),
    ([{"role": "user"}], "messages[0] must be a dict with string 'role' and 'content', got dict {'role': 'user'}"),
])
def test_messages_refusals(value, message):
    with pytest.raises(TypeError) as err:
        checks.messages(value)
    assert str(err.value) == message


def test_instance_returns_the_value_or_names_the_expected_class():
    token = object()
    assert checks.instance("token", token, object) is token
    with pytest.raises(TypeError) as err:
        checks.instance("token", 5, str)
    assert str(err.value) == "token must be a str, got int 5"
    with pytest.raises(TypeError) as err:
        checks.instance("token", 5, str, "make one with CancelToken()")
    assert str(err.value) == "token must be a str, got int 5; make one with CancelToken()"
