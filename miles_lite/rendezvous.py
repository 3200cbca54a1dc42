"""Rendezvous stores that listen only where they must.

torch's `TCPStore` server (what `init_process_group("tcp://host:port")` and SGLang-style custom groups start
on rank 0) listens on every interface whatever host the URL names. Here rank 0 binds the listening socket
itself, to the address the other ranks are told to use (loopback for a local run, the node's address in a
cluster), and hands it to the store.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist


def tcp_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Host (rank 0, listening on `host` only) or join the store at `host:port`."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(world_size, 128))
    except BaseException:
        sock.close()
        raise
    # The store's server takes the descriptor over (and closes it with the store).
    return dist.TCPStore(host, int(sock.getsockname()[1]), world_size, True, timeout, master_listen_fd=sock.detach())


def store_from_url(init_method: str, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """`tcp_store` for a `tcp://host:port` rendezvous URL."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"rendezvous {init_method!r} is not tcp://host:port")
    return tcp_store(url.hostname, url.port, rank, world_size, timeout)
