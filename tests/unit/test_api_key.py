"""The run's API key: where it comes from, how it is stored, and that it never prints."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from miles_lite.net.api_key import (
    ENV_KEY,
    ENV_KEY_FILE,
    ApiKey,
    ApiKeyError,
    authorization,
    bearer_matches,
    key_from_env,
    new_key,
    read_key_file,
    serving_key,
    write_key_file,
)


def test_fresh_key_lives_in_a_private_directory_and_goes_away() -> None:
    key = ApiKey.for_run(None, env={})
    try:
        assert key.created and len(key.value) >= 40
        assert stat.S_IMODE(key.path.stat().st_mode) == 0o600
        assert stat.S_IMODE(key.path.parent.stat().st_mode) == 0o700
        assert key.path.read_text() == key.value
        assert key.value not in repr(key) and key.value not in str(key)
        assert key.env() == {ENV_KEY_FILE: str(key.path)}
    finally:
        key.close()
    assert not key.path.exists() and not key.path.parent.exists()
    with ApiKey.for_run(None, env={}) as other:
        assert other.value != key.value  # fresh per run


def test_given_key_file_is_used_and_kept(tmp_path: Path) -> None:
    path = write_key_file(tmp_path / "k", "a" * 32)
    key = ApiKey.for_run(str(path), env={ENV_KEY: "b" * 32})  # the config's file wins over the environment
    key.close()
    assert key.value == "a" * 32 and not key.created and path.exists()
    from_env = ApiKey.for_run(None, env={ENV_KEY: "c" * 32})
    try:
        assert from_env.value == "c" * 32 and from_env.path.read_text() == "c" * 32
    finally:
        from_env.close()
    assert key_from_env({ENV_KEY_FILE: str(path), ENV_KEY: "d" * 32}) == "a" * 32
    assert key_from_env({}) is None


def test_bad_key_files_are_refused_naming_the_fix(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.write_text("a" * 32)
    os.chmod(loose, 0o644)
    with pytest.raises(ApiKeyError, match="chmod 600"):
        read_key_file(loose)
    with pytest.raises(ApiKeyError, match="cannot read"):
        read_key_file(tmp_path / "missing")
    with pytest.raises(ApiKeyError, match="at least 16"):
        read_key_file(write_key_file(tmp_path / "short", "abc"))
    with pytest.raises(ApiKeyError, match="whitespace"):
        read_key_file(write_key_file(tmp_path / "spaced", "a" * 20 + " " + "b" * 20))
    assert read_key_file(write_key_file(tmp_path / "newline", "x" * 20 + "\n")) == "x" * 20


def test_bearer_header() -> None:
    key = new_key()
    assert bearer_matches(authorization(key)["Authorization"], key)
    assert bearer_matches(f"bearer {key}", key)
    assert not bearer_matches(None, key) and not bearer_matches(key, key)
    assert not bearer_matches(f"Bearer {new_key()}", key) and not bearer_matches(f"Basic {key}", key)
    assert authorization(None) == {}


def test_serving_key_refuses_open_routable_addresses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KEY, raising=False)
    monkeypatch.setenv(ENV_KEY_FILE, "")  # empty is unset; monkeypatch restores what serving_key writes
    assert serving_key(None, "127.0.0.1", insecure=False) is None
    with pytest.raises(ApiKeyError, match="--api-key-file"):
        serving_key(None, "0.0.0.0", insecure=False)
    assert serving_key(None, "0.0.0.0", insecure=True) is None
    path = write_key_file(tmp_path / "k", "k" * 24)
    assert serving_key(str(path), "0.0.0.0", insecure=False) == "k" * 24
    assert os.environ[ENV_KEY_FILE] == str(path)  # the engine's own processes find it there
