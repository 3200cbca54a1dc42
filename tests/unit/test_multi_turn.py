"""Multi-turn tool rollouts and generate plug-ins in the rollout manager: token in / token out, environment
tokens masked out of the loss, turn and budget limits; the calculator; SFT targets in the tool format."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.data.calculator import Calculator, evaluate, tool_solution_segments
from miles_lite.data.gsm8k import MathProblem
from miles_lite.rollout.environment import load_environment
from miles_lite.rollout.fleet import EngineFleet, EngineHandle
from miles_lite.rollout.generate_plugin import load_generate_fn
from miles_lite.rollout.manager import RolloutManager
from miles_lite.rollout.prompt_spec import PromptSpec
from miles_lite.run.rl_batch import build_train_batch
from miles_lite.types import Generation, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def encode(text: str) -> list[int]:  # one token per character: easy to read back
    return [ord(c) for c in text]


def decode(ids) -> str:
    return "".join(chr(i) for i in ids)


class ScriptedEngine:
    """Answers each request with the next scripted turn whose trigger is the end of the input text."""

    engine_id = "scripted"
    url = "fake://scripted"

    def __init__(self, script: list[tuple[str, str, str]]) -> None:
        self.script = script  # (input ends with, output text, finish reason)
        self.inputs: list[list[int]] = []
        self.stops: list[tuple[str, ...]] = []

    async def generate(self, input_ids, sampling: SamplingParams, *, rid=None) -> Generation:
        self.inputs.append(list(input_ids))
        self.stops.append(tuple(sampling.stop))
        text = decode(input_ids)
        for trigger, output, reason in self.script:
            if text.endswith(trigger):
                ids = encode(output)[: sampling.max_new_tokens]
                return Generation(tuple(ids), tuple(-0.5 for _ in ids), reason, "1", self.engine_id)
        raise AssertionError(f"no scripted turn for input {text!r}")

    async def health(self, timeout_s: float) -> bool:
        return True

    async def abort(self, rid=None) -> None:
        return None


PROMPT = "Q: 2*3?\n"
SCRIPT = [(PROMPT, "<calc>2*3</calc>", "stop"), ("<result>6</result>", "so 6", "stop")]


def _run(engine, *, max_new_tokens=64, max_turns=4, generate_fn=None, environment="calculator"):
    async def main():
        ft = FaultToleranceConfig(health_interval_s=60, request_retries=0)
        rollout = RolloutConfig(group_size=1, max_new_tokens=max_new_tokens, max_turns=max_turns)
        fleet = EngineFleet(ft)
        await fleet.add_engine(EngineHandle(engine))
        env = load_environment(environment) if environment and not generate_fn else None
        manager = RolloutManager(fleet, rollout, ft, decode=decode, encode=encode, environment=env,
                                 generate_fn=generate_fn)
        spec = PromptSpec(0, tuple(encode(PROMPT)), PROMPT, "2*3?", 6.0, ())
        groups = await manager.generate_groups([spec])
        await fleet.close()
        return groups[0].samples[0]

    return asyncio.run(main())


def test_calculator_turns_are_token_in_token_out_and_replies_are_masked():
    engine = ScriptedEngine(SCRIPT)
    sample = _run(engine)
    assert sample.response_text == "<calc>2*3</calc><result>6</result>so 6"
    assert sample.turns == 2 and sample.finish_reason == "stop"
    reply = len("<result>6</result>")
    first = len("<calc>2*3</calc>")
    assert sample.loss_mask == [1] * first + [0] * reply + [1] * len("so 6")
    assert sample.rollout_logprobs == [-0.5] * first + [0.0] * reply + [-0.5] * 4
    # The second request continues from exactly the ids produced so far (nothing re-tokenised).
    assert engine.inputs[1] == encode(PROMPT) + sample.response_ids[: first + reply]
    assert "</calc>" in engine.stops[0]  # the tool call ends the model's turn
    batch, _ = build_train_batch([_group(sample)], _algo())
    assert batch is not None and batch.loss_masks == [sample.loss_mask] * 2
    assert batch.loss_token_counts == [first + 4] * 2


def test_max_turns_and_token_budget_end_the_trajectory():
    sample = _run(ScriptedEngine(SCRIPT), max_turns=1)
    assert sample.response_text == "<calc>2*3</calc>" and sample.turns == 1 and sample.loss_mask is None
    # The reply fits, but no room would be left for an answer: the trajectory ends at its budget.
    sample = _run(ScriptedEngine(SCRIPT), max_new_tokens=len("<calc>2*3</calc><result>6</result>"))
    assert sample.finish_reason == "length" and sample.response_text == "<calc>2*3</calc>"


def test_generate_plugin_writes_masked_tokens_of_its_own():
    script = [(PROMPT, "<start_working_out>2*3=6<end_working_out>", "stop"), ("<SOLUTION>", "6</SOLUTION>", "stop")]
    fn = load_generate_fn("miles_plugins.generate:think_then_answer")
    sample = _run(ScriptedEngine(script), generate_fn=fn)
    assert sample.response_text == "<start_working_out>2*3=6<end_working_out><SOLUTION>6</SOLUTION>"
    n1 = len("<start_working_out>2*3=6<end_working_out>")
    assert sample.loss_mask == [1] * n1 + [0] * len("<SOLUTION>") + [1] * len("6</SOLUTION>")
    assert sample.weight_version == "1" and sample.engine_id == "scripted"


def test_generate_plugin_must_be_async_and_take_three_arguments(tmp_path, monkeypatch):
    (tmp_path / "bad_gen.py").write_text("def sync_fn(client, prompt, sampling): ...\nasync def two(a, b): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="rollout.generate_fn=.bad_gen:sync_fn. must be an `async def`"):
        load_generate_fn("bad_gen:sync_fn")
    with pytest.raises(ValueError, match="^rollout.generate_fn: .*two.*cannot be called"):
        load_generate_fn("bad_gen:two")
    with pytest.raises(ValueError, match="neither a built-in environment"):
        load_environment("abacus")


@pytest.mark.parametrize(("expression", "value"), [("2*3", 6), ("(7-2)/2", 2.5), ("1,200+3", 1203), ("-4*-2", 8)])
def test_calculator_evaluates_arithmetic_only(expression, value):
    assert evaluate(expression) == value
    assert Calculator().reply(f"x <calc>{expression}</calc>", "") is not None


@pytest.mark.parametrize("expression", ["__import__('os')", "2**100000", "1/0", "x+1"])
def test_calculator_refuses_anything_else(expression):
    assert Calculator().reply(f"<calc>{expression}</calc>", "") == "<result>error</result>"


def test_calculator_parses_one_expression_at_a_time_across_threads(monkeypatch):
    """Replies run on the plug-in pool's threads, and CPython 3.11's AST converter fails when two threads parse at
    once ("SystemError: AST constructor recursion depth mismatch", seen in a run at step 159): no two parses
    overlap."""
    import ast
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    real, inside, most = ast.parse, [0], [0]
    counting = threading.Lock()

    def slow_parse(*args, **kwargs):
        with counting:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.002)  # a parse long enough for the other threads to arrive
        try:
            return real(*args, **kwargs)
        finally:
            with counting:
                inside[0] -= 1

    monkeypatch.setattr(ast, "parse", slow_parse)
    with ThreadPoolExecutor(8) as pool:
        values = list(pool.map(evaluate, [f"{i}*2+1" for i in range(64)]))
    assert values == [i * 2 + 1 for i in range(64)] and most[0] == 1


def test_sft_targets_show_the_tool_turns():
    problem = MathProblem("q", "Mia has 3+4=<<3+4=7>>7 apples.\n7*2=<<7*2=14>>14\n#### 14", 14.0, (7.0,))
    segments = tool_solution_segments(problem)
    assert segments == [("<start_working_out>Mia has <calc>3+4</calc>", True), ("<result>7</result>", False),
                        (" apples.\n<calc>7*2</calc>", True), ("<result>14</result>", False),
                        ("<end_working_out><SOLUTION>14</SOLUTION>", True)]


def _group(sample):
    from miles_lite.types import Group

    other = type(sample)(**{**sample.__dict__, "rewards": {"total": 0.0}})
    sample.rewards = {"total": 1.0}
    return Group(0, PROMPT, "q", 6.0, (), [sample, other])


def _algo():
    from miles_lite.config.schema import AlgoConfig

    return AlgoConfig()


def test_masked_tokens_get_no_gradient_and_leave_the_mismatch_metrics():
    import torch

    from miles_lite.config.schema import AlgoConfig
    from miles_lite.trainer.packing import pack
    from miles_lite.trainer.rl_loss import BatchTotals, rl_micro_loss
    from miles_lite.types import TrainBatch

    # One sequence: 2 prompt tokens, 4 response tokens, the middle two an environment reply.
    batch = TrainBatch(tokens=[[1, 2, 3, 4, 5, 6]], prompt_lengths=[2], rollout_logprobs=[[-1.0, 0.0, 0.0, -1.0]],
                       advantages=[1.0], loss_masks=[[1, 0, 0, 1]])
    mb = pack(batch.tokens, batch.prompt_lengths, [0])
    logp = torch.tensor([-1.0, -3.0, -4.0, -1.0], requires_grad=True)
    loss, stats = rl_micro_loss(logp, None, mb, batch, AlgoConfig(), None, None)
    loss.backward()
    assert logp.grad[1] == 0 and logp.grad[2] == 0 and logp.grad[0] != 0 and logp.grad[3] != 0
    # The reply tokens' rollout log-prob is 0.0 by construction: were they counted, the diff would be 3.5.
    assert stats["mismatch/logp_abs_diff_mean"] == 0.0
    assert BatchTotals.of(batch).response_tokens == 2


def test_tool_use_is_counted_per_step_and_in_evaluation():
    from miles_lite.data.calculator import call_outcomes
    from miles_lite.evaluation.greedy import summarise
    from miles_lite.run.rl_batch import tool_stats
    from miles_lite.types import Group, Sample

    text = "<calc>2*3</calc><result>6</result><calc>6+1</calc><result>9</result>so 9"
    # The first call's value is a step of the reference solution, the second is not (6+1 is 7, not 9).
    assert call_outcomes(text, (6.0, 7.0)) == (2, 1)
    assert call_outcomes("<calc>2*</calc><result>error</result>", (6.0,)) == (1, 0)
    two_calls = Sample(0, [1], list(range(8)), [0.0] * 8, response_text=text, loss_mask=[1, 0, 0, 1, 0, 1, 1, 1])
    no_call = Sample(0, [1], [1, 2], [0.0] * 2, response_text="so 6")
    stats = tool_stats([Group(0, "p", "q", 7.0, (6.0, 7.0), [two_calls, no_call])])
    assert (two_calls.environment_replies, no_call.environment_replies) == (2, 0)
    assert stats == {"rollout/tool_calls_per_sample": 1.0, "rollout/tool_use_share": 0.5,
                     "rollout/tool_correct_call_share": 0.5}
    assert "tool calls" not in summarise(["so 6"], [MathProblem("q", "#### 6", 6.0, (6.0,))]).table()


def test_a_synthetic_spec_the_generator_refuses_fails_naming_the_field():
    from miles_lite.config import load_config
    from miles_lite.data.problems import load_problems

    cfg = load_config(["data.synthetic.max_operand=99", "data.synthetic.max_result=50"])
    with pytest.raises(ValueError, match=r"data.synthetic: max_result \(50\) must be >= max_operand \(99\)"):
        load_problems(cfg.data, cfg.experiment.eval_size)


class SuiteEnvironment:
    """Per-task state: each trajectory gets the tests of its own record from `reset(record)`."""

    stop = ("</run>",)

    def __init__(self) -> None:
        self.records: list = []

    def reset(self, record):
        self.records.append(record)
        return SuiteEpisode(record.columns["metadata"]["tests"])


class SuiteEpisode:
    def __init__(self, tests: list[str]) -> None:
        self.tests = list(tests)

    def reply(self, turn: str, question: str) -> str | None:
        if not turn.endswith("</run>"):
            return None
        return f"<ok>{self.tests.pop(0)}</ok>"


def test_environment_reset_hands_each_trajectory_its_record():
    from miles_lite.data.records import Record

    record = Record("run it", None, "pass", {"metadata": {"tests": ["t1", "t2"]}, "label": "pass"}, "code")
    engine = ScriptedEngine([("run it", "<run>a</run>", "stop"), ("<ok>t1</ok>", "<run>b</run>", "stop"),
                             ("<ok>t2</ok>", " done", "stop")])
    env = SuiteEnvironment()

    async def main():
        ft = FaultToleranceConfig(health_interval_s=60, request_retries=0)
        fleet = EngineFleet(ft)
        await fleet.add_engine(EngineHandle(engine))
        manager = RolloutManager(fleet, RolloutConfig(group_size=2, max_new_tokens=64, max_turns=4), ft,
                                 decode=decode, encode=encode, environment=env)
        spec = PromptSpec(0, tuple(encode("run it")), "run it", "run it", record=record)
        groups = await manager.generate_groups([spec])
        await fleet.close()
        return groups[0]

    group = asyncio.run(main())
    # One reset per trajectory, each with the record; each trajectory consumed its own copy of the tests.
    assert env.records == [record, record] and group.record is record
    expected = "<run>a</run><ok>t1</ok><run>b</run><ok>t2</ok> done"
    assert [decode(s.response_ids) for s in group.samples] == [expected] * 2
