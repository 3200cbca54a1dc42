"""The cyclic garbage collector during a process's start-up.

Importing torch, megatron-core and transformers creates millions of long-lived objects (modules, functions,
types); while they pile up, the collector's full collections traverse the whole heap again and again, a
fifth of the import time on a 2-core machine. An entry point pauses collection while it starts and, once
started, collects once (start-up garbage is freed as before) and moves what survives to the permanent
generation (`gc.freeze`), so later full collections skip the libraries' objects. Only for a process's own
entry point: a library caller keeps its collector as it is (`settle` does nothing unless `pause` ran).
"""

from __future__ import annotations

import gc


def pause() -> None:
    """Stop automatic collections until `settle` (start of an entry point)."""
    gc.disable()


def settle() -> None:
    """After `pause`: collect once, freeze the survivors, collect automatically again. Otherwise nothing."""
    if gc.isenabled():
        return
    gc.collect()
    gc.freeze()
    gc.enable()
