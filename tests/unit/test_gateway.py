"""The session gateway through the real `openai` client: a 3-turn tool session whose ids are exactly what the
engine saw and produced, streaming, divergence (refused, or branched), keys, sticky routing and re-routing,
pinned sampling."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.unit.gateway_harness import KEY, TABLE, harness

pytestmark = pytest.mark.timeout(120)
QUESTION = [{"role": "system", "content": "Use lookup."}, {"role": "user", "content": "kiwi?"}]


def _tool_loop(client: openai.OpenAI, stream: bool = False, **kwargs) -> tuple[list[dict], list]:
    """The usual agent loop: call, run each tool call, send the results, until a turn calls no tool."""
    messages = [dict(m) for m in QUESTION]
    answers = []
    for _ in range(5):
        if stream:
            msg, extra = _streamed(client, messages, **kwargs)
        else:
            resp = client.chat.completions.create(model="policy", messages=messages, extra_body={
                "return_token_ids": True}, **kwargs)
            msg, extra = resp.choices[0].message, resp.model_extra | {"token_ids": resp.choices[0].model_extra[
                "token_ids"], "finish": resp.choices[0].finish_reason}
        answers.append(extra)
        messages.append(msg.model_dump(exclude_none=True) if not isinstance(msg, dict) else msg)
        if not messages[-1].get("tool_calls"):
            return messages, answers
        for call in messages[-1]["tool_calls"]:
            key = json.loads(call["function"]["arguments"])["key"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": TABLE[key]})
    raise AssertionError("the agent did not finish")


def _streamed(client: openai.OpenAI, messages: list[dict], **kwargs) -> tuple[dict, dict]:
    content, calls, finish, token_ids = "", {}, None, []
    for chunk in client.chat.completions.create(model="policy", messages=messages, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"return_token_ids": True}, **kwargs):
        if not chunk.choices:
            assert chunk.usage is not None and chunk.usage.completion_tokens == len(token_ids)
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls[call.index] = {"id": call.id, "type": "function",
                                 "function": {"name": call.function.name, "arguments": call.function.arguments}}
        if chunk.choices[0].finish_reason:
            finish, token_ids = chunk.choices[0].finish_reason, chunk.choices[0].model_extra["token_ids"]
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, {"finish": finish, "token_ids": token_ids}


@pytest.mark.parametrize("stream", [False, True])
def test_three_turn_tool_session_holds_exactly_the_engines_ids(tmp_path: Path, stream: bool):
    with harness(tmp_path) as h:
        opened = h.open_session()
        client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
        messages, answers = _tool_loop(client, stream=stream)
        assert [a["finish"] for a in answers] == ["tool_calls", "tool_calls", "stop"]
        assert messages[-1]["content"] == "The answer is 7."
        engine = h.engines[0]
        assert len(engine.requests) == 3
        record = h.record(opened["id"])
        ids = record["prompt_ids"] + record["response_ids"]
        # Turn by turn: each request the engine got is the session's ids so far, each answer is appended as it is.
        position = len(record["prompt_ids"])
        assert engine.requests[0][0] == record["prompt_ids"]
        for (inp, out), answer in zip(engine.requests, answers, strict=True):
            assert ids[:len(inp)] == inp and ids[len(inp):len(inp) + len(out)] == out
            assert answer["token_ids"] == out
            if not stream:
                assert answer["prompt_token_ids"] == inp
            mask = record["loss_mask"][len(inp) - position:len(inp) - position + len(out)]
            assert mask == [1] * len(out)
        assert ids == engine.requests[-1][0] + engine.requests[-1][1]
        # Everything but the model's tokens (the tool results, the turn markers) is out of the loss, log-prob 0.
        assert sum(record["loss_mask"]) == sum(len(o) for _, o in engine.requests)
        assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(record["rollout_logprobs"], record["loss_mask"],
                                                                 strict=True))
        assert record["turns"] == 3 and record["tito_mismatch"] == 0 and record["engine"] == "engine-0"
        # The ids equal the template's rendering of the whole conversation, tokenised afresh.
        from miles_lite.formats.chat import load_chat_template
        from miles_lite.formats.chat.messages import normalize_all

        text = load_chat_template("qwen2.5").render(normalize_all(messages))
        assert h.tokenizer(text, add_special_tokens=False)["input_ids"] == ids + h.tokenizer("\n")["input_ids"]


def test_a_diverging_history_is_refused_naming_the_message_and_counted(tmp_path: Path):
    with harness(tmp_path) as h:
        opened = h.open_session()
        client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
        messages, _ = _tool_loop(client)
        bad = [dict(m) for m in messages[:-1]]
        bad[1] = {"role": "user", "content": "fig?"}
        with pytest.raises(openai.BadRequestError, match=r"messages\[1\] \(user\) differs from the session's history"):
            client.chat.completions.create(model="policy", messages=bad)
        assert h.record(opened["id"])["diverged"] == 1
        # A request that repeats the history still runs.
        client.chat.completions.create(model="policy", messages=messages + [{"role": "user", "content": "fig?"}])


def test_with_branching_a_diverging_request_continues_from_the_shared_prefix(tmp_path: Path):
    with harness(tmp_path, branch=True) as h:
        opened = h.open_session()
        client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
        messages, _ = _tool_loop(client)
        # Rewrite the second tool result: the session keeps turn 1, drops turns 2-3, and continues from there.
        first_two = messages[:3]
        branch = [*first_two, {"role": "tool", "tool_call_id": first_two[2]["tool_calls"][0]["id"], "content": "fig"}]
        resp = client.chat.completions.create(model="policy", messages=branch, extra_body={"return_token_ids": True})
        assert resp.choices[0].message.tool_calls[0].function.arguments == '{"key": "fig"}'
        record = h.record(opened["id"])
        assert record["branches"] == 1 and record["turns"] == 2
        inp, out = h.engines[0].requests[-1]
        assert record["prompt_ids"] + record["response_ids"] == inp + out
        assert inp[:len(h.engines[0].requests[0][0])] == h.engines[0].requests[0][0]


def test_every_session_path_asks_a_key_and_a_sessions_key_opens_only_its_own(tmp_path: Path):
    with harness(tmp_path) as h:
        a, b = h.open_session(), h.open_session()
        for key in ("", "wrong-key-0123456789", b["api_key"]):
            client = openai.OpenAI(base_url=a["base_url"], api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                client.chat.completions.create(model="policy", messages=QUESTION)
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(urllib.request.Request(f"{h.gateway.url}/sessions", data=b"{}", method="POST"))
        with pytest.raises(urllib.error.HTTPError, match="401"):  # a session's key cannot open sessions
            urllib.request.urlopen(urllib.request.Request(f"{h.gateway.url}/sessions", data=b"{}", method="POST",
                                                          headers={"Authorization": f"Bearer {a['api_key']}"}))
        # The run's key and the session's own key both work; /health needs none.
        for key in (KEY, a["api_key"]):
            client = openai.OpenAI(base_url=a["base_url"], api_key=key, max_retries=0)
            assert client.models.list().data[0].id == "policy"
        assert urllib.request.urlopen(f"{h.gateway.url}/health").status == 200


def test_turns_stick_to_one_engine_and_move_with_the_stored_ids_when_it_dies(tmp_path: Path):
    with harness(tmp_path, engines=2) as h:
        opened = h.open_session()
        client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
        messages = [dict(m) for m in QUESTION]
        first = client.chat.completions.create(model="policy", messages=messages)
        home = first.model_extra["session"]["engine"]
        victim = next(e for e in h.engines if e.engine_id == home)
        other = next(e for e in h.engines if e.engine_id != home)
        # A second session lands on the other engine (least loaded); ours stays home.
        client2 = openai.OpenAI(base_url=h.open_session()["base_url"], api_key=KEY, max_retries=0)
        msg = first.choices[0].message
        messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                                                         "content": "plum"}]
        client2.chat.completions.create(model="policy", messages=QUESTION)
        second = client.chat.completions.create(model="policy", messages=messages)
        assert second.model_extra["session"]["engine"] == home and len(victim.requests) == 2
        victim.dead = True  # the engine dies between turns: the next turn fails there and moves
        msg = second.choices[0].message
        messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                                                         "content": "7"}]
        third = client.chat.completions.create(model="policy", messages=messages)
        assert third.model_extra["session"]["engine"] == other.engine_id
        record = h.record(opened["id"])
        assert record["engine_moves"] == 1 and record["engines"] == f"{home}+{other.engine_id}"
        inp, out = other.requests[-1]
        assert inp == victim.requests[-1][0] + victim.requests[-1][1] + inp[len(victim.requests[-1][0]) +
                                                                            len(victim.requests[-1][1]):]
        assert record["prompt_ids"] + record["response_ids"] == inp + out


def test_a_training_session_refuses_other_sampling(tmp_path: Path):
    from dataclasses import replace

    from miles_lite.rollout.gateway.server import PINNED

    with harness(tmp_path) as h:
        async def open_pinned():
            return h.gateway.open(sampling=replace(h.manager.default_sampling, temperature=1.0), pinned=PINNED)

        session = h.loop.run(open_pinned())
        client = openai.OpenAI(base_url=h.gateway.base_url(session), api_key=h.gateway.session_key(session),
                               max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"temperature=0.2 differs from this session's 1.0"):
            client.chat.completions.create(model="policy", messages=QUESTION, temperature=0.2)
        assert client.chat.completions.create(model="policy", messages=QUESTION, temperature=1.0).choices


def test_messages_appended_as_the_clients_objects_and_tool_choice_none(tmp_path: Path):
    with harness(tmp_path) as h:
        opened = h.open_session()
        client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
        messages: list = [dict(m) for m in QUESTION]
        first = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
        assert [t.logprob for t in first.choices[0].logprobs.content] == [-0.25] * first.usage.completion_tokens
        message = first.choices[0].message
        messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "plum"}]
        # The client sends its own message object back: the history matches.
        second = client.chat.completions.create(model="policy", messages=messages, tool_choice="none")
        assert second.choices[0].finish_reason == "stop" and second.choices[0].message.tool_calls is None
        assert second.choices[0].message.content.startswith("<tool_call>")
