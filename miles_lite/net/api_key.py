"""The run's API key: what every engine endpoint and the weight-update group's rendezvous ask of a caller.

A run uses one key. It comes from, in order: `cluster.api_key_file` (a file readable by its owner only),
the `MILES_API_KEY` environment variable (containers: a mounted Secret's file is better, named by
`MILES_API_KEY_FILE`), or a fresh random key written to a private directory outside the run directory,
removed when the run ends. Processes get the key through such a file or their environment, never their
command line (which `ps` shows to every user of the host); `ApiKey` never prints its value.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

ENV_KEY = "MILES_API_KEY"
ENV_KEY_FILE = "MILES_API_KEY_FILE"
# The name of the key file inside a directory that holds one (a mounted Secret, a run's private directory).
KEY_FILE_NAME = "api-key"
# Shortest key accepted: 128 bits of a random key encoded in base64 or hex are 22 or 32 characters.
MIN_KEY_CHARS = 16


class ApiKeyError(ValueError):
    """A key file or variable that cannot be used; the message names it and the fix."""


def new_key() -> str:
    """A fresh random key (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def check_key(key: str, where: str) -> str:
    """`key` stripped of surrounding whitespace, if usable; else ApiKeyError naming `where` it came from."""
    key = key.strip()
    if len(key) < MIN_KEY_CHARS:
        raise ApiKeyError(f"the API key from {where} has {len(key)} characters; use at least {MIN_KEY_CHARS} "
                          "random ones (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    if any(c.isspace() for c in key) or not key.isprintable():
        raise ApiKeyError(f"the API key from {where} holds whitespace or control characters; it travels in an "
                          "HTTP header: use printable characters without spaces")
    return key


def read_key_file(path: str | os.PathLike[str]) -> str:
    """The key stored in `path`; refuses a file that other users may read or write (as ssh does)."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text()
    except OSError as exc:
        raise ApiKeyError(f"cannot read the API key file {str(p)!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ApiKeyError(f"the API key file {str(p)!r} is not a regular file")
    # Files Kubernetes mounts from a Secret are links into a root-owned directory; their mode is the Secret's.
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) and not _mounted_secret(p):
        raise ApiKeyError(f"the API key file {str(p)!r} has mode {stat.S_IMODE(st.st_mode):o}; other users may "
                          f"read it: `chmod 600 {p}`")
    return check_key(text, f"file {str(p)!r}")


def _mounted_secret(path: Path) -> bool:
    """True for a file of a Kubernetes Secret volume with group read (fsGroup): `..data` lives beside it."""
    st = path.stat()
    return (path.parent / "..data").exists() and not st.st_mode & stat.S_IRWXO


def write_key_file(path: str | os.PathLike[str], key: str) -> Path:
    """Create `path` (which must not exist) holding `key`, readable by its owner only; returns the path."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return p


def key_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The key `MILES_API_KEY_FILE` names or `MILES_API_KEY` holds (the file first); None when neither is set."""
    env = os.environ if env is None else env
    if env.get(ENV_KEY_FILE):
        return read_key_file(env[ENV_KEY_FILE])
    if env.get(ENV_KEY):
        return check_key(env[ENV_KEY], f"${ENV_KEY}")
    return None


def serving_key(api_key_file: str | None, host: str, insecure: bool) -> str | None:
    """The key a server asks of callers: `api_key_file`'s, else the environment's; None where that is allowed
    (a loopback `host`, or `insecure`). Raises ApiKeyError naming the fix.

    The file's path is put in this process's environment, so the code it runs for the weight-update group
    (and the processes it starts: TP ranks, SGLang's workers) present the same key."""
    from miles_lite.net.ports import is_loopback

    key = read_key_file(api_key_file) if api_key_file else key_from_env()
    if api_key_file:
        os.environ[ENV_KEY_FILE] = os.path.abspath(api_key_file)
    if key is None and not insecure and not is_loopback(host):
        raise ApiKeyError(f"refusing to serve {host} without an API key: give --api-key-file FILE (mode 0600) or "
                          f"set {ENV_KEY_FILE}/{ENV_KEY}, or pass --insecure to serve it open")
    return key


def authorization(key: str | None) -> dict[str, str]:
    """The HTTP header carrying `key` (none without a key)."""
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def bearer_matches(header: str | None, key: str) -> bool:
    """True when an `Authorization` header value presents `key` (compared in constant time)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def derive(key: str, purpose: str) -> str:
    """A value derived from `key` for one `purpose` (hex HMAC-SHA256): reveals nothing of the key."""
    return hmac.new(key.encode(), purpose.encode(), hashlib.sha256).hexdigest()


class ApiKey:
    """The key of one run and the file holding it (`path`, mode 0600). `close()` removes a key this object
    created, with its private directory; a key it was given stays."""

    def __init__(self, value: str, path: Path, private_dir: Path | None = None) -> None:
        self.value = value
        self.path = path
        self._private_dir = private_dir

    def __repr__(self) -> str:  # never the value: this object reaches logs and tracebacks
        return f"ApiKey(path={str(self.path)!r})"

    @property
    def created(self) -> bool:
        """True when this run made the key (it goes away with the run)."""
        return self._private_dir is not None

    @classmethod
    def for_run(cls, api_key_file: str | None, env: Mapping[str, str] | None = None) -> ApiKey:
        """`cluster.api_key_file`'s key, else the environment's, else a fresh one (see the module docstring)."""
        env = os.environ if env is None else env
        if api_key_file:
            return cls(read_key_file(api_key_file), Path(api_key_file).resolve())
        if env.get(ENV_KEY_FILE):
            return cls(read_key_file(env[ENV_KEY_FILE]), Path(env[ENV_KEY_FILE]).resolve())
        if env.get(ENV_KEY):
            return cls.private(check_key(env[ENV_KEY], f"${ENV_KEY}"))
        return cls.private(new_key())

    @classmethod
    def private(cls, value: str, parent: str | None = None) -> ApiKey:
        """`value` written to a fresh private directory (mode 0700, under `parent` or the temp directory)."""
        directory = Path(tempfile.mkdtemp(prefix="miles-key-", dir=parent))  # mkdtemp makes it 0700
        return cls(value, write_key_file(directory / KEY_FILE_NAME, value), directory)

    def env(self) -> dict[str, str]:
        """The environment a child process on this host finds the key through (the file's path, not the key)."""
        return {ENV_KEY_FILE: str(self.path)}

    def close(self) -> None:
        """Remove the key file and its directory if this object created them (idempotent)."""
        if self._private_dir is not None:
            directory, self._private_dir = self._private_dir, None
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> ApiKey:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
