"""Bad input named before any work through `miles-lite train`: one line naming the file and the line (or the
field) and the fix, exit code 2, no run directory. Every check here runs before an engine or a trainer starts,
so the commands are run in this process (`miles_lite.cli.main`), sharing one offline tokenizer cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_lite.cli import main

pytestmark = pytest.mark.timeout(300)

RECORDS = ["data.source=records", "data.prompt_key=q", "data.label_key=a", "rewards.set=exact_match",
           "experiment.warmup=none", "observability.progress=false"]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("named_early")  # the offline tokenizer is built here once


def _train(capsys: pytest.CaptureFixture[str], out: Path, *overrides: str) -> tuple[int, str]:
    code = main(["train", f"experiment.output_dir={out}", "experiment.run_name=run", *overrides])
    err = capsys.readouterr().err
    assert not (out / "run").exists(), "a refused start must leave no run directory"
    return code, err


def _write(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join(r if isinstance(r, bytes) else (json.dumps(r, ensure_ascii=False) + "\n").encode()
                              for r in rows))
    return path


def test_a_byte_that_is_not_utf8_is_one_line_naming_file_and_line(capsys, out: Path, tmp_path: Path) -> None:
    train = _write(tmp_path / "train.jsonl", [{"q": "fine", "a": "x"}, b'{"q": "caf\xe9", "a": "y"}\n'])
    code, err = _train(capsys, out, *RECORDS, f"data.train_path={train}")
    assert code == 2
    assert err.strip().splitlines() == [
        f"miles-lite train: data error: {train}: line 2: byte 0xe9 at byte 11 of the line is not UTF-8 (invalid "
        "continuation byte); save the file as UTF-8 (check data.train_path / data.eval_path)"]
    # GSM8K files are read the same way.
    gsm = _write(tmp_path / "gsm.jsonl", [{"question": "1+1?", "answer": "#### 2"}, b"\xff\n"])
    code, err = _train(capsys, out, "data.source=gsm8k", f"data.train_path={gsm}", "experiment.warmup=none")
    assert code == 2 and f"{gsm}: line 2: byte 0xff at byte 1 of the line is not UTF-8" in err


def test_line_separators_inside_json_strings_are_text_and_lines_keep_their_numbers(capsys, out: Path,
                                                                                  tmp_path: Path) -> None:
    # json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 raw: valid JSON Lines, one record a line.
    rows = [{"q": "one\u2028two", "a": "x\u0085"}, {"q": "three\u2029four", "a": "y"}, {"q": "", "a": "z"}]
    train = _write(tmp_path / "train.jsonl", rows)
    code, err = _train(capsys, out, *RECORDS, f"data.train_path={train}")
    # Lines 1 and 2 were read as the records they are; the empty prompt is named on its own line, 3.
    assert code == 2 and f"{train}: line 3: key 'q' (data.prompt_key) is empty" in err, err


def test_type_errors_in_overrides_are_reported_together(capsys, out: Path) -> None:
    code, err = _train(capsys, out, "trainer.lr=fast", "rollout.engines=two", "experiment.steps=1.5",
                       "trainer.tpp=2", "experiment=nope", "--cfg", "job")
    assert code == 2
    lines = [line.removeprefix("miles-lite train: configuration error: ") for line in err.strip().splitlines()]
    assert lines[0].startswith("unknown key trainer.tpp (trainer has no field 'tpp'); closest known: trainer.tp")
    assert set(lines[1:]) == {
        "trainer.lr='fast' is not of type float; set trainer.lr=<float>",
        "rollout.engines='two' is not of type int; set rollout.engines=<int>",
        "experiment.steps=1.5 is not of type int; set experiment.steps=<int>",
        "experiment=nope: no such option in conf/experiment; options: agent_cpu, gsm8k_qwen2.5_0.5b, letters_cpu, "
        "letters_mix_cpu, tiny_cpu, tiny_cpu_tools"}


def test_math_answer_on_word_labels_stops_before_any_work(capsys, out: Path, tmp_path: Path) -> None:
    train = _write(tmp_path / "train.jsonl", [{"q": "2+2?", "a": "4"}, {"q": "Capital of France?", "a": "Paris"}])
    code, err = _train(capsys, out, *RECORDS, "rewards.set=math_answer", f"data.train_path={train}")
    assert code == 2
    assert (f"{train}: line 2: label 'Paris' is not a number, which the math rewards ['math_answer'] need; score "
            "records with rewards.set=exact_match") in err


def test_prompts_longer_than_the_context_are_named_with_file_line_and_length(capsys, out: Path,
                                                                              tmp_path: Path) -> None:
    # A 5 MB prompt (it made the SFT warm-up allocate terabytes) and one of about 1,800 tokens, in training
    # data and in an evaluation file.
    train = _write(tmp_path / "train.jsonl", [{"q": "short", "a": "x", "r": "x"},
                                              {"q": "word " * 1_000_000, "a": "y", "r": "y"},
                                              {"q": "w " * 1800, "a": "z", "r": "z"}])
    dev = _write(tmp_path / "dev.jsonl", [{"q": "fine", "a": "x", "r": "x"}, {"q": "w " * 1800, "a": "y", "r": "y"}])
    code, err = _train(capsys, out, *RECORDS, f"data.train_path={train}", "experiment.warmup=sft",
                       "data.response_key=r", "experiment.warmup_demos=3", "data.max_prompt_tokens=4000000",
                       f"+data.eval_sets={{dev: {{path: {dev}}}}}")
    assert code == 2
    assert (f"{train}: line 2: the prompt has 2,000,012 tokens, which with rollout.max_new_tokens=32 generated need "
            "2,000,044 positions, over the model's context of 512 (model.shape.max_position_embeddings)") in err
    assert f"{train}: line 3: the prompt has 1,811 tokens" in err
    assert f"{dev}: line 2: the prompt has 1,811 tokens" in err
    assert "line 1:" not in err
    # The cap on prompts the user set is checked the same way, before any work.
    code, err = _train(capsys, out, *RECORDS, f"data.train_path={train}", "data.max_prompt_tokens=512")
    assert code == 2 and f"{train}: line 3: the prompt has 1,811 tokens, over data.max_prompt_tokens=512" in err


def test_an_sft_demonstration_longer_than_the_context_is_named(capsys, out: Path, tmp_path: Path) -> None:
    train = _write(tmp_path / "train.jsonl", [{"q": "fine", "a": "x", "r": "x"}, {"q": "p", "a": "y", "r": "y " * 600}])
    code, err = _train(capsys, out, *RECORDS, f"data.train_path={train}", "experiment.warmup=sft",
                       "data.response_key=r", "experiment.warmup_demos=2")
    assert code == 2
    assert f"{train}: line 2: the SFT warm-up's prompt and reference response have" in err
    assert "over the model's context of 512" in err


def test_an_evaluation_set_of_k_greedy_samples_is_refused(capsys, out: Path, tmp_path: Path) -> None:
    dev = _write(tmp_path / "dev.jsonl", [{"q": "p", "a": "x"}])
    code, err = _train(capsys, out, *RECORDS, f"data.train_path={dev}",
                       f"+data.eval_sets={{dev: {{path: {dev}, k: 8, temperature: 0}}}}")
    assert code == 2
    assert ("data.eval_sets.dev.k=8 with data.eval_sets.dev.temperature=0 samples one greedy answer 8 times, so "
            "avg@8 and pass@8 would equal greedy accuracy") in err
    # Without a temperature of its own a k > 1 set samples at the run's; a greedy run leaves it none either.
    code, err = _train(capsys, out, *RECORDS, f"data.train_path={dev}", "rollout.temperature=0",
                       f"+data.eval_sets={{dev: {{path: {dev}, k: 8}}}}")
    assert code == 2 and "data.eval_sets.dev.k=8 with rollout.temperature=0" in err
