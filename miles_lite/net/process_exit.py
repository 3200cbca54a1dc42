"""What a process of ours does right before its interpreter shuts down.

A process that imported torch, megatron-core and transformers holds millions of objects the cyclic
garbage collector tracks (module dicts, functions, type objects). Interpreter shutdown runs full
collections over all of them while it clears the modules: 3 s after `import torch`, 5-6 s after
`import megatron.core` on a 2-core machine, paid by the trainer process and by every engine server
(whose stop the trainer waits for). Moving the live objects to the collector's permanent generation
(`gc.freeze`) makes those collections skip them; modules are still cleared and reference-counted
objects still freed, in the same order. Only for a process's own entry point, after its work is done
and its outputs are closed: a caller that goes on running would keep frozen garbage forever.
"""

from __future__ import annotations

import gc


def before_interpreter_exit() -> None:
    """Freeze the collector's view of the heap so that interpreter shutdown does not traverse it."""
    gc.freeze()
