"""The project's chat templates: the text each family lays out, the turn read back, the append-only check on
the project's tokenizers, and `miles-lite check-template`."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_lite.cli.main import main
from miles_lite.data.family_tokenizer import load_or_build_family_tokenizer
from miles_lite.formats.chat import FAMILIES, Message, ToolCall, load_chat_template
from miles_lite.formats.chat.check import check_template
from miles_lite.formats.chat.incremental import continuation

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
CALL = ToolCall("lookup", {"key": "kiwi"}, "call_1")
CONVERSATION = [Message("system", "Be brief."), Message("user", "kiwi?"), Message("assistant", "", None, (CALL,)),
                Message("tool", "plum", tool_call_id="call_1"), Message("assistant", "plum")]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    cache = tmp_path_factory.mktemp("tokenizers")
    return {family: load_or_build_family_tokenizer(cache, family) for family in FAMILIES}


def test_qwen25_lays_out_tools_calls_and_results_as_qwen25():
    text = load_chat_template("qwen2.5").render(CONVERSATION, [TOOL])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions")
    schema = '{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}'
    assert f"<tools>\n{schema}\n</tools>" in text
    assert text.endswith('<|im_start|>user\nkiwi?<|im_end|>\n'
                         '<|im_start|>assistant\n<tool_call>\n{"name": "lookup", "arguments": {"key": "kiwi"}}\n'
                         '</tool_call><|im_end|>\n'
                         '<|im_start|>user\n<tool_response>\nplum\n</tool_response><|im_end|>\n'
                         '<|im_start|>assistant\nplum<|im_end|>\n')
    # No system message and no tools: Qwen2.5's default system prompt.
    bare = load_chat_template("qwen2.5").render([Message("user", "hi")], add_generation_prompt=True)
    assert bare == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
                    "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_keeps_every_think_block_and_shapes_the_generation_prompt():
    t = load_chat_template("qwen3")
    history = [Message("user", "q1"), Message("assistant", "a1", "r1"), Message("user", "q2")]
    text = t.render(history, add_generation_prompt=True, options={"enable_thinking": False})
    assert text == ("<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n<think>\nr1\n</think>\n\na1<|im_end|>\n"
                    "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": 1}}\n</tool_call>'
    reply = t.parse(f"<think>\nhmm\n</think>\n\nok\n{call}")
    assert (reply.reasoning, reply.content, reply.tool_calls[0].arguments) == ("hmm", "ok", {"key": 1})


def test_llama3_lays_out_tools_in_the_first_user_message_and_one_json_call():
    t = load_chat_template("llama3")
    text = t.render(CONVERSATION, [TOOL], add_generation_prompt=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
                           "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
                           "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions")
    assert text.endswith('kiwi?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
                         '{"name": "lookup", "parameters": {"key": "kiwi"}}<|eot_id|>'
                         '<|start_header_id|>ipython<|end_header_id|>\n\n"plum"<|eot_id|>'
                         '<|start_header_id|>assistant<|end_header_id|>\n\nplum<|eot_id|>')
    assert t.parse('{"name": "lookup", "parameters": {"key": "kiwi"}}').tool_calls[0].name == "lookup"
    assert t.parse("plain answer").content == "plain answer"


def test_a_turn_that_does_not_have_the_templates_shape_stays_content():
    t = load_chat_template("qwen2.5")
    for text in ['<tool_call>\n{"name": "x"}\n</tool_call>', "<tool_call>\nnot json\n</tool_call>",
                 '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call> and more']:
        reply = t.parse(text)
        assert reply.tool_calls == () and reply.content == text


def test_continuation_appends_only_what_the_request_adds():
    t = load_chat_template("qwen2.5")
    history = CONVERSATION[:3]
    # The model ended its turn with <|im_end|> (closed): the joint is the template's newline after it.
    text = continuation(t, history, CONVERSATION[:4], [TOOL], {}, closed=True)
    assert text == "\n<|im_start|>user\n<tool_response>\nplum\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert continuation(t, history, CONVERSATION[:4], [TOOL], {}, closed=False).startswith("<|im_end|>\n<|im_start|>")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_shipped_family_is_append_only_on_its_project_tokenizer(family: str, tokenizers: dict[str, object]):
    tok = tokenizers[family]
    report = check_template(load_chat_template(family), lambda s: list(tok(s, add_special_tokens=False)["input_ids"]),
                            conversations=120, seed=3)
    assert report.passed, report.failures[:3]
    assert report.model_turns > 200


DROPS_OLD_REASONING = (  # a template in Qwen3's published manner: earlier turns lose their reasoning
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' and loop.last and m.get('reasoning_content') %}"
    "{{ '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_hf_template_is_checked_and_a_template_that_rewrites_history_fails(tokenizers: dict[str, object]):
    tok = tokenizers["qwen3"]
    tok.chat_template = DROPS_OLD_REASONING
    template = load_chat_template("hf", tok)
    assert (template.close, template.after_close, template.reasoning) == ("<|im_end|>", "\n", True)
    report = check_template(template, lambda s: list(tok(s, add_special_tokens=False)["input_ids"]), 40)
    assert not report.passed and "NOT append-only" in report.summary()


def test_unknown_family_is_refused_naming_the_check_command():
    with pytest.raises(ValueError, match="miles-lite check-template"):
        load_chat_template("mistral")
    with pytest.raises(ValueError, match="miles-lite check-template"):
        load_chat_template("auto", arch="gpt2")


def test_check_template_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["check-template", "--template", "llama3", "--conversations", "30",
                 "--cache-dir", str(tmp_path)]) == 0
    assert "llama3: append-only over 30 conversations" in capsys.readouterr().out
    assert main(["check-template", "--template", "mistral"]) == 2
    assert "is not a chat template family" in capsys.readouterr().out
