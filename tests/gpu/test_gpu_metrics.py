"""NVML GPU metrics on a real NVIDIA GPU (skipped without CUDA or pynvml)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miles_lite.observability import MetricsRegistry, nvml_collector

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def gpu_samples(registry: MetricsRegistry) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(registry.exposition().decode()):
        for s in family.samples:
            if s.name.startswith("miles_lite_gpu_"):
                assert s.labels["run"] == "gpu-run" and s.labels["role"] == "trainer"
                out[(s.name, s.labels["gpu"])] = s.value
    return out


def test_collector_reports_every_visible_gpu() -> None:
    pytest.importorskip("pynvml")
    collector = nvml_collector("gpu-run", "trainer")
    assert collector is not None
    registry = MetricsRegistry("gpu-run", "trainer")
    registry.register_collector(collector)
    block = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda:0")  # 2 GiB held while scraping
    torch.cuda.synchronize()
    got = gpu_samples(registry)
    count = torch.cuda.device_count()
    assert {gpu for _, gpu in got} == {str(i) for i in range(count)}
    assert got[("miles_lite_gpu_memory_used_bytes", "0")] >= block.numel()
    total = got[("miles_lite_gpu_memory_total_bytes", "0")]
    assert total == pytest.approx(torch.cuda.get_device_properties(0).total_memory, rel=0.02)
    for i in range(count):
        assert 0.0 <= got[("miles_lite_gpu_utilization_ratio", str(i))] <= 1.0
    del block


def test_cuda_visible_devices_by_index_and_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    for visible in ("0", uuid, uuid[:12]):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        collector = nvml_collector("gpu-run", "trainer")
        assert collector is not None and collector.num_devices == 1, visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CUDA sees no device: nothing to export
    assert nvml_collector("gpu-run", "trainer") is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    collector = nvml_collector("gpu-run", "trainer")
    assert collector is not None and collector.num_devices == pynvml.nvmlDeviceGetCount()
