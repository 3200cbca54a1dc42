"""Driver-level CUDA IPC between two processes, the second possibly running another torch build.

The parent (this test's torch) exports a buffer of random bf16 weights with `ExportedBuffer`; a child
process started with `MILES_ENGINE_PYTHONPATH` in front of its path (e.g. SGLang's own torch install)
loads them through `load_ipc_weights` into a module's parameters, as an SGLang TP worker would, writes
one value back through the mapping, and reports checksums and how long the load took. Skipped without
CUDA. Timings are printed as `CUDA_IPC_RESULT {json}` (run with `-s`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_lite.weight_sync.cuda_ipc import ExportedBuffer, encode_request, layout_slots, slot_view
from miles_lite.weight_sync.ipc import serialize_named_tensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import base64, io, json, pickle, sys, time
import torch
from miles_lite.engines.sglang.ipc_loader import load_ipc_weights
payload, shapes = sys.argv[1], json.loads(sys.argv[2])
named = pickle.loads(base64.b64decode(payload))
model = torch.nn.Module()
for name, shape in shapes.items():
    model.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16, device="cuda"),
                                                      requires_grad=False))
named = [(n, t.to("cuda")) for n, t in named]  # what SGLang's _unwrap_tensor does
times = []
for _ in range(5):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    loaded = load_ipc_weights(model, named)
    torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
sums = {n: float(p.double().sum()) for n, p in model.named_parameters()}
print(json.dumps({"torch": torch.__version__, "loaded": loaded, "sums": sums, "load_s": times}))
"""


def test_weights_cross_processes_by_driver_handle() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {"embed": torch.randn(151936, 896, generator=gen, device="cuda").to(torch.bfloat16),
               "qkv": torch.randn(1152, 896, generator=gen, device="cuda").to(torch.bfloat16),
               "norm": torch.randn(896, generator=gen, device="cuda").to(torch.bfloat16)}
    slots, total = layout_slots(list(weights.items()))
    buf = ExportedBuffer(total)
    try:
        assert buf.tensor is not None and buf.tensor.data_ptr() == buf.ptr and len(buf.handle) == 64
        for (_, t), slot in zip(weights.items(), slots, strict=True):
            slot_view(buf.tensor, slot).copy_(t)
        torch.cuda.synchronize()
        payload = serialize_named_tensors(encode_request(buf.handle, total, slots))
        env = dict(os.environ)
        front = os.environ.get("MILES_ENGINE_PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (front, str(REPO), env.get("PYTHONPATH", "")) if p)
        shapes = {n: list(t.shape) for n, t in weights.items()}
        out = subprocess.run([sys.executable, "-c", CHILD, payload, json.dumps(shapes)], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["loaded"] == list(weights)
        for name, t in weights.items():
            assert result["sums"][name] == pytest.approx(float(t.double().sum()), rel=1e-9, abs=1e-6), name
        print("CUDA_IPC_RESULT " + json.dumps({"trainer_torch": torch.__version__, "engine_torch": result["torch"],
                                               "bytes": total, "load_s": result["load_s"]}))
    finally:
        buf.close()

