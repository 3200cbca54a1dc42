"""The Kubernetes API server's rules for the pod fields a MilesJob passes through, checked before anything
is created, so that a bad value is reported on the MilesJob field that holds it instead of as a refused
Pod or Job (the server's rules: k8s.io/apimachinery validation and resource.Quantity's grammar).

Each check returns None for a good value, else a short reason ("must be ...").
"""

from __future__ import annotations

import re

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# Environment variable names as the API server of Kubernetes 1.20-1.33 accepts them.
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# resource.Quantity: a signed decimal number with an optional binary, decimal or exponent suffix.
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?\d+)?$")
# An image reference as container runtimes parse it: [registry[:port]/]path[:tag][@digest].
_IMAGE = re.compile(
    r"^(?:(?:[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*(?::\d+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)


def qualified_name(key: str) -> str | None:
    """A label key, annotation key, toleration key or resource name: [prefix/]name."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return "must have a DNS subdomain prefix (lower-case a-z, 0-9, '-', '.') before '/'"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return ("must be a name of at most 63 characters (a-z, A-Z, 0-9, '-', '_', '.', starting and ending "
                "with a letter or digit), optionally prefixed by a DNS subdomain and '/'")
    return None


def label_value(value: str) -> str | None:
    """A label value (node selectors match node labels)."""
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        return ("must be at most 63 characters (a-z, A-Z, 0-9, '-', '_', '.', starting and ending with a letter "
                "or digit), or empty")
    return None


def env_name(name: str) -> str | None:
    """An environment variable name."""
    if not _ENV_NAME.match(name):
        return "must consist of letters, digits, '_', '-' or '.', and must not start with a digit (e.g. MY_VAR)"
    return None


def quantity(value: object) -> str | None:
    """A resource quantity: an integer, or a string such as 500m, 2, 1.5, 16Gi, 1e3."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return "must be a quantity such as 2, 500m or 16Gi"
    if isinstance(value, int):
        return None if value >= 0 else "must not be negative"
    if not _QUANTITY.match(value):
        return "must be a quantity such as 2, 500m or 16Gi"
    if value.startswith("-"):
        return "must not be negative"
    return None


def image_reference(image: str) -> str | None:
    """A container image reference."""
    if image != image.strip() or not _IMAGE.match(image):
        return ("must be an image reference [registry[:port]/]name[:tag][@digest] without spaces "
                "(lower-case repository path)")
    return None
