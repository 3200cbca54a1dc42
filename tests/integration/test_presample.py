"""Presampling: the pass@k estimator, strict/lenient scoring, the filter, and the CLI end to end."""

from __future__ import annotations

import math

import pytest

from miles_lite.config.schema import PresampleConfig
from miles_lite.rollout.presample import (
    QuestionResult,
    lenient_correct,
    pass_at_k,
    strict_correct,
    summarise,
)


def test_pass_at_k_matches_the_combinatorial_definition():
    # n=8 samples, c=2 right: pass@1 = 2/8; pass@k = P(at least one right among k drawn without replacement).
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 2) == pytest.approx(1 - (6 * 5) / (8 * 7))
    assert pass_at_k(8, 2, 7) == 1.0 and pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    for c in range(9):
        curve = [pass_at_k(8, c, k) for k in range(1, 9)]
        assert curve == sorted(curve), "pass@k never decreases with k"
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_strict_and_lenient_scoring():
    good = "<start_working_out>3+4=7<end_working_out><SOLUTION>7</SOLUTION>"
    assert strict_correct(good, 7.0) and lenient_correct(good, 7.0)
    sloppy = "3+4 is 7"
    assert not strict_correct(sloppy, 7.0) and lenient_correct(sloppy, 7.0)
    assert not lenient_correct("7 or maybe 8", 7.0), "lenient reads the last number only"
    assert lenient_correct("the answer is 1,234.", 1234.0) and not lenient_correct("", 0.0)


def _r(i: int, strict: int, lenient: int, k: int = 4) -> QuestionResult:
    return QuestionResult(i, f"q{i}", float(i), k, strict, lenient)


def test_summary_filters_all_wrong_and_all_right_under_the_chosen_scoring():
    results = [_r(0, 0, 0), _r(1, 0, 4), _r(2, 1, 2), _r(3, 4, 4), _r(4, 0, 1)]
    lenient = summarise(results, 4, PresampleConfig(k=4, scoring="lenient"))
    assert (lenient.all_wrong, lenient.all_right, lenient.kept_indices) == (1, 2, [2, 4])
    assert lenient.summary_line() == "1 questions 0/4 and 2 4/4, leaving 2"
    strict = summarise(results, 4, PresampleConfig(k=4, scoring="strict"))
    assert (strict.all_wrong, strict.all_right, strict.kept_indices) == (3, 1, [2])
    assert strict.pass_strict[0] == pytest.approx((0 + 0 + 0.25 + 1 + 0) / 5)
    assert strict.pass_lenient[3] == pytest.approx(4 / 5)
    keep_right = summarise(results, 4, PresampleConfig(k=4, scoring="strict", drop_all_right=False))
    assert keep_right.kept_indices == [2, 3]
    table = strict.table().splitlines()
    assert len(table) == 5
    assert table[1].split() == ["1", f"{strict.pass_strict[0]:.4f}", f"{strict.pass_lenient[0]:.4f}"]
    with pytest.raises(ValueError, match="data.presample.scoring"):
        summarise(results, 4, PresampleConfig(scoring="exact"))


def test_summary_line_uses_thousands_separators():
    results = [_r(i, 0, 0, 8) for i in range(2009)] + [_r(i, 8, 8, 8) for i in range(84)]
    results += [_r(i, 3, 3, 8) for i in range(5380)]
    report = summarise(results, 8, PresampleConfig(k=8))
    assert report.summary_line() == "2,009 questions 0/8 and 84 8/8, leaving 5,380"
    assert math.isclose(report.pass_lenient[0], (84 * 8 + 5380 * 3) / 8 / len(results))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 with the project's offline tokenizer in the same directory."""
    from miles_lite.config.schema import TinyModelShape
    from miles_lite.data.tokenizer import build_tokenizer
    from miles_lite.trainer.tiny_hf import make_tiny_hf_model

    root = tmp_path_factory.mktemp("presample-model")
    tokenizer = build_tokenizer(root, vocab_size=512)
    make_tiny_hf_model("qwen2", TinyModelShape(), len(tokenizer), root, seed=0)
    return str(root)


def test_cli_presamples_synthetic_data_with_a_reference_engine(tiny_model_dir: str, tmp_path, capsys):
    import json
    import re

    from miles_lite.cli import main
    from miles_lite.data.gsm8k import load_gsm8k

    out = tmp_path / "kept.jsonl"
    code = main(["presample", "--model", tiny_model_dir, "--data", "synthetic", "--n", "6", "--k", "3",
                 "--max-new-tokens", "12", "--engines", "1", "--chunk", "4", "--out", str(out),
                 "--log-dir", str(tmp_path / "logs"), "rollout.reference_args.threads=1"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "pass@k over 6 questions, 3 samples each:" in stdout
    rows = [line.split() for line in stdout.splitlines() if re.fullmatch(r"\s*[123]\s+\S+\s+\S+", line)]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    match = re.search(r"lenient scoring: ([\d,]+) questions 0/3 and ([\d,]+) 3/3, leaving ([\d,]+)", stdout)
    assert match, stdout
    wrong, right, left = (int(g.replace(",", "")) for g in match.groups())
    report = json.loads((tmp_path / "kept.presample.json").read_text())
    assert report["k"] == 3 and len(report["results"]) == 6 and wrong + right + left == 6
    assert all(r["k"] == 3 and 0 <= r["strict"] <= r["k"] for r in report["results"])
    kept = load_gsm8k(out) if left else []
    assert len(kept) == left == len(report["kept_indices"])
    assert not (tmp_path / "logs").exists() or any((tmp_path / "logs").iterdir())


def test_cli_rejects_missing_model(tmp_path, capsys):
    from miles_lite.cli import main

    assert main(["presample", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "--model DIR" in capsys.readouterr().err
