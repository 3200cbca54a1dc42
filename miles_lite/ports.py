"""Free TCP ports for servers and rendezvous that bind right after asking."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (probe by binding port 0); the caller binds it at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
