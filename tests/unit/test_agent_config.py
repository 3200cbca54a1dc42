"""Agent runs' configuration and data: what validation refuses before any work, conversational reference
responses (records) trained on exactly as a session builds its ids, and the experiment as shipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_lite.config import ConfigError, load_config, validate
from miles_lite.data.encoding import PromptEncoder
from miles_lite.data.gsm8k import DatasetError
from miles_lite.data.records import RecordKeys, load_records
from miles_lite.formats.chat import load_chat_template
from miles_lite.formats.chat.incremental import model_text
from miles_lite.formats.chat.messages import normalize_all
from miles_lite.rollout.gateway.session import Session
from miles_lite.types import Generation, SamplingParams
from tests.unit.gateway_harness import tokenizer

ROOT = Path(__file__).resolve().parents[2]
AGENT = "tests.unit.agents_for_tests:tool_agent"


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(load_config(list(overrides)))
    return str(err.value)


def test_validation_refuses_bad_agent_settings_naming_the_field():
    text = _problems(f"rollout.agent={AGENT}", "rollout.environment=calculator", "rollout.chat_template=mistral",
                     "rollout.agent_abort=tests.unit.agents_for_tests:nowhere")
    assert "rollout.agent runs its own turns through the session gateway" in text
    assert "rollout.chat_template='mistral' is not a chat template family" in text
    assert "miles-lite check-template" in text
    assert "rollout.agent_abort='tests.unit.agents_for_tests:nowhere'" in text
    assert "rollout.agent: {" in _problems("rollout.agent=tests.unit.agents_for_tests:TABLE")  # not callable
    assert "rollout.agent_abort=" in _problems("rollout.agent_abort=tests.unit.agents_for_tests:note_abort")


def test_the_shipped_agent_experiment_validates():
    validate(load_config(["experiment=agent_cpu", "rollout.agent=" + AGENT]))


def test_a_reference_trajectory_trains_on_exactly_the_ids_a_session_builds(tmp_path: Path):
    tok = tokenizer(tmp_path)
    template = load_chat_template("qwen2.5")
    records = load_records(ROOT / "examples/agents/lookup/eval.jsonl",
                           RecordKeys(messages_key="messages", metadata_key="metadata", response_key="response"))
    record = records[0]
    batch = PromptEncoder(tok, chat_template=template).sft_batch([record])
    ids, prompt_len, mask = batch.tokens[0], batch.prompt_lengths[0], batch.loss_masks[0]

    # A session fed the same conversation, the engine "sampling" the reference turns' tokens.
    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    session = Session("s", template, encode, SamplingParams())
    prompt, response = normalize_all(list(record.messages)), normalize_all(list(record.response))
    for i, message in enumerate(response):
        if message.role != "assistant":
            continue
        request = [*prompt, *response[:i]]
        plan = session.plan(request, None, {})
        out = encode(model_text(template, request, message, None, None))
        session.commit(plan, Generation(tuple(out), tuple(0.0 for _ in out), "stop", "1"), message)
    assert session.ids == ids and session.prompt_len == prompt_len and session.mask == mask
    assert session.tito_mismatch == 0 and session.turns == 3
    assert sum(mask) < len(mask)  # the tool results are out of the loss


def test_a_conversational_response_must_be_assistant_turns_and_tool_results(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    row = {"messages": [{"role": "user", "content": "q"}], "label": "a",
           "response": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl: line 1: key 'response' \(data.response_key\)"):
        load_records(path, RecordKeys(messages_key="messages", response_key="response"))


def test_a_process_pool_refuses_an_environment_with_per_trajectory_state():
    text = _problems("rollout.plugin_pool=processes", "rollout.environment=tests.unit.agents_for_tests:StatefulTool")
    assert "rollout.plugin_pool=processes" in text and "reset()" in text
    validate(load_config(["rollout.plugin_pool=processes", "rollout.environment=calculator"]))
