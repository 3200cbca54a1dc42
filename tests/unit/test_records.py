"""Records data: the key mapping, every column kept, errors naming file, line and key; rendering of
prompts and chat messages; the identity of a records file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_lite.data.encoding import PromptEncoder
from miles_lite.data.gsm8k import DatasetError
from miles_lite.data.identity import records_identity
from miles_lite.data.records import Record, RecordKeys, load_records

KEYS = RecordKeys(prompt_key="prompt", metadata_key="meta")


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_records_keep_every_column_label_as_is_and_default_source(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", [
        {"prompt": "say hi", "label": "hi", "meta": {"tests": ["a"]}, "data_source": "greet", "extra": 3},
        "",
        {"prompt": "list", "label": [1, "x"], "meta": {}, "data_source": "lists"},
    ])
    first, second = load_records(path, KEYS)
    assert first.prompt == "say hi" and first.label == "hi" and first.source == "greet"
    assert first.columns == {"prompt": "say hi", "label": "hi", "meta": {"tests": ["a"]}, "data_source": "greet",
                             "extra": 3}
    assert second.label == [1, "x"] and second.where.endswith("d.jsonl: line 3")
    assert first.question == "say hi" and first.answer != first.answer  # NaN: not a number
    assert load_records(write(tmp_path / "n.jsonl", [{"prompt": "p", "label": "1,234"}]),
                        RecordKeys(prompt_key="prompt"))[0].answer == 1234.0


def test_source_key_and_response_key(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", [{"q": "x", "y": "z", "origin": "s1", "ref": "z!"}])
    (record,) = load_records(path, RecordKeys(prompt_key="q", label_key="y", source_key="origin", response_key="ref"))
    assert (record.source, record.response, record.label) == ("s1", "z!", "z")


def test_parquet_records(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "label": "b", "meta": {"k": 1}}]), tmp_path / "d.parquet")
    (record,) = load_records(tmp_path / "d.parquet", KEYS)
    assert record.columns["meta"] == {"k": 1} and record.where.endswith("row 0 (0-based)")
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "meta": {"k": 1}}]), tmp_path / "e.parquet")
    (label_less,) = load_records(tmp_path / "e.parquet", KEYS)  # prompt-only data: no label
    assert label_less.label is None and "label" not in label_less.columns
    pq.write_table(pa.Table.from_pylist([{"meta": {"k": 1}}]), tmp_path / "f.parquet")
    with pytest.raises(DatasetError, match=r"f\.parquet: row 0 \(0-based\): missing key 'prompt' \(data.prompt_key\)"):
        load_records(tmp_path / "f.parquet", KEYS)


@pytest.mark.parametrize(("row", "message"), [
    ({"label": "x", "meta": {}}, r"line 2: missing key 'prompt' \(data.prompt_key\).*set data.prompt_key"),
    ({"prompt": "p", "label": "x"}, r"line 2: missing key 'meta' \(data.metadata_key\)"),
    ({"prompt": 7, "label": "x", "meta": {}},
     r"line 2: key 'prompt' \(data.prompt_key\) must be a string or a list of \{role, content\} chat messages, "
     r"got int"),
    ({"prompt": ["p"], "label": "x", "meta": {}},
     r"line 2: key 'prompt' \(data.prompt_key\) message 0 must be an object"),
    ({"prompt": "  ", "label": "x", "meta": {}}, r"line 2: key 'prompt' \(data.prompt_key\) is empty"),
    ({"prompt": "p", "label": "x", "meta": [1]}, r"line 2: key 'meta' \(data.metadata_key\) must be an object"),
    ({"prompt": "p", "label": "x", "meta": {}, "data_source": 3}, r"line 2: key 'data_source'.*must be a string"),
    ("{not json", r"line 2: invalid JSON"),
    ([1, 2], r"line 2: expected a JSON object"),
])
def test_each_bad_record_names_file_line_and_key(tmp_path: Path, row, message: str) -> None:
    path = write(tmp_path / "bad.jsonl", [{"prompt": "fine", "label": "x", "meta": {}}, row])
    with pytest.raises(DatasetError, match=message) as err:
        load_records(path, KEYS)
    assert str(path) in str(err.value)


def test_bad_files_and_mappings(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="records file not found"):
        load_records(tmp_path / "none.jsonl", KEYS)
    with pytest.raises(DatasetError, match="unsupported records file extension '.csv'"):
        load_records(write(tmp_path / "d.csv", []), KEYS)
    with pytest.raises(DatasetError, match="holds no records"):
        load_records(write(tmp_path / "e.jsonl", [""]), KEYS)
    with pytest.raises(DatasetError, match="exactly one of data.prompt_key"):
        RecordKeys(prompt_key="a", messages_key="b")
    with pytest.raises(DatasetError, match="exactly one of data.prompt_key"):
        RecordKeys()


@pytest.mark.parametrize(("messages", "message"), [
    ("hello", r"key 'msgs' \(data.messages_key\) must be a non-empty list"),
    ([], r"key .msgs. \(data.messages_key\) must be a non-empty list"),
    ([{"role": "user"}], r"message 0 must be an object with a string 'role' and a 'content'"),
    ([{"role": "user", "content": [{"type": "image", "image": "x.png"}]}],
     r"message 0 content part 0 must be a text part .*only text is supported"),
    ([{"role": "user", "content": 3}], r"message 0 has content of type int"),
    ([{"role": "robot", "content": "x"}], r"message 0 has role 'robot'"),
    ([{"role": "user", "content": " "}], r"every message is empty"),
])
def test_bad_messages(tmp_path: Path, messages, message: str) -> None:
    path = write(tmp_path / "m.jsonl", [{"msgs": messages, "label": "x"}])
    with pytest.raises(DatasetError, match=f"line 1: .*{message}"):
        load_records(path, RecordKeys(messages_key="msgs"))


class ChatTokenizer:
    """The pieces of an HF tokenizer the encoder uses, with a visible chat template."""

    chat_template = "chatml"
    eos_token_id = 0
    eos_token = "<eos>"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_prompts_and_messages_render_through_the_chat_template_without_a_math_system_prompt(tmp_path) -> None:
    encoder = PromptEncoder(ChatTokenizer(), "default")
    chat = Record(None, ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}), "hi")
    assert encoder.render(chat) == "<system>Be brief.<user>Hi?<assistant>"
    assert encoder.render(Record("Hi?", None, "hi")) == "<user>Hi?<assistant>"
    assert chat.question == "Hi?"
    (spec,) = encoder.prompt_specs([(3, chat)])
    assert spec.record is chat and spec.prompt_text == "<system>Be brief.<user>Hi?<assistant>"
    # No chat template: role lines.
    plain = PromptEncoder(None, "none")
    assert plain.render(chat) == "System: Be brief.\nUser: Hi?\nAssistant: "


def test_sft_pairs_of_records_use_the_reference_response() -> None:
    encoder = PromptEncoder(ChatTokenizer(), "default")
    batch = encoder.sft_batch([Record("ab", None, "ba", response="ba")])
    assert batch.tokens[0][batch.prompt_lengths[0]:] == [ord(c) for c in "ba<eos>"]
    with pytest.raises(ValueError, match="set data.response_key"):
        encoder.sft_batch([Record("ab", None, "ba", where="f.jsonl: line 1")])


def test_records_identity_names_content_and_mapping(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", [{"prompt": "a", "label": "b", "meta": {}}])
    first = records_identity(path, KEYS)
    assert first["path"] == str(path.resolve()) and first["key"]["bytes"] == path.stat().st_size
    assert first["key"]["keys"]["prompt_key"] == "prompt" and first["key"]["keys"]["metadata_key"] == "meta"
    json.dumps(first)
    assert records_identity(path, RecordKeys(prompt_key="prompt")) != first
    write(path, [{"prompt": "a", "label": "c", "meta": {}}])
    assert records_identity(path, KEYS)["key"]["sha256"] != first["key"]["sha256"]


def test_validation_of_the_records_mapping_names_each_field(tmp_path: Path) -> None:
    from miles_lite.config import load_config
    from miles_lite.config.validate import ConfigError, validate

    def problems(*overrides: str) -> str:
        with pytest.raises(ConfigError) as err:
            validate(load_config(list(overrides)))
        return str(err.value)

    text = problems("data.source=records", "experiment.warmup=sft")
    assert "data.train_path is not set" in text and "exactly one of data.prompt_key" in text
    assert "set data.response_key" in text
    assert "data.prompt_key apply to data.source=records only" in problems("data.prompt_key=q")
    assert "unknown reward set 'nope'" in problems("rewards.set=nope")


def test_evaluation_sets_and_data_identity_from_the_config(tmp_path: Path) -> None:
    from miles_lite.config import load_config
    from miles_lite.data.identity import data_identity
    from miles_lite.data.problems import load_eval_sets

    train = write(tmp_path / "t.jsonl", [{"p": "a", "label": "b"}, {"p": "c", "label": "d"}])
    dev = write(tmp_path / "d.jsonl", [{"p": "e", "label": "f"}] * 5)
    cfg = load_config(["data.source=records", f"data.train_path={train}", f"data.eval_path={dev}", "data.prompt_key=p",
                       "experiment.eval_size=3", f"+data.eval_sets={{wide: {{path: {dev}, k: 4, temperature: 1.0}}}}"])
    sets = {s.name: s for s in load_eval_sets(cfg.data, cfg.experiment.eval_size)}
    assert set(sets) == {"wide", "held_out"}
    held_out = sets["held_out"]
    assert len(held_out.items) == 3 and held_out.cfg.k == 1 and held_out.cfg.sampling_temperature(1.0) == 0
    assert len(sets["wide"].items) == 5 and sets["wide"].cfg.k == 4
    identity = data_identity(cfg.data)
    assert identity == {"source": "records", **records_identity(train, RecordKeys(prompt_key="p"))}
    assert data_identity(load_config([]).data)["source"] == "synthetic"


class CountingTokenizer(ChatTokenizer):
    renders = 0

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        CountingTokenizer.renders += 1
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


def test_each_record_is_rendered_once_and_drawn_again_unchanged() -> None:
    encoder = PromptEncoder(CountingTokenizer(), "default")
    records = [Record(f"q{i}", None, "x") for i in range(3)]
    first = encoder.prompt_specs(list(enumerate(records)))
    again = encoder.prompt_specs([(2, records[2]), (0, records[0])])
    assert CountingTokenizer.renders == 3
    assert (again[0].prompt_ids, again[0].prompt_text) == (first[2].prompt_ids, first[2].prompt_text)
    assert again[1].record is records[0] and again[1].prompt_index == 0
    # Two records with the same text are two records (hashed by identity): each rendered once.
    twin = Record("q0", None, "x")
    encoder.prompt_specs([(9, twin)])
    assert CountingTokenizer.renders == 4
