"""Records: any records data set (`record_files`: JSON Lines, JSON, Parquet, Arrow, `datasets` folders), one
record a prompt, read through a key mapping.

A record's prompt is the column `data.prompt_key` (a string, or a list of chat messages as in TRL's
conversational data) or the chat messages of `data.messages_key`; a message is `{role, content}` with role
system, developer (rendered as the template renders system), user, assistant or tool, and content a string or
a list of typed text parts (`[{"type": "text", "text": ...}]`, joined). Its label (`data.label_key`) is any
JSON value and is handed to the rewards unchanged, as is every other column; a record may have none
(label-less data), unless a reward needs it (`run.task_check`). Optional columns: metadata
(`data.metadata_key`), the data source (`data.source_key`, default `data_source` when a record has it) and a
reference response (`data.response_key`, the SFT warm-up's target: a string, or for chat records a list of
the messages that follow the prompt, e.g. assistant tool calls and tool results of an agent's trajectory).

Math problems (`gsm8k.MathProblem`) offer the same attributes (`prompt`, `messages`, `label`, `source`,
`columns`, `response`), so the loop handles both alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_lite.data.gsm8k import DatasetError
from miles_lite.data.record_files import read_rows, record_paths
from miles_lite.formats.answer import numeric_label

DEFAULT_SOURCE_COLUMN = "data_source"
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class RecordKeys:
    """The key mapping of `data.*_key`: which column holds what."""

    prompt_key: str | None = None
    messages_key: str | None = None
    label_key: str = "label"
    metadata_key: str | None = None
    source_key: str | None = None
    response_key: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt_key is None) == (self.messages_key is None):
            raise DatasetError("data.source=records needs exactly one of data.prompt_key (a string prompt or chat "
                               "messages) and "
                               "data.messages_key (a list of chat messages); got "
                               f"prompt_key={self.prompt_key!r}, messages_key={self.messages_key!r}")

    @classmethod
    def from_config(cls, data: Any) -> RecordKeys:
        """The mapping of a `DataConfig`."""
        return cls(data.prompt_key, data.messages_key, data.label_key, data.metadata_key, data.source_key,
                   data.response_key)

    def as_dict(self) -> dict[str, str | None]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


# eq=False: a record is one line of a file, compared and hashed by identity (its columns may be lists/dicts).
@dataclass(frozen=True, eq=False)
class Record:
    """One prompt with its label (None: the record has none) and every column of its record (`columns`, by
    the columns' own names). `messages` are the chat messages with each content as one string (typed text
    parts joined); `prompt_value` is the prompt column as written (what TRL hands reward functions)."""

    prompt: str | None
    messages: tuple[Mapping[str, str], ...] | None
    label: Any
    columns: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None
    # The reference response: text, or the messages after the prompt (assistant turns, tool results).
    response: str | tuple[Mapping[str, Any], ...] | None = None
    # "<file>: line N": where the record came from, for error messages.
    where: str = ""
    prompt_value: Any = None

    @property
    def question(self) -> str:
        """The prompt text as shown in tables: the prompt, or the last user message."""
        if self.prompt is not None:
            return self.prompt
        users = [m["content"] for m in self.messages or () if m.get("role") == "user"]
        return users[-1] if users else (self.messages or ({"content": ""},))[-1]["content"]

    @property
    def answer(self) -> float:
        """The label as a number for the math rewards' `answers` (NaN when it is not one)."""
        return numeric_label(self.label)

    @property
    def steps(self) -> tuple[float, ...]:
        return ()


def _content(value: Any, where: str, key: str, i: int) -> str:
    # `key` reads "'col' (data.x_key)" in messages.
    """A message's content as one string: a string, or typed text parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise DatasetError(f"{where}: key {key} message {i} content part {j} must be a text part "
                                   f"{{\"type\": \"text\", \"text\": ...}}, got {part!r:.80}; only text is supported")
            texts.append(part["text"])
        return "".join(texts)
    raise DatasetError(f"{where}: key {key} message {i} has content of type {type(value).__name__}; content is a "
                       "string or a list of text parts")


def _messages(value: Any, where: str, column: str, field_name: str) -> tuple[dict[str, str], ...]:
    key = f"{column!r} ({field_name})"
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: key {key} must be a non-empty list of {{role, content}} messages, got "
                           f"{type(value).__name__}")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DatasetError(f"{where}: key {key} message {i} must be an object with a string 'role' and a "
                               f"'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise DatasetError(f"{where}: key {key} message {i} has role {m['role']!r}; roles: {', '.join(ROLES)}")
        messages.append({"role": m["role"], "content": _content(m["content"], where, key, i)})
    if not any(m["content"].strip() for m in messages):
        raise DatasetError(f"{where}: key {key}: every message is empty; the prompt must say something")
    return tuple(messages)


def _prompt_string(record: dict[str, Any], key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DatasetError(f"{where}: key {key!r} (data.prompt_key) must be a string or a list of {{role, content}} "
                           f"chat messages, got {type(value).__name__}")
    return _string(record, key, where, "data.prompt_key")


def _conversation(value: list[Any], where: str, key: str) -> tuple[dict[str, Any], ...]:
    """A reference response given as messages (data.response_key of a chat record): assistant turns (content,
    tool_calls, reasoning_content) and tool results, ending with an assistant turn."""
    from miles_lite.formats.chat.messages import MessageError, normalize

    for i, m in enumerate(value):
        try:
            if normalize(m, i).role not in ("assistant", "tool"):
                raise MessageError(f"messages[{i}] has role {m.get('role')!r}; a response holds assistant turns and "
                                   "tool results")
        except MessageError as exc:
            raise DatasetError(f"{where}: key {key!r} (data.response_key): {exc}") from None
    if not value or value[-1].get("role") != "assistant":
        raise DatasetError(f"{where}: key {key!r} (data.response_key) must end with an assistant message")
    return tuple(dict(m) for m in value)


def _string(record: dict[str, Any], key: str, where: str, field_name: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DatasetError(f"{where}: key {key!r} ({field_name}) must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DatasetError(f"{where}: key {key!r} ({field_name}) is empty")
    return value


def parse_record(record: Any, keys: RecordKeys, where: str) -> Record:
    """One record through the key mapping; DatasetError naming `where`, the key and the fix."""
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object (one record), got {type(record).__name__}")
    prompt_key = keys.prompt_key or keys.messages_key
    assert prompt_key is not None
    needed = [(prompt_key, "data.prompt_key" if keys.prompt_key else "data.messages_key")]
    needed += [(k, f"data.{n}") for k, n in ((keys.metadata_key, "metadata_key"), (keys.source_key, "source_key"),
                                           (keys.response_key, "response_key")) if k is not None]
    for key, field_name in needed:
        if key not in record:
            raise DatasetError(f"{where}: missing key {key!r} ({field_name}); the record has keys {sorted(record)}; "
                               f"set {field_name} to the column that holds it")
    prompt, messages = None, None
    if keys.messages_key:
        messages = _messages(record[keys.messages_key], where, keys.messages_key, "data.messages_key")
    elif isinstance(record[keys.prompt_key], list):  # TRL's conversational format: the prompt is messages
        messages = _messages(record[keys.prompt_key], where, keys.prompt_key, "data.prompt_key")
    else:
        prompt = _prompt_string(record, keys.prompt_key, where)
    source_key = keys.source_key or (DEFAULT_SOURCE_COLUMN if DEFAULT_SOURCE_COLUMN in record else None)
    source = None
    if source_key is not None:
        source = _string(record, source_key, where, "data.source_key" if keys.source_key else DEFAULT_SOURCE_COLUMN)
    response: Any = None
    if keys.response_key and messages is not None and isinstance(record.get(keys.response_key), list):
        response = _conversation(record[keys.response_key], where, keys.response_key)
    elif keys.response_key:
        response = _string(record, keys.response_key, where, "data.response_key")
    if keys.metadata_key is not None and not isinstance(record[keys.metadata_key], dict):
        raise DatasetError(f"{where}: key {keys.metadata_key!r} (data.metadata_key) must be an object (a dict), "
                           f"got {type(record[keys.metadata_key]).__name__}")
    return Record(prompt, messages, record.get(keys.label_key), dict(record), source, response, where,
                  record[prompt_key])


def load_records(spec: Any, keys: RecordKeys, field_name: str = "data.train_path") -> list[Record]:
    """Every record of the files `spec` names (`record_files.record_paths`: a file, a save_to_disk folder, a
    glob or a list; blank JSON lines skipped).

    Raises:
        DatasetError: a missing file, an unknown format, no records, or a bad record (invalid JSON, a missing
            key, a wrong type, an empty prompt), naming the file, the line or row and the key.
    """
    paths = record_paths(spec, field_name)
    records = [parse_record(row, keys, where) for path in paths for where, row in read_rows(path)]
    if not records:
        shown = paths[0] if len(paths) == 1 else f"{field_name}={spec!r}"
        raise DatasetError(f"{shown}: the file holds no records" if len(paths) == 1 else f"{shown}: no records")
    return records
