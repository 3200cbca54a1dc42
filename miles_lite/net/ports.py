"""Addresses and ports: where a process listens and what its peers dial.

Servers and rendezvous of a cluster run bind their node's own address and advertise it; loopback
belongs to `cluster=local` alone. The address of a process is, in order:

1. `cluster.advertise_address` when set (a multi-homed node, a Kubernetes Service name);
2. inside Ray (a driver or an actor), the address its Ray node registered with (`ray start
   --node-ip-address`, or what Ray detected);
3. otherwise the source address of this host's route toward a peer it serves (the engines it
   attaches to), which is the address that peer reaches it at.

Ports come from the node that listens: `free_port(address)` binds there.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

# cluster=local: every role on this machine, reached over loopback (the one place the project spells it).
LOCAL_HOST = "127.0.0.1"


class AddressError(RuntimeError):
    """No routable address could be determined; the message names the setting that fixes it."""


def free_port(host: str) -> int:
    """A TCP port free on `host` a moment ago (bind port 0 there); the caller binds it at once.

    `host` "" probes all interfaces, as a rendezvous server (torch's TCPStore) binds them.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """True for a loopback IP literal or a name that resolves to one."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def ray_node_address() -> str | None:
    """The address of the Ray node this process runs on (None outside a Ray driver or worker)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return str(ray.util.get_node_ip_address())


def route_address(peer: str) -> str:
    """The local address this host uses to reach `peer` (host name or IP); no packet is sent.

    A UDP `connect` only selects the route: the socket's own address is then the one `peer` sees.
    """
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return str(s.getsockname()[0])
    except OSError as exc:
        raise AddressError(f"no route from this host to {peer!r} ({exc}); set cluster.advertise_address to the "
                           "address the engines reach this host at") from exc


def url_host(url: str) -> str:
    """The host part of an http(s) URL (`http://10.0.0.5:30000` -> `10.0.0.5`)."""
    host = urlsplit(url if "://" in url else f"http://{url}").hostname
    if not host:
        raise ValueError(f"{url!r} has no host; engine URLs look like http://HOST:PORT")
    return host


def node_address(advertise: str | None = None, peers: Sequence[str] = (), fallback: str | None = None) -> str:
    """This process's routable address: `advertise`, else its Ray node's, else its route to `peers[0]`,
    else `fallback` (`LOCAL_HOST` for a single-machine run).

    Raises `AddressError` when none applies.
    """
    if advertise:
        return advertise
    address = ray_node_address()
    if address:
        return address
    if peers:
        return route_address(peers[0])
    if fallback:
        return fallback
    raise AddressError("cannot tell which address other hosts reach this process at (not inside Ray, no "
                       "engine to route to); set cluster.advertise_address")
