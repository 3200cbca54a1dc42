"""The cyclic garbage collector during a process's start-up.

Importing torch, megatron-core and transformers creates most of a million long-lived objects (modules,
functions, types); while they pile up, the collector's full collections traverse the whole heap again and
again, a fifth of the import time on a 2-core machine. An entry point pauses collection while it starts and,
once started, moves what it holds to the permanent generation (`gc.freeze`), so later full collections skip
the libraries' objects. The cycles that became garbage during the start (about 20,000 small objects: parsed
configuration nodes, import-time closures) are frozen with them unless `settle(collect=True)` frees them first,
which costs one full traversal (0.4-1.8 s on a 2-core machine): worth it where start-up garbage may hold device
memory. Only for a process's own entry point: a library caller keeps its collector as it is (`settle` does
nothing unless `pause` ran).
"""

from __future__ import annotations

import gc


def pause() -> None:
    """Stop automatic collections until `settle` (start of an entry point)."""
    gc.disable()


def settle(collect: bool = False) -> None:
    """After `pause`: (with `collect`, free the start-up garbage first,) freeze what is left and collect
    automatically again. Otherwise nothing."""
    if gc.isenabled():
        return
    if collect:
        gc.collect()
    gc.freeze()
    gc.enable()
