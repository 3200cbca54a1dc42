"""The trainer's rendezvous stores (its process group's and the weight-update group's) listen on the address
the other ranks use, never on every interface (torch's own TCPStore server binds them all); the weight-update
group's listens only while the group forms."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os
from datetime import timedelta
from miles_lite.config.schema import TrainerConfig
from miles_lite.net.ports import free_port
from miles_lite.net.rendezvous import RendezvousServer
from miles_lite.trainer.parallel import init_parallel
from miles_lite.weight_sync.weight_group import init_custom_process_group

def listening(stage):
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, owned by this process
                print(stage, fields[1])

trainer_port, weights_port = free_port("127.0.0.1"), free_port("127.0.0.1")
print("ports", trainer_port, weights_port)
init_parallel(TrainerConfig(), 0, 1, "cpu", f"tcp://127.0.0.1:{trainer_port}")
init_custom_process_group("gloo", "127.0.0.1", weights_port, 0, 1, "weights")
listening("formed")
server = RendezvousServer("127.0.0.1", 0, 2, timedelta(seconds=30))  # a weight-update group's, while forming
print("forming-port", server.port)
listening("forming")
server.close()
listening("closed")
"""


def _endpoint(hex_endpoint: str) -> tuple[str, int]:
    host, port = hex_endpoint.split(":")
    if len(host) == 8:
        return ".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0)), int(port, 16)
    return host, int(port, 16)


def test_rendezvous_stores_listen_on_the_rendezvous_address_only() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    (trainer_port, weights_port), = [(int(f[1]), int(f[2])) for f in lines if f[0] == "ports"]
    (forming_port,) = [int(f[1]) for f in lines if f[0] == "forming-port"]
    stage = {name: [_endpoint(f[1]) for f in lines if f[0] == name] for name in ("formed", "forming", "closed")}
    everywhere = [e for listeners in stage.values() for e in listeners if e[0] in ("0.0.0.0", "0" * 32)]
    assert not everywhere, f"all-interface listeners: {stage}"
    # The trainer's store lives as long as its process group; the formed weight group's store is gone.
    assert ("127.0.0.1", trainer_port) in stage["formed"], stage
    assert weights_port not in [port for _, port in stage["formed"]], stage
    # A forming group's store listens on its address, and only until it is closed.
    assert ("127.0.0.1", forming_port) in stage["forming"], stage
    assert forming_port not in [port for _, port in stage["closed"]], stage
