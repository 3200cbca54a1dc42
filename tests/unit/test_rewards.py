"""Reward semantics, number parsing and the reward registry."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_lite.formats.answer import (
    answer_matches,
    decimal_places,
    find_numbers,
    format_number,
    numbers_equal,
    parse_number,
    parse_solution_number,
)
from miles_lite.plugins import PluginFailed
from miles_lite.rewards import (
    REWARD_NAMES,
    RewardSet,
    get_reward_set,
    parse_answer,
    register_reward,
    score,
    score_completions,
    unregister_reward,
    validate_reward_names,
)
from miles_lite.rewards.math import score_steps, step_budget

PERFECT = "<start_working_out>3*4=12, 12*6=72<end_working_out><SOLUTION>72</SOLUTION>"
QUESTION = "A box holds 3 rows of 4 eggs. How many eggs are in 6 boxes?"
STEPS = (12.0, 72.0)


def score_one(completion: str, answer: float | str = 72.0, steps=STEPS, question: str = QUESTION,
              reward_set: str | RewardSet = "worklog") -> dict[str, float]:
    return score_completions([completion], [answer], [question], [steps], reward_set=reward_set)[0]


# --- numbers -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "expected"),
    [("1,234", 1234.0), ("1234", 1234.0), ("2.50", 2.5), ("-3", -3.0), (" 72 \n", 72.0), (".5", 0.5),
     ("1,234,567.25", 1234567.25), ("+7", 7.0)],
)
def test_parse_number_accepts_number_tokens(text: str, expected: float) -> None:
    assert parse_number(text) == expected


@pytest.mark.parametrize("text", ["$10", "$10 + $2.", "12.", "12 apples", "1,23", "", "abc", "3e5", "1 2"])
def test_parse_number_rejects_non_numbers(text: str) -> None:
    assert parse_number(text) is None


def test_find_numbers_handles_commas_signs_and_trailing_periods() -> None:
    assert find_numbers("3*4=12, then 1,234.") == [3.0, 4.0, 12.0, 1234.0]
    assert find_numbers("It is -3 degrees, 5-3=2 and 2.50 dollars.") == [-3.0, 5.0, 3.0, 2.0, 2.5]
    assert find_numbers("pairs (3,4) and 12,3456") == [3.0, 4.0, 12.0, 3456.0]
    assert find_numbers("lost -$5, then $-2 and $7") == [-5.0, -2.0, 7.0]


def test_number_equivalences() -> None:
    assert numbers_equal(parse_number("1,234"), 1234)
    assert numbers_equal(parse_number("2.50"), 2.5)
    assert not numbers_equal(1e9, 1e9 + 1)  # exact: no relative tolerance
    assert not numbers_equal(72, 72.01)
    assert numbers_equal(0.0, 0.0) and not numbers_equal(0.0, 1e-3)


@pytest.mark.parametrize(
    ("value", "reference", "right"),
    [
        (2_000_001, 2_000_000, False),  # a 5e-7 relative error: graded right by a 1e-6 tolerance before
        (2_000_000, 2_000_000, True),
        (9_007_199_254_740_000, 9_007_199_254_740_001, False),
        (-3, -3, True), (3, -3, False), (-3.0, -3, True),
        (2.0, 2, True), (2.4, 2, False), (1.9999999, 2, False),  # an integer answer is exact
        (2.5, 2.5, True), (2.54, 2.5, True), (2.55, 2.5, False),  # rounded half-up at the answer's 1 place
        (33.333, 33.33, True), (33.3, 33.33, False), (33.34, 33.33, False), (33.325, 33.33, True),
        (-0.125, -0.13, True), (-0.135, -0.13, False), (0.1, 0.1, True), (0.10000001, 0.1, True),
    ],
)
def test_answer_matches_integers_exactly_and_decimals_by_written_precision(value, reference, right) -> None:
    assert answer_matches(float(value), float(reference)) is right


def test_decimal_places_of_the_shortest_text() -> None:
    assert [decimal_places(v) for v in (2.0, 2.5, 33.33, -0.125, 1e-7, 2_000_000.0)] == [0, 1, 2, 3, 7, 0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("$1,234", 1234.0), ("-$5", -5.0), ("$-5", -5.0), ("50%", 50.0), ("18 dollars.", 18.0), ("+7", 7.0),
     (" 3 square feet ", 3.0), ("\u22124", -4.0), ("$2.50", 2.5), ("72", 72.0)],
)
def test_parse_solution_number_reads_written_answers(text: str, expected: float) -> None:
    assert parse_solution_number(text) == expected


@pytest.mark.parametrize("text", ["$10 + $2", "--5", "-$-5", "12 apples and 3 pears", "5-3", "x", "", "1 2"])
def test_parse_solution_number_rejects_expressions(text: str) -> None:
    assert parse_solution_number(text) is None


def test_large_integer_off_by_one_is_wrong_for_every_correctness_reward() -> None:
    completion = "<start_working_out>1999999+2<end_working_out><SOLUTION>2,000,001</SOLUTION>"
    result = score_one(completion, answer=2_000_000, steps=())
    assert result["exact_check"] == result["correctness_check"] == result["lenient_correctness_check"] == 0.0
    assert result["solution_number_check"] == 1.0
    right = score_one(completion.replace("2,000,001", "2,000,000"), answer="2,000,000", steps=())
    assert right["exact_check"] == right["correctness_check"] == right["lenient_correctness_check"] == 1.0


def test_correctness_accepts_dollars_percent_and_units_exact_does_not() -> None:
    for written in ("$72", "72 eggs", "72%", "72."):
        result = score_one(f"<start_working_out>3*4=12, 12*6=72<end_working_out><SOLUTION>{written}</SOLUTION>")
        assert result["correctness_check"] == 1.0, written
        assert result["exact_check"] == result["solution_number_check"] == 0.0, written
    negative = score_one("<start_working_out>5-8<end_working_out><SOLUTION>-$3</SOLUTION>", answer=-3, steps=())
    assert negative["correctness_check"] == negative["lenient_correctness_check"] == 1.0
    assert score_one("<start_working_out>5-8<end_working_out><SOLUTION>$3</SOLUTION>", answer=-3,
                     steps=())["correctness_check"] == 0.0


def test_format_number_drops_trailing_zero() -> None:
    assert format_number(12.0) == "12"
    assert format_number(2.5) == "2.5"
    assert format_number(-3.0) == "-3"


@given(st.integers(min_value=-10**12, max_value=10**12), st.booleans())
def test_parse_number_roundtrips_formatted_ints(value: int, commas: bool) -> None:
    text = f"{value:,}" if commas else str(value)
    assert parse_number(text) == value
    assert find_numbers(f"so the total is {text}.") == [float(value)]


@given(st.floats(min_value=-1e9, max_value=1e9, allow_nan=False), st.integers(0, 6), st.booleans())
def test_parse_number_roundtrips_formatted_floats(value: float, digits: int, commas: bool) -> None:
    text = f"{value:,.{digits}f}" if commas else f"{value:.{digits}f}"
    parsed = parse_number(text)
    assert parsed is not None
    assert math.isclose(parsed, float(text.replace(",", "")), rel_tol=1e-12, abs_tol=1e-12)


# --- individual rewards ------------------------------------------------------------------------

def test_perfect_completion_scores_max() -> None:
    result = score_one(PERFECT)
    assert result["total"] == pytest.approx(5.25)
    assert get_reward_set("worklog").max_total == pytest.approx(5.25)
    assert all(result[name] == (0.5 if name == "tag_check" else 1.0) for name in REWARD_NAMES)


def test_unclosed_working_out_scores_lenient_only() -> None:
    result = score_one("<start_working_out>3*4=12 so 12", answer=12.0, steps=(12.0,))
    assert result["lenient_correctness_check"] == 1.0
    assert result["correctness_check"] == 0.0
    assert result["exact_check"] == 0.0
    assert result["format_check"] == 0.0
    assert result["solution_number_check"] == 0.0
    assert result["tag_check"] == 0.125


def test_unclosed_solution_block_scores_zero_correctness() -> None:
    result = score_one("<start_working_out>x<end_working_out><SOLUTION>72")
    assert result["correctness_check"] == 0.0
    assert result["solution_number_check"] == 0.0
    assert result["lenient_correctness_check"] == 1.0


def test_dollar_expression_is_not_a_solution_number() -> None:
    result = score_one("<start_working_out>10+2<end_working_out><SOLUTION>$10 + $2.</SOLUTION>", answer=12.0)
    assert result["solution_number_check"] == 0.0
    assert result["correctness_check"] == 0.0
    assert result["exact_check"] == 0.0
    assert result["format_check"] == 1.0


def test_solution_with_whitespace_and_commas_is_correct() -> None:
    completion = "<start_working_out>sum<end_working_out><SOLUTION>\n 1,234 \n</SOLUTION>"
    result = score_one(completion, answer="1234", steps=())
    assert result["correctness_check"] == result["exact_check"] == result["solution_number_check"] == 1.0
    assert score_one(completion.replace("1,234", "2.50"), answer=2.5)["correctness_check"] == 1.0
    assert score_one(completion.replace("1,234", "-3"), answer=-3)["correctness_check"] == 1.0


def test_repeated_tag_earns_nothing_for_that_tag() -> None:
    completion = "<start_working_out>a<start_working_out>b<end_working_out><SOLUTION>72</SOLUTION>"
    result = score_one(completion)
    assert result["tag_check"] == pytest.approx(0.375)
    assert result["format_check"] == 0.0
    assert result["exact_check"] == 0.0
    assert result["correctness_check"] == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "Sure! " + PERFECT,
        PERFECT + " Hope this helps.",
        "<start_working_out>x<end_working_out> so <SOLUTION>72</SOLUTION>",
        "<SOLUTION>72</SOLUTION><start_working_out>x<end_working_out>",
        "<end_working_out>x<start_working_out><SOLUTION>72</SOLUTION>",
    ],
)
def test_format_check_rejects_extra_text_and_wrong_order(completion: str) -> None:
    assert score_one(completion)["format_check"] == 0.0


def test_format_check_allows_whitespace_around_blocks() -> None:
    completion = "\n <start_working_out>\nwork\n<end_working_out>\n\n<SOLUTION> 72 </SOLUTION>\n"
    assert score_one(completion)["format_check"] == 1.0
    assert score_one(completion)["exact_check"] == 1.0


def test_correctness_uses_first_solution_block() -> None:
    completion = "<SOLUTION>5</SOLUTION> wait <SOLUTION>72</SOLUTION>"
    assert score_one(completion)["correctness_check"] == 0.0


def test_reference_answer_comes_from_final_marker_not_tags() -> None:
    reference = "<SOLUTION>5</SOLUTION> 3*4=<<3*4=12>>12 and 12*6=<<12*6=72>>72\n#### 72"
    assert parse_answer(reference) == 72.0
    assert score_one(PERFECT, answer=reference)["correctness_check"] == 1.0
    wrong = "<start_working_out>x<end_working_out><SOLUTION>5</SOLUTION>"
    assert score_one(wrong, answer=reference)["correctness_check"] == 0.0
    with pytest.raises(ValueError, match="not a number"):
        parse_answer("<SOLUTION>72</SOLUTION>")


def test_step_check_counts_shown_intermediate_results() -> None:
    question = "Ann has 3 bags with 4 apples each. She buys 5 more. Then she doubles them. How many?"
    steps = (12.0, 17.0, 34.0)  # 34 is the answer and is excluded
    assert score_steps("3*4=12, 12+5=17, 17*2=34", 34.0, question, steps) == 1.0
    assert score_steps("12 then 34", 34.0, question, steps) == 0.5
    assert score_steps("just 34", 34.0, question, steps) == 0.0


def test_step_check_ignores_steps_given_in_question_and_final_answer() -> None:
    question = "Tom has 12 cards and gets 12 more. How many?"
    assert score_steps("12+12=24", 24.0, question, (24.0,)) == 0.0  # no relevant steps
    assert score_steps("12+12=24 so 24", 24.0, question, (12.0, 24.0)) == 0.0


def test_dumping_many_numbers_shrinks_step_check() -> None:
    question = "Ann has 3 bags with 4 apples each. She buys 5 more. How many?"
    steps = (12.0, 17.0)  # relevant: 12 only
    honest = "3*4=12, 12+5=17"
    dump = honest + " " + " ".join(str(n) for n in range(100, 112))
    assert score_steps(honest, 17.0, question, steps) == 1.0
    shrunk = score_steps(dump, 17.0, question, steps)
    # 14 new numbers (12, 17 and 100..111) against a budget of 2*1+4 = 6.
    assert shrunk == pytest.approx(step_budget(1) / 14)
    assert 0.0 < shrunk < 1.0


def test_missing_step_info_gives_zero_step_check() -> None:
    result = score_completions([PERFECT], [72.0], [QUESTION])[0]
    assert result["step_check"] == 0.0
    assert result["total"] == pytest.approx(4.75)


# --- registry and reward sets ------------------------------------------------------------------

def test_named_reward_sets() -> None:
    worklog = get_reward_set("worklog")
    assert worklog.names == REWARD_NAMES
    assert dict(worklog.weights)["exact_check"] == 2.0
    only = score_one(PERFECT, reward_set="correctness_only")
    assert only == {"correctness_check": 1.0, "total": 1.0}
    fmt = score_one(PERFECT, reward_set="format_only")
    assert get_reward_set("format_only").max_total == pytest.approx(1.25)
    assert fmt["total"] == pytest.approx(1.25)
    known = "correctness_only, exact_match, format_only, math_answer, worklog"
    with pytest.raises(ValueError, match=f"known sets: {known}"):
        get_reward_set("nope")


def test_validate_reward_names_lists_known_rewards() -> None:
    validate_reward_names(["format_check", "step_check"])
    with pytest.raises(ValueError, match=r"unknown reward name\(s\) \['formt_check'\].*exact_check"):
        validate_reward_names(["formt_check"])
    with pytest.raises(ValueError, match="formt_check"):
        score(RewardSet("typo", {"formt_check": 1.0}), ["x"], [1.0], ["q"], [()])


def test_reward_set_is_immutable_and_validated() -> None:
    reward_set = RewardSet("custom", {"format_check": 1.0})
    with pytest.raises(TypeError):
        reward_set.weights["format_check"] = 2.0  # type: ignore[index]
    with pytest.raises(ValueError, match="non-finite"):
        RewardSet("bad", {"format_check": float("nan")})


def test_with_weights_overrides_and_extends() -> None:
    base = get_reward_set("correctness_only")
    tuned = base.with_weights({"correctness_check": 3.0, "format_check": 0.5})
    assert dict(tuned.weights) == {"correctness_check": 3.0, "format_check": 0.5}
    assert dict(base.weights) == {"correctness_check": 1.0}
    assert score_one(PERFECT, reward_set=tuned)["total"] == pytest.approx(3.5)
    with pytest.raises(ValueError, match="unknown reward name"):
        base.with_weights({"nope": 1.0})


def _length_reward(completions, *, answers, questions, steps):
    return [len(c) / 100 for c in completions]


def test_custom_reward_registration_and_weighted_total() -> None:
    register_reward("test_length", _length_reward, max_value=5.0)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_reward("test_length", _length_reward)
        reward_set = RewardSet("mixed", {"test_length": 2.0, "correctness_check": 1.0})
        (row,) = score(reward_set, [PERFECT], [72.0], [QUESTION], [STEPS])
        assert row["test_length"] == pytest.approx(len(PERFECT) / 100)
        assert row["total"] == pytest.approx(2 * len(PERFECT) / 100 + 1.0)
        assert reward_set.max_total == pytest.approx(2 * 5.0 + 1.0)
    finally:
        unregister_reward("test_length")
    with pytest.raises(ValueError, match="built-in"):
        unregister_reward("format_check")


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda completions, **_: [1.0] * (len(completions) + 1), "returned 3 values for 2 completions"),
        (lambda completions, **_: [float("nan")] * len(completions), "expected a finite float"),
        (lambda completions, **_: [float("inf")] * len(completions), "expected a finite float"),
        (lambda completions, **_: ["1.0"] * len(completions), "expected a finite float"),
        (lambda completions, **_: None, "expected a list of 2 floats"),
        (lambda completions, **_: 1 / 0, "ZeroDivisionError: division by zero"),
    ],
)
def test_bad_reward_output_raises_naming_the_reward(fn, message: str) -> None:
    register_reward("test_bad", fn)
    try:
        with pytest.raises(PluginFailed, match=f"^reward 'test_bad' failed: .*{message}") as failed:
            score(RewardSet("bad", {"test_bad": 1.0}), ["a", "b"], [1.0, 2.0], ["q", "q"], [(), ()])
        assert failed.value.plugin == "reward 'test_bad'" and failed.value.__cause__ is failed.value.error
    finally:
        unregister_reward("test_bad")


def test_misaligned_inputs_raise() -> None:
    with pytest.raises(ValueError, match="answers has 1 entries but there are 2 completions"):
        score("worklog", ["a", "b"], [1.0], ["q", "q"], [(), ()])
