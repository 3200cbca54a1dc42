"""What a CPU run's processes skip: megatron-core imported without torch.compile (its fused kernels are off on
CPU), collections paused while an entry point loads its libraries, and the CUDA-to-CPU mode's short path for
torch calls that place nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only paths")


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_trainer_imports_megatron_without_dynamo_and_restores_torch_compile() -> None:
    out = _run(
        "import sys, torch\n"
        "compile_fn = torch.compile\n"
        "import miles_lite.trainer\n"
        "assert 'megatron' not in sys.modules  # armed, not imported: a process that never trains pays nothing\n"
        "import miles_lite.trainer.actor\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions import fused_bias_swiglu\n"
        "print('torch._dynamo' in sys.modules, jit.jit_fuser is jit.noop_decorator, torch.compile is compile_fn,\n"
        "      type(fused_bias_swiglu.bias_swiglu).__name__)\n")
    assert out.split() == ["False", "True", "True", "function"]


def test_an_entry_point_settles_its_heap_once_started_and_a_library_caller_keeps_its_collector() -> None:
    out = _run(
        "import gc\n"
        "from miles_lite.net import startup_heap\n"
        "startup_heap.settle()\n"
        "print(gc.isenabled(), gc.get_freeze_count() == 0)\n"
        "startup_heap.pause()\n"
        "print(gc.isenabled())\n"
        "import weakref\n"
        "class Cycle:\n"
        "    pass\n"
        "c = Cycle(); c.me = c; kept = weakref.ref(c); del c\n"
        "startup_heap.settle()\n"
        "print(gc.isenabled(), gc.get_freeze_count() > 0, gc.collect(), kept() is not None)\n"
        "startup_heap.pause()\n"
        "c = Cycle(); c.me = c; freed = weakref.ref(c); del c\n"
        "startup_heap.settle(collect=True)\n"
        "print(freed() is None)\n")
    # The start-up garbage frozen with the rest (no traversal: a frozen cycle is never examined), or freed first.
    assert out.split() == ["True", "True", "False", "True", "True", "0", "True", "True"]


def test_cuda_placements_go_to_cpu_and_other_calls_run_unchanged() -> None:
    from miles_lite.trainer.cpu_compat import CudaToCpuMode

    x = torch.arange(6.0).reshape(2, 3)
    expected = (x @ x.T).softmax(-1)
    with CudaToCpuMode():
        made = torch.zeros(2, device="cuda")
        moved = torch.ones(2).to("cuda")
        same = x.cuda()
        pinned = torch.empty(2, pin_memory=True)
        name = x.type()
        result = (x @ x.T).softmax(-1)
    assert made.device.type == moved.device.type == "cpu" and same is x and not pinned.is_pinned()
    assert name == "torch.cuda.FloatTensor" and torch.equal(result, expected)
