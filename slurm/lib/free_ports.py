"""Print N distinct TCP ports that are free on this host right now (one per line).

Ray's agents get explicit ports from this: with port 0 the raylet waits a fixed 15 s for each agent
to report the port it bound, which a loaded node overruns, and the dashboard agent's default 52365
collides when two raylets share a host.
"""

from __future__ import annotations

import socket
import sys


def free_ports(count: int) -> list[int]:
    """`count` distinct ports the kernel handed out for binds on all interfaces (ints, 1024-65535).

    All sockets are held open until every port is chosen, so the ports are distinct; another
    process may still take one before the caller binds it (the window is the caller's start-up).
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit("usage: free_ports.py COUNT")
    print("\n".join(str(p) for p in free_ports(int(sys.argv[1]))))
