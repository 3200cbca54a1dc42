"""Rendezvous stores that listen only where they must.

torch's `TCPStore` server (what `init_process_group("tcp://host:port")` and SGLang-style custom groups start
on rank 0) listens on every interface whatever host the URL names. Here rank 0 binds the listening socket
itself, to the address the other ranks are told to use (loopback for a local run, the node's address in a
cluster), and hands it to the store.

`tcp_store` hosts a store for as long as the returned object lives (a process group holding it keeps it
listening). `RendezvousServer` is for a store that listens only while a group forms: the group gets a
client of it, and `close` stops the listening however long the group lives.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(backlog, 128))
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Host (rank 0, listening on `host` only) or join the store at `host:port`."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = _listen(host, port, world_size)
    # The store's server takes the descriptor over (and closes it with the store).
    return dist.TCPStore(host, int(sock.getsockname()[1]), world_size, True, timeout, master_listen_fd=sock.detach())


class RendezvousServer:
    """Rank 0's store server for one group formation, listening on `host` only.

    Only the formation code holds this object; every rank, rank 0 included, talks to the store through a
    `client`. `close` drops the one reference to the server's store, whose destructor stops the server:
    the listening socket and every accepted connection close, and a later connect to the port is refused.
    Lifecycle: LISTENING (constructed) -> CLOSED (`close`, idempotent).
    """

    def __init__(self, host: str, port: int, world_size: int, timeout: timedelta) -> None:
        sock = _listen(host, port, world_size)
        self.host = host
        self.port = int(sock.getsockname()[1])
        self.world_size = world_size
        # No worker count: the server does not wait for the ranks here, the formation protocol does.
        self._store: dist.TCPStore | None = dist.TCPStore(
            host, self.port, None, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach())

    @property
    def listening(self) -> bool:
        return self._store is not None

    def client(self, timeout: timedelta) -> dist.TCPStore:
        """A client connection for this process's own rank (the object its process group may keep)."""
        if self._store is None:
            raise RuntimeError(f"rendezvous {self.host}:{self.port} is closed")
        return dist.TCPStore(self.host, self.port, self.world_size, False, timeout)

    def close(self) -> None:
        self._store = None


def store_from_url(init_method: str, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """`tcp_store` for a `tcp://host:port` rendezvous URL."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"rendezvous {init_method!r} is not tcp://host:port")
    return tcp_store(url.hostname, url.port, rank, world_size, timeout)
