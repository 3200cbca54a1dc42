"""GPU utilisation and memory per role, read from NVML at scrape time.

The collector exists only where `pynvml` (package `nvidia-ml-py`) imports and NVML initialises; on
a CPU machine :func:`nvml_collector` returns None and no GPU series are exported at all, rather than
zeros that would look like idle GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

UTIL_METRIC = "miles_lite_gpu_utilization_ratio"
MEMORY_METRIC = "miles_lite_gpu_memory_used_bytes"
MEMORY_TOTAL_METRIC = "miles_lite_gpu_memory_total_bytes"


def _visible_indices(nvml: Any) -> list[int]:
    """NVML indices of the devices this process may use (CUDA_VISIBLE_DEVICES, by index or UUID)."""
    count = nvml.nvmlDeviceGetCount()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    # Set but empty hides every device from CUDA, so none are this process's.
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    uuids = {}
    for i in range(count):
        uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))
        uuids[uuid.decode() if isinstance(uuid, bytes) else uuid] = i
    out = []
    for item in wanted:
        if item.isdigit() and int(item) < count:
            out.append(int(item))
        else:
            # UUIDs may be given in full ("GPU-8f3c...") or as a unique prefix.
            out.extend(i for u, i in uuids.items() if u.startswith(item))
    return out


class NvmlCollector(Collector):
    """Scrape-time gauges of the visible GPUs, labelled ``run``, ``role`` and ``gpu`` (CUDA ordinal).

    Exports ``miles_lite_gpu_utilization_ratio`` (0..1, NVML's share of the last sample period a
    kernel ran), ``miles_lite_gpu_memory_used_bytes`` and ``miles_lite_gpu_memory_total_bytes``.
    """

    def __init__(self, nvml: Any, run: str, role: str) -> None:
        self._nvml = nvml
        self._run = run
        self._role = role
        # CUDA ordinal (position in CUDA_VISIBLE_DEVICES) -> NVML handle.
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in _visible_indices(nvml)]

    @property
    def num_devices(self) -> int:
        return len(self._handles)

    def collect(self) -> Iterator[Metric]:
        labels = ["run", "role", "gpu"]
        util = GaugeMetricFamily(UTIL_METRIC, "GPU busy share over NVML's last sample period", labels=labels)
        used = GaugeMetricFamily(MEMORY_METRIC, "GPU memory in use (all processes)", labels=labels)
        total = GaugeMetricFamily(MEMORY_TOTAL_METRIC, "GPU memory capacity", labels=labels)
        for ordinal, handle in enumerate(self._handles):
            values = [self._run, self._role, str(ordinal)]
            rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            util.add_metric(values, rates.gpu / 100.0)
            used.add_metric(values, float(mem.used))
            total.add_metric(values, float(mem.total))
        yield util
        yield used
        yield total

    def describe(self) -> Iterator[Metric]:
        # Families without samples: lets the registry check name clashes without touching NVML.
        labels = ["run", "role", "gpu"]
        yield GaugeMetricFamily(UTIL_METRIC, "GPU busy share over NVML's last sample period", labels=labels)
        yield GaugeMetricFamily(MEMORY_METRIC, "GPU memory in use (all processes)", labels=labels)
        yield GaugeMetricFamily(MEMORY_TOTAL_METRIC, "GPU memory capacity", labels=labels)


def nvml_collector(run: str, role: str) -> NvmlCollector | None:
    """An :class:`NvmlCollector`, or None where pynvml is missing, NVML fails or no GPU is visible."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    collector = NvmlCollector(pynvml, run, role)
    return collector if collector.num_devices > 0 else None
