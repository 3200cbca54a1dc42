"""The error every data reader raises for a bad file: missing, unreadable, or holding a malformed record."""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset file is missing, unreadable, or holds a malformed record; the message names the file, the
    line or row and the fix."""
