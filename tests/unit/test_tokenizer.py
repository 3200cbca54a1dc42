"""Offline byte-level BPE tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import miles_lite.data.tokenizer as tokenizer_module
from miles_lite.data import build_tokenizer, load_or_build_tokenizer, render_prompt
from miles_lite.data.prompts import SYSTEM_PROMPT
from miles_lite.data.tokenizer import CONTROL_TOKENS, tokenizer_cache_key
from miles_lite.formats.answer import ANSWER_TAGS


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tok")
    return out, build_tokenizer(out)


def test_same_args_give_identical_files(built, tmp_path: Path) -> None:
    out, _ = built
    build_tokenizer(tmp_path, vocab_size=512, seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes()


def test_tags_and_control_tokens_are_single_tokens(built) -> None:
    _, tok = built
    for token in (*ANSWER_TAGS, *CONTROL_TOKENS):
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
        assert tok.convert_ids_to_tokens(ids) == [token]
    assert len(tok) <= 512


def test_digits_are_split_and_text_roundtrips(built) -> None:
    _, tok = built
    ids = tok.encode("12345", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == list("12345")
    text = "<start_working_out>17-13=4\n4*6=24<end_working_out><SOLUTION>24</SOLUTION>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # Tags are not special, so decoding for rewards keeps them; control tokens are dropped.
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_special_tokens_and_chat_template(built) -> None:
    _, tok = built
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    prompt = render_prompt(tok, "What is 2+3?")
    assert prompt == (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_vocab_size_too_small_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be >="):
        build_tokenizer(tmp_path, vocab_size=100)


def test_load_or_build_caches_offline(built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out, _ = built
    first = load_or_build_tokenizer(tmp_path)
    target = tmp_path / tokenizer_cache_key()
    assert (target / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    stamp = (target / "tokenizer.json").stat().st_mtime_ns
    second = load_or_build_tokenizer(tmp_path)
    assert (target / "tokenizer.json").stat().st_mtime_ns == stamp
    assert first.get_vocab() == second.get_vocab()
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no staging leftovers


def test_concurrent_builder_losing_the_race_uses_the_winner(
    built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _ = built
    target = tmp_path / tokenizer_cache_key()

    def build_while_another_process_finishes_first(staging: Path, **_: int) -> None:
        shutil.copytree(out, staging, dirs_exist_ok=True)
        shutil.copytree(out, target)  # the other process renames its build into place first

    monkeypatch.setattr(tokenizer_module, "build_tokenizer", build_while_another_process_finishes_first)
    tok = load_or_build_tokenizer(tmp_path)
    assert tok.eos_token == "<|im_end|>"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_saved_config_names_generic_fast_tokenizer(built) -> None:
    out, tok = built
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    # The generic class name lets AutoTokenizer in any transformers release load the directory.
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == tok.chat_template
