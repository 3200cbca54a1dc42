"""Records files as `datasets` writes them, read unchanged: `to_json` (JSON Lines under .json), JSON arrays,
`save_to_disk` folders, `.arrow` files, Parquet shards by glob or list; label-less prompt-only data, TRL's
conversational prompt column with typed text parts and the developer role; raw string prompts; and errors
that name file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from miles_lite.data.encoding import PromptEncoder
from miles_lite.data.gsm8k import DatasetError
from miles_lite.data.identity import records_identity
from miles_lite.data.record_files import data_files, record_paths
from miles_lite.data.records import RecordKeys, load_records

KEYS = RecordKeys(prompt_key="prompt")
ROWS = [{"prompt": f"reverse: {c} b", "solution": f"b {c}"} for c in "acde"]
CHAT_ROWS = [{"prompt": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                         {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": c}]}],
              "solution": c} for c in "xyz"]


def prompts(records) -> list:
    return [r.prompt if r.prompt is not None else [dict(m) for m in r.messages] for r in records]


def test_every_datasets_output_reads_the_same_records(tmp_path: Path) -> None:
    ds = Dataset.from_list(ROWS)
    ds.to_json(tmp_path / "lines.json")  # JSON Lines under .json
    (tmp_path / "array.json").write_text(json.dumps(ROWS, indent=2))
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(tmp_path / "all.parquet")
    for i in range(2):
        ds.shard(2, i, contiguous=True).to_parquet(tmp_path / f"train-{i:05d}-of-00002.parquet")
    arrow = data_files(tmp_path / "saved")[0]
    expected = [r["prompt"] for r in ROWS]
    for spec in (tmp_path / "lines.json", tmp_path / "array.json", tmp_path / "saved", str(tmp_path / "all.parquet"),
                 str(tmp_path / "train-*-of-00002.parquet"), arrow,
                 [str(tmp_path / "train-00000-of-00002.parquet"), str(tmp_path / "train-00001-of-00002.parquet")]):
        records = load_records(spec, KEYS)
        assert prompts(records) == expected, spec
        # Label-less: no `label` column, and none needed to read them.
        assert all(r.label is None and r.columns["solution"] == f"b {r.prompt[9]}" for r in records)
    where = load_records(tmp_path / "array.json", KEYS)[1].where
    assert where == f"{tmp_path / 'array.json'}: line 6"
    assert load_records(tmp_path / "saved", KEYS)[3].where == f"{arrow}: row 3 (0-based)"
    # One identity per file set: the shards' contents and order.
    shards = records_identity(str(tmp_path / "train-*.parquet"), KEYS)
    assert len(shards["key"]["files"]) == 2 and shards != records_identity(tmp_path / "all.parquet", KEYS)
    json.dumps(shards)


def test_conversational_prompt_column_with_typed_parts_and_the_developer_role(tmp_path: Path) -> None:
    Dataset.from_list(CHAT_ROWS).to_parquet(tmp_path / "chat.parquet")
    records = load_records(tmp_path / "chat.parquet", KEYS)
    first = records[0]
    assert first.prompt is None and [dict(m) for m in first.messages] == [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Say x"}]
    assert first.question == "Say x"
    # What the rewards get: the prompt as the data holds it (parts unchanged; datasets may add null keys).
    assert first.prompt_value[1]["content"][1]["text"] == "x"
    encoder = PromptEncoder(ChatML(), "default")
    assert encoder.render(first) == "<system>Be brief.<user>Say x<assistant>"


class ChatML:
    """A tokenizer whose template shows roles, and which adds a BOS token of its own accord, as Llama's does."""

    chat_template = "chatml"
    eos_token_id = 0
    eos_token = "<eos>"
    BOS = 1

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert all(m["role"] in ("system", "user", "assistant") for m in messages)
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        ids = [ord(c) for c in text.replace("<s>", "\x01")]
        return {"input_ids": ([self.BOS] if add_special_tokens else []) + ids}

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<s>" if i == self.BOS else chr(i) for i in ids)


def test_raw_string_prompts_without_the_chat_template(tmp_path: Path) -> None:
    (record,) = load_records(_lines(tmp_path / "d.jsonl", [{"prompt": "The sky is"}]), KEYS)
    templated = PromptEncoder(ChatML(), "default")
    raw = PromptEncoder(ChatML(), "default", raw_prompts=True)
    assert templated.render(record) == "<user>The sky is<assistant>"
    # As TRL tokenizes a standard prompt: the tokenizer's own BOS, then the text.
    assert raw.render(record) == "<s>The sky is"
    (spec,) = raw.prompt_specs([(0, record)])
    assert list(spec.prompt_ids) == ChatML()("The sky is", add_special_tokens=True)["input_ids"]


def _lines(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=False).encode()) + b"\n"
                              for r in rows))
    return path


def test_errors_name_the_file_and_line(tmp_path: Path) -> None:
    bad_utf8 = _lines(tmp_path / "b.jsonl", [{"prompt": "ok"}, b'{"prompt": "caf\xe9"}'])
    with pytest.raises(DatasetError, match=r"b\.jsonl: line 2: byte 0xe9 at byte 16 of the line is not UTF-8"):
        load_records(bad_utf8, KEYS)
    # U+2028 and U+0085 inside a string are not line breaks of JSON Lines.
    odd = _lines(tmp_path / "u.jsonl", [{"prompt": "a\u2028b\u0085c"}, {"prompt": "d"}])
    assert [r.where.rsplit(" ", 1)[1] for r in load_records(odd, KEYS)] == ["1", "2"]
    (tmp_path / "obj.json").write_text(json.dumps({"data": ROWS}, indent=2))
    with pytest.raises(DatasetError, match=r"obj\.json: holds one JSON object written over several lines"):
        load_records(tmp_path / "obj.json", KEYS)
    (tmp_path / "broken.json").write_text('[\n {"prompt": "a"},\n {"prompt": }\n]')
    with pytest.raises(DatasetError, match=r"broken\.json: line 3: invalid JSON"):
        load_records(tmp_path / "broken.json", KEYS)
    with pytest.raises(DatasetError, match=r"data.train_path='.*nothing-\*\.jsonl': the pattern matches no records"):
        load_records(str(tmp_path / "nothing-*.jsonl"), KEYS)
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"dd: a datasets DatasetDict folder; name one of its splits: .*dd/train"):
        record_paths(str(tmp_path / "dd"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(DatasetError, match=r"plain: a folder that is not a datasets save_to_disk folder"):
        record_paths(str(tmp_path / "plain"))
    assert len(load_records(str(tmp_path / "dd" / "train"), KEYS)) == 4
    with pytest.raises(DatasetError, match=r"data.eval_sets.dev.path=\[\]: give a records file"):
        record_paths([], "data.eval_sets.dev.path")
