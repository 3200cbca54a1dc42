"""The trainer's rendezvous stores (its process group's and the weight-update group's) listen on the address
the other ranks use, never on every interface (torch's own TCPStore server binds them all)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os
from miles_lite.config.schema import TrainerConfig
from miles_lite.ports import free_port
from miles_lite.trainer.parallel import init_parallel
from miles_lite.weight_sync.weight_group import init_custom_process_group

init_parallel(TrainerConfig(), 0, 1, "cpu", f"tcp://127.0.0.1:{free_port('127.0.0.1')}")
init_custom_process_group("gloo", "127.0.0.1", free_port('127.0.0.1'), 0, 1, "weights")
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
            print("listen", fields[1])
"""


def _address(hex_addr: str) -> str:
    host = hex_addr.split(":")[0]
    if len(host) == 8:
        return ".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return host


def test_rendezvous_stores_listen_on_the_rendezvous_address_only() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    listening = [_address(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("listen ")]
    assert len(listening) >= 2, proc.stdout  # at least the two stores
    assert listening.count("127.0.0.1") >= 2, listening
    assert not [a for a in listening if a in ("0.0.0.0", "0" * 32)], f"all-interface listeners: {listening}"
