"""render_chat vs transformers' apply_chat_template on real tokenizers, plus the sandbox limits."""

from __future__ import annotations

import copy
import json

import pytest

from inference.renderer.chat_template import detect_content_format, render_chat, render_template
from inference.renderer.sandbox import printf_specs
from inference.renderer.errors import (
    InvalidMessagesError, InvalidTemplateKwargsError, NoChatTemplateError, RenderError, TemplateLimitError,
    TemplateRenderError, TemplateSecurityError, TemplateSyntaxError,
)
from tests.renderer.tokdirs import hf_tokenizer, tok_dir

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def reference_ids(name: str, messages, **kwargs) -> list[int]:
    """transformers 5.24's apply_chat_template(tokenize=True) input ids."""
    out = hf_tokenizer(name).apply_chat_template(copy.deepcopy(messages), tokenize=True, **kwargs)
    if not isinstance(out, list):
        out = out["input_ids"]
    return list(out)


def reference_text(name: str, messages, **kwargs) -> str:
    return hf_tokenizer(name).apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs)


def assert_same(name: str, messages, hf_messages=None, *, add_generation_prompt=True, **kwargs):
    """render_chat(messages) equals transformers on hf_messages (the vLLM-normalised form)."""
    hf_messages = messages if hf_messages is None else hf_messages
    got = render_chat(tok_dir(name), copy.deepcopy(messages), add_generation_prompt=add_generation_prompt, **kwargs)
    hf_kwargs = {k: v for k, v in kwargs.items() if k != "chat_template_kwargs"}
    hf_kwargs.update(kwargs.get("chat_template_kwargs") or {})
    ref_text = reference_text(name, hf_messages, add_generation_prompt=add_generation_prompt, **hf_kwargs)
    ref_ids = reference_ids(name, hf_messages, add_generation_prompt=add_generation_prompt, **hf_kwargs)
    assert got.prompt_text == ref_text
    assert got.prompt_token_ids == ref_ids
    return got


BASIC = [{"role": "user", "content": "Hello, who are you?"}]
MULTI = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]
UNICODE = [{"role": "user", "content": "Traduis: 你好，世界 🌍🚀 — «ça va?» e\u0301 \t tabs\n\nnew lines"}]
TOOLS_CONV = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


# ---------------------------------------------------------------------------------------------
# Qwen3: at least 8 conversations
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "messages",
    [BASIC, MULTI, UNICODE, [{"role": "user", "content": ""}], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]],
    ids=["basic", "multi_turn", "unicode", "empty_user", "empty_assistant_turn"],
)
def test_qwen3_plain_conversations(messages):
    got = assert_same("qwen3", messages)
    assert got.prompt_text.endswith("<|im_start|>assistant\n")


def test_qwen3_no_generation_prompt():
    assert_same("qwen3", MULTI, add_generation_prompt=False)


def test_qwen3_tools_and_tool_results():
    got = assert_same("qwen3", TOOLS_CONV, tools=[WEATHER_TOOL])
    assert '"get_weather"' in got.prompt_text and "<tool_response>" in got.prompt_text


def test_qwen3_tool_call_arguments_json_string_parsed_like_vllm():
    as_string = copy.deepcopy(TOOLS_CONV)
    as_string[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Paris"})
    as_string[2]["content"] = None  # OpenAI clients send null content with tool_calls
    assert_same("qwen3", as_string, TOOLS_CONV, tools=[WEATHER_TOOL])


@pytest.mark.parametrize("bad", ["null", "[1]", "{not json", '"x"'])
def test_tool_call_arguments_not_a_json_object_string_is_refused_naming_the_field(bad):
    # issue 16: vLLM renders {} here (the model would see a call the client never made); we refuse
    conv = copy.deepcopy(TOOLS_CONV)
    conv[2]["tool_calls"][0]["function"]["arguments"] = bad
    with pytest.raises(InvalidMessagesError) as exc:
        render_chat(tok_dir("qwen3"), conv, tools=[WEATHER_TOOL])
    assert exc.value.param == "messages[2].tool_calls[0].function.arguments"


def test_qwen3_list_content_is_joined_with_newlines():
    one_part = [{"role": "user", "content": [{"type": "text", "text": "Hello, who are you?"}]}]
    assert render_chat(tok_dir("qwen3"), one_part).prompt_token_ids == render_chat(tok_dir("qwen3"), BASIC).prompt_token_ids
    two_parts = [{"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]}]
    assert_same("qwen3", two_parts, [{"role": "user", "content": "line one\nline two"}])


def test_qwen3_continue_final_message():
    msgs = BASIC + [{"role": "assistant", "content": "I am a model that"}]
    got = assert_same("qwen3", msgs, add_generation_prompt=False, continue_final_message=True)
    assert got.prompt_text.endswith("I am a model that")


def test_qwen3_enable_thinking_false_via_kwargs():
    got = assert_same("qwen3", MULTI, chat_template_kwargs={"enable_thinking": False})
    assert got.prompt_text.endswith("<think>\n\n</think>\n\n")
    assert got.prompt_text != render_chat(tok_dir("qwen3"), MULTI).prompt_text


def test_qwen3_reasoning_content_history():
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "thought one"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "thought two"},
    ]
    got = assert_same("qwen3", msgs, add_generation_prompt=False)
    assert "thought two" in got.prompt_text


def test_qwen3_add_special_tokens_flag_is_passed_to_encode():
    # Qwen3 adds no BOS, so the ids are equal either way; llama3_1 shows the difference below.
    a = render_chat(tok_dir("llama3_1"), BASIC)
    b = render_chat(tok_dir("llama3_1"), BASIC, add_special_tokens=True)
    assert a.prompt_token_ids[0] == 128000 and a.prompt_token_ids[1] != 128000  # no double BOS
    assert b.prompt_token_ids[:2] == [128000, 128000]


# ---------------------------------------------------------------------------------------------
# Other families
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama3_1", "gemma3", "deepseek_v3"])
@pytest.mark.parametrize(
    "messages",
    [BASIC, MULTI, UNICODE, [{"role": "user", "content": ""}]],
    ids=["basic", "multi_turn", "unicode", "empty"],
)
def test_other_families_match_transformers(name, messages):
    assert_same(name, messages)


def test_llama3_1_no_generation_prompt_and_list_content():
    assert_same("llama3_1", MULTI, add_generation_prompt=False)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert_same("llama3_1", parts, [{"role": "user", "content": "a\nb"}])


def test_gemma3_openai_content_format():
    tpl = hf_tokenizer("gemma3").chat_template
    assert detect_content_format(tpl) == "openai"
    assert detect_content_format(hf_tokenizer("qwen3").chat_template) == "string"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    # Gemma's template loops over the parts itself: the parts reach it unjoined, like in vLLM.
    assert_same("gemma3", parts)


def test_gemma3_template_raise_exception_message():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateRenderError) as exc:
        render_chat(tok_dir("gemma3"), msgs)
    assert "Conversation roles must alternate" in exc.value.message
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        hf_tokenizer("gemma3").apply_chat_template(msgs, tokenize=False)


def test_deepseek_v3_continue_final_message():
    msgs = BASIC + [{"role": "assistant", "content": "Sure, here"}]
    got = assert_same("deepseek_v3", msgs, add_generation_prompt=False, continue_final_message=True)
    assert got.prompt_text.endswith("Sure, here")


@pytest.mark.parametrize("name", ["gptoss", "llama2"])
def test_no_chat_template(name):
    with pytest.raises(NoChatTemplateError) as exc:
        render_chat(tok_dir(name), BASIC)
    assert "no chat template" in exc.value.message
    assert isinstance(exc.value, ValueError)


def test_explicit_template_for_a_model_without_one():
    got = render_chat(
        tok_dir("llama2"),
        BASIC,
        chat_template="{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}",
    )
    assert got.prompt_text == "<s>[user] Hello, who are you?\n"
    assert got.prompt_token_ids[0] == 1 and got.prompt_token_ids.count(1) == 1


# ---------------------------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------------------------
def test_invalid_arguments():
    d = tok_dir("qwen3")
    with pytest.raises(InvalidMessagesError):
        render_chat(d, [])
    with pytest.raises(InvalidMessagesError):
        render_chat(d, [{"content": "no role"}])
    with pytest.raises(InvalidMessagesError) as exc:
        render_chat(d, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert exc.value.param == "messages"
    with pytest.raises(InvalidTemplateKwargsError) as exc:
        render_chat(d, BASIC, chat_template_kwargs={"messages": []})
    assert exc.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidTemplateKwargsError):
        render_chat(d, BASIC, continue_final_message=True)  # add_generation_prompt defaults to True
    with pytest.raises(TemplateSyntaxError):
        render_chat(d, BASIC, chat_template="{% for %}")


# ---------------------------------------------------------------------------------------------
# Sandbox
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ namespace.__init__.__globals__['os'] }}",
        "{% set ns = namespace(_x=1) %}",
        "{% set _ = messages.append(1) %}{{ messages|length }}",
        "{{ '{0.__class__}'.format(messages) }}",
        # bytes are out of reach: they escaped the size caps, and bytes.count over 2.5 GB held a render worker in C
        # code until its hard time limit (D-296)
        "{{ (0).to_bytes(2500000000, 'big').count((1).to_bytes(11, 'big')) }}",
        "{{ (0).to_bytes(1, 'big').ljust(50000000)|length }}",
        "{{ 'x'.encode()|length }}",
        "{{ messages[0].content.encode('utf-8') }}",
    ],
)
def test_sandbox_escape_is_refused(template):
    with pytest.raises((TemplateSecurityError, TemplateRenderError)) as exc:
        render_chat(tok_dir("qwen3"), BASIC, chat_template=template)
    assert isinstance(exc.value, TemplateSecurityError) or "underscore" in exc.value.message


@pytest.mark.parametrize(
    "template",
    [
        "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
        "{% for a in range(10**9) %}x{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{{ 'x' * 10**9 }}",
        "{{ ['x'] * 10**9 }}",
        "{{ 7 ** (10 ** 9) }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}",
    ],
    ids=["nested_loops", "huge_range", "concat_doubling", "plus_doubling", "str_mul", "list_mul", "pow", "recursion", "join_doubling"],
)
def test_resource_bombs_fail_fast(template):
    # each would run for ever or exhaust memory: a TemplateLimitError (the sandbox's budgets) means it was stopped
    with pytest.raises(TemplateLimitError):
        render_chat(tok_dir("qwen3"), BASIC, chat_template=template)


@pytest.mark.parametrize(
    "template",
    [
        # printf keys with nested parentheses, as Python's % reads them: the width was not seen
        '{{ ("%((x))2000000000s" % {"(x)": "a"}) | length }}',
        '{{ "%((x))100000000s" | format(**{"(x)": "a"}) }}',
        # Markup (|safe, |e) methods and format had none of str's prechecks
        '{{ ("x"|safe).center(1000000000) | length }}',
        '{{ ("x"|e).zfill(1000000000) | length }}',
        '{{ (("a" * 30000)|safe).replace("a", "b" * 30000) | length }}',
        '{{ ("{:>1000000000}"|safe).format("x") | length }}',
        '{{ (""|safe).join(["x" * 1000000] * 1000) | length }}',
        # glibc's strftime width flags
        '{{ strftime_now("x" * 900000 ~ "%200000000Y") | length }}',
        # sum of lists: quadratic copying in one C call
        '{{ ([[0] * 1000000] * 40) | sum(start=[]) | length }}',
        '{{ ([[0]] * 100000) | sum(start=[]) | length }}',
        # backward search and strip sets: len(s) x len(arg) comparisons in one C call
        '{% set s = "a" * 1000000 %}{% set t = "aab" ~ "a" * 10000 %}{{ s.rfind(t) }}',
        '{% set s = "a" * 1000000 %}{% set t = "aab" ~ "a" * 300000 %}{{ s.rsplit(t) | length }}',
        '{{ ("a" * 200000).strip("b" * 1000000 ~ "a") | length }}',
        # an object per character: ~85 MB per call for a 1 MB string outside Latin-1
        '{% set ns = namespace(x=[]) %}{% for i in range(40) %}{% set ns.x = ns.x + [("ā" * 1000000) | list] %}'
        '{% endfor %}{{ ns.x | length }}',
        # comparisons: 1 MB strings equal but for the last character, compared item by item in one C call
        # (DECISIONS D-298: 3.5 to 5.2 s each, past the soft limit, before comparisons were charged)
        '{% set a = "x" * 1000000 %}{% set b = a[:-1] ~ "y" %}{{ b in [a] * 200000 }}',
        '{% set a = "x" * 1000000 %}{% set b = a[:-1] ~ "y" %}{{ b not in [a] * 200000 }}',
        '{% set a = "x" * 1000000 %}{% set b = a[:-1] ~ "y" %}{{ b is in ([a] * 200000) }}',
        '{% set a = "x" * 1000000 %}{% set b = a[:-1] ~ "y" %}{{ [b] * 200000 == [a] * 200000 }}',
        '{% set a = "x" * 1000000 %}{% set b = a[:-1] ~ "y" %}{{ [] < [[b]] * 200000 < [[a]] * 200000 }}',
        '{% set a = "x" * 1000000 %}{% set b = a[:-1] ~ "y" %}{{ ([a] * 200000) | select("equalto", b) | list }}',
        # found by a fresh-eyes review of the comparison guard: list methods, dict views, tuple hashes, namespaces'
        # attributes, loop.changed, a long literal needle, startswith with a tuple (each 1.7 to 15 s in one C call)
        '{% set a = "x" * 1000000 %}{% set b = a[:-1] ~ "y" %}{{ ([a] * 100000).count(b) }}',
        '{% set a = "x" * 1000000 %}{% set b = a[:-1] ~ "y" %}{{ b in dict.fromkeys(range(100000), a).values() }}',
        '{% set t = (((1,) * 1000,) * 1000,) * 1000 %}{{ t in {} }}',
        '{% set t = (((1,) * 1000,) * 1000,) * 1000 %}{{ [t] | unique | list | length }}',
        '{% set a = "x" * 1000000 %}{% set n1 = namespace(k=a) %}{% set n2 = namespace(k=a[:-1] ~ "y") %}'
        '{{ ([n1, n2] * 49500) | sort(attribute="k", case_sensitive=true) | length }}',
        '{% set a = "x" * 1000000 %}{% for s in [a, a[:-1] ~ "x"] %}{{ loop.changed([s] * 100000) }}{% endfor %}',
        '{% set a = "x" * 1000000 %}{{ "' + "x" * 20000 + '" in [a[:19999] ~ "y"] * 1000000 }}',
        '{% set a = "x" * 1000000 %}{% set c = a[:500000] ~ "z" ~ a[500001:] %}{{ a.startswith((c,) * 100000) }}',
        # ordering and hashing filters: the same comparisons (or hashes) of every item, in one C call
        '{% set a = "x" * 1000000 %}{{ ([a] * 40000) | sort | length }}',
        '{% set a = "x" * 1000000 %}{{ ([a] * 1000) | map("lower") | sort | length }}',
        '{% set a = "x" * 1000000 %}{{ ([a] * 40000) | max | length }}',
        '{% set a = "x" * 1000000 %}{{ ([a] * 2000) | unique | list | length }}',
    ],
)
def test_size_and_cost_are_refused_before_the_work(template):
    # found by a sandbox review (DECISIONS D-297): each built gigabytes or held a worker for seconds in one C call;
    # refused from the arguments, never by measuring what was built ("built a value") or running out of memory
    with pytest.raises(TemplateLimitError) as exc:
        render_chat(tok_dir("qwen3"), BASIC, chat_template=template)
    assert "built a value" not in exc.value.message and "out of memory" not in exc.value.message, exc.value.message


def test_the_same_calls_within_bounds_render_as_before():
    t = ('{{ "%(a)s-%(b)05d" % {"a": "x", "(b)": 1, "b": 7} }}|{{ "%((b))d" % {"(b)": 3} }}|'
         '{{ ("<b>"|e) ~ ("{}"|safe).format("<i>") }}|{{ ("x"|safe).center(5) }}|{{ [1, 2.5]|sum }}|'
         '{{ "a</think>b".rsplit("</think>", 1)[-1] }}|{{ "  hi\n".strip() }}|{{ strftime_now("%Y") | length }}')
    assert render_template(t, {}, max_output_chars=1 << 20, max_ops=10_000) == "x-00007|3|&lt;b&gt;&lt;i&gt;|  x  |3.5|b|hi|4"


def test_comparisons_keep_pythons_meaning_and_cheap_ones_spend_nothing():
    t = ('{{ 1 < 2 < 3 }}|{{ 3 > 2 > 5 }}|{{ "a" in "cat" }}|{{ x in y }}|{{ x not in y }}|{{ y == [1, 2] }}|'
         '{{ y == z }}|{{ y != z }}|{{ y < z }}|{{ x < y[1] <= 2 }}|{{ 2 is in y }}|{{ z | select("gt", x) | list }}|'
         '{{ "ab" in w }}|{{ w == "cab" }}|{{ z | sort(reverse=true) }}|{{ ["b", "a", "b"] | unique | list }}|'
         '{{ {"b": 1, "a": 2} | dictsort }}|{{ y | max }}')
    variables = {"x": 1, "y": [1, 2], "z": [1, 3], "w": "cab"}
    assert (render_template(t, variables, max_output_chars=1 << 20, max_ops=100) ==
            "True|False|True|True|False|True|False|True|True|True|True|[3]|True|True|[3, 1]|['b', 'a']|"
            "[('a', 2), ('b', 1)]|2")
    # comparisons of numbers and short strings spend nothing: 100 of each in a loop fit the budget of the bare loop
    # (range's call, 100 iterations, the output); a membership test in a list pays its items walked (2 per test here)
    bare, budget = '{% for i in range(100) %}{% endfor %}ok', 102
    assert render_template(bare, variables, max_output_chars=1 << 20, max_ops=budget) == "ok"
    loop = '{% for i in range(100) %}{% if i > x and w != v and w < "d" %}{% endif %}{% endfor %}ok'
    assert render_template(loop, {**variables, "v": "c"}, max_output_chars=1 << 20, max_ops=budget) == "ok"
    member = '{% for i in range(100) %}{% if i in y %}{% endif %}{% endfor %}ok'
    assert render_template(member, variables, max_output_chars=1 << 20, max_ops=budget + 200) == "ok"
    with pytest.raises(TemplateLimitError):
        render_template(member, variables, max_output_chars=1 << 20, max_ops=budget + 199)


def test_chained_comparisons_stop_at_the_first_false_pair_and_tests_take_keywords():
    # as Python (and Jinja without the guard): the later operands of a chain are evaluated only while pairs hold
    t = ('{% macro bump(ns) %}{% set ns.i = ns.i + 1 %}{{ ns.i }}{% endmacro %}{% set ns = namespace(i=0) %}'
         '{{ y > z > undefined_var.attr }}|{{ y > z > (1 / 0) }}|{{ y > z > bump(ns) | int }}|{{ ns.i }}|'
         '{{ y < z < [2] }}|{{ 2 is in(seq=y) }}')
    assert render_template(t, {"y": [1, 2], "z": [1, 3]}, max_output_chars=1 << 20, max_ops=100) == (
        "False|False|False|0|True|True")


def test_list_of_a_string_pays_per_character():
    assert render_template('{{ "abc" | list | join("-") }}', {}, max_output_chars=1 << 20, max_ops=100) == "a-b-c"
    with pytest.raises(TemplateLimitError):
        render_template('{{ ("x" * 5000) | list | length }}', {}, max_output_chars=1 << 20, max_ops=1000)


def test_printf_specs_read_keys_as_python_does():
    assert list(printf_specs("%((x))9s %-3.2f %% %(a)d")) == [
        ("(x)", "9", None, "s"), (None, "3", "2", "f"), (None, None, None, "%"), ("a", None, None, "d")]
    assert list(printf_specs("%((x)s")) == []  # unclosed key: Python's % raises ValueError
    fmt, args = "%((x))9s|%(a)s", {"(x)": "v", "a": "w"}
    assert len(fmt % args) == 11  # the same reading as Python's


def test_output_size_cap():
    big = "{% for i in range(100000) %}{{ 'abcdefghij' * 3 }}{% endfor %}"
    with pytest.raises(TemplateLimitError) as exc:
        render_chat(tok_dir("qwen3"), BASIC, chat_template=big, max_output_chars=10_000)
    assert "10000" in exc.value.message
    # The default cap (1 MiB + 4x input) also stops it: 3,000,000 characters.
    with pytest.raises(TemplateLimitError) as exc:
        render_chat(tok_dir("qwen3"), BASIC, chat_template=big)
    assert "characters" in exc.value.message
    # Just under an explicit cap passes.
    ok = render_chat(tok_dir("qwen3"), BASIC, chat_template="{{ 'a' * 999 }}", max_output_chars=1000)
    assert len(ok.prompt_text) == 999


def test_raise_exception_carries_template_message():
    with pytest.raises(TemplateRenderError) as exc:
        render_chat(tok_dir("qwen3"), BASIC, chat_template="{{ raise_exception('reasoning_effort must be low') }}")
    assert exc.value.message == "reasoning_effort must be low"
    assert isinstance(exc.value, RenderError)


def test_large_legitimate_conversation_is_within_budget():
    msgs = []
    for i in range(1000):
        msgs.append({"role": "user", "content": f"question {i} " + "x" * 200})
        msgs.append({"role": "assistant", "content": f"answer {i}"})
    msgs.append({"role": "user", "content": "last"})
    got = render_chat(tok_dir("qwen3"), msgs, tools=[WEATHER_TOOL])
    assert got.prompt_text.count("<|im_start|>") == 2003  # system(tools) + 2001 turns + generation prompt
    assert got.prompt_token_ids == reference_ids("qwen3", msgs, tools=[WEATHER_TOOL], add_generation_prompt=True)


def test_strftime_now_and_tojson_match_transformers():
    tpl = "{{ strftime_now('%Y') }}|{{ {'b': 'é<>', 'a': [1, 2]} | tojson }}|{{ {'a': 1} | tojson(indent=2) }}"
    got = render_chat(tok_dir("qwen3"), BASIC, chat_template=tpl)
    ref = hf_tokenizer("qwen3").apply_chat_template(BASIC, chat_template=tpl, tokenize=False)
    assert got.prompt_text == ref
