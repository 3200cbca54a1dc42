"""What makes a MilesJob's pods work together: the image named once, weight transports that cross pods,
the job's volume, Prometheus annotations (pure rendering and the reconciler's image default)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.reconcile import OperatorConfig, Reconciler
from launcher.render import render
from launcher.spec import SpecError, gpu_variant, uses_gpus

K8S = Path(__file__).resolve().parents[2] / "k8s"


def example(name: str, **spec: Any) -> dict[str, Any]:
    body = yaml.safe_load((K8S / "examples" / name).read_text())
    body["metadata"].update(namespace="ns", uid="u", generation=1)
    body["spec"].update(spec)
    return body


def kinds(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def overrides(objs: list[dict]) -> list[str]:
    return kinds(objs, "ConfigMap")[0]["data"]["overrides"].splitlines()


class RecordingApi:
    def __init__(self) -> None:
        self.patches: list[tuple[str, str, dict]] = []

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict) -> dict:
        self.patches.append((kind, f"{namespace}/{name}", patch))
        # As the server answers: the object as stored, its spec edit counted in metadata.generation.
        return {"metadata": {"name": name, "namespace": namespace, "generation": 2}, "spec": patch["spec"]}


def test_examples_name_no_image_and_the_kustomization_names_it_once():
    for path in (K8S / "examples").glob("*.yaml"):
        assert "image" not in yaml.safe_load(path.read_text())["spec"], path
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (entry,) = kust["images"]
    deployment = yaml.safe_load((K8S / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"].split(":")[0] == entry["name"]
    # The operator learns that image from its own pod.
    assert {e["name"] for e in container["env"]} >= {"POD_NAME", "POD_NAMESPACE"}


def test_operator_writes_its_image_into_jobs_without_one():
    api = RecordingApi()
    rec = Reconciler(api, OperatorConfig(job_image="reg.example/ml:2.0"), logging.getLogger("test"))
    cpu = example("tiny-cpu.yaml")
    stamped = rec.stamp_image(cpu)
    assert stamped["spec"]["image"] == "reg.example/ml:2.0"
    assert stamped["metadata"]["generation"] == 2  # the stored object, which the status's generation follows
    assert api.patches == [("MilesJob", "ns/tiny-cpu", {"spec": {"image": "reg.example/ml:2.0"}})]
    assert rec.stamp_image(example("gsm8k-gpu.yaml"))["spec"]["image"] == "reg.example/ml:2.0-gpu"
    # A job that names its image keeps it; nothing is written.
    assert rec.stamp_image(example("tiny-cpu.yaml", image="mine:1"))["spec"]["image"] == "mine:1"
    assert len(api.patches) == 2
    # Without a default the job must name one.
    bare = Reconciler(api, OperatorConfig(), logging.getLogger("test"))
    with pytest.raises(SpecError, match=r"spec.image: required.*--job-image"):
        render(bare.stamp_image(example("tiny-cpu.yaml")))


def test_gpu_variant_and_which_jobs_need_it():
    assert gpu_variant("ghcr.io/o/miles-lite:0.1.0") == "ghcr.io/o/miles-lite:0.1.0-gpu"
    assert gpu_variant("localhost:5000/miles-lite:1") == "localhost:5000/miles-lite:1-gpu"
    for untagged in ("localhost:5000/miles-lite", "miles-lite@sha256:abc"):
        with pytest.raises(ValueError, match="no tag"):
            gpu_variant(untagged)
    assert uses_gpus({"rollout": {"backend": "sglang"}})
    assert uses_gpus({"rollout": {"backend": "reference"}, "trainer": {"gpusPerReplica": 1}})
    assert not uses_gpus({"rollout": {"backend": "reference"}, "trainer": {"gpusPerReplica": 0}})


def test_outputs_and_checkpoints_on_the_job_volume_and_prometheus_annotations():
    objs = render(example("tiny-cpu.yaml", image="i:1"))
    lines = overrides(objs)
    assert "checkpoint.dir=/checkpoints/checkpoints" in lines and "experiment.output_dir=/checkpoints/outputs" in lines
    (job,) = kinds(objs, "Job")
    ann = job["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9400"
    assert ann["prometheus.io/path"] == "/metrics"
    # Engines mount no checkpoint volume with the distributed transport.
    for pod in kinds(objs, "Pod"):
        assert "checkpoints" not in {v["name"] for v in pod["spec"]["volumes"]}
        assert "POD_IP" not in {e["name"] for e in pod["spec"]["containers"][0]["env"]}


def test_disk_transport_needs_a_shared_volume_which_engines_then_mount():
    with pytest.raises(SpecError, match=r"weight_sync.transport=disk: trainer and engine pods need one shared volume"):
        render(example("tiny-cpu.yaml", image="i:1", overrides=["experiment=tiny_cpu", "weight_sync=disk"]))
    objs = render(example("tiny-cpu.yaml", image="i:1", overrides=["weight_sync.transport=disk"],
                          checkpoint={"volume": {"claimName": "shared"}}))
    assert "weight_sync.disk_dir=/checkpoints/weights" in overrides(objs)
    for pod in kinds(objs, "Pod"):
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == "shared"
        assert {"name": "checkpoints", "mountPath": "/checkpoints"} in pod["spec"]["containers"][0]["volumeMounts"]


def test_transports_that_cannot_cross_pods_are_refused():
    with pytest.raises(SpecError, match=r"weight_sync.transport=ipc: engine pods are not on the trainer's GPUs"):
        render(example("tiny-cpu.yaml", image="i:1", overrides=["weight_sync=ipc"]))
    with pytest.raises(SpecError, match="weight_sync.disk_dir is set by the operator"):
        render(example("tiny-cpu.yaml", image="i:1", overrides=["weight_sync.disk_dir=/x"]))
    # The last choice wins, as in Hydra.
    render(example("tiny-cpu.yaml", image="i:1", overrides=["weight_sync=ipc", "weight_sync=distributed"]))


def test_weight_updates_rendezvous_at_the_trainers_service_address():
    lines = overrides(render(example("tiny-cpu.yaml", image="i:1")))
    assert "cluster.advertise_address=tiny-cpu-trainer-0.tiny-cpu-trainer.ns.svc" in lines
    with pytest.raises(SpecError, match="cluster.advertise_address is set by the operator"):
        render(example("tiny-cpu.yaml", image="i:1", overrides=["cluster.advertise_address=10.0.0.1"]))


def test_gpu_example_pushes_full_tensors_into_stock_sglang():
    lines = overrides(render(example("gsm8k-gpu.yaml", image="i:1-gpu")))
    assert "weight_sync.mode=full" in lines and "weight_sync=distributed" in lines


def _engine_command(objs: list[dict]) -> list[str]:
    return kinds(objs, "Pod")[0]["spec"]["containers"][0]["command"]


def test_lora_adapter_pushes_put_the_adapters_on_a_volume_the_engine_pods_mount():
    # The adapters are files each engine loads: without a volume both roles mount, the job is refused.
    with pytest.raises(SpecError, match=r"trainer.lora.rank=16 pushes each adapter version as a directory the "
                                        r"engine pods load.*spec.checkpoint.volume.claimName.*"
                                        r"weight_sync.lora=tensors.*weight_sync.lora=merged"):
        render(example("tiny-cpu.yaml", image="i:1", overrides=["experiment=tiny_cpu", "trainer.lora.rank=16"]))
    objs = render(example("tiny-cpu.yaml", image="i:1", overrides=["experiment=tiny_cpu", "trainer.lora.rank=16"],
                          checkpoint={"volume": {"claimName": "shared"}}))
    assert "weight_sync.disk_dir=/checkpoints/adapters" in overrides(objs)
    for pod in kinds(objs, "Pod"):
        assert {"name": "checkpoints", "mountPath": "/checkpoints"} in pod["spec"]["containers"][0]["volumeMounts"]
    # The reference engine pods serve adapters of the trainer's rank.
    assert "exec miles-lite engine --host 0.0.0.0 --port 30000 --enable-lora --max-lora-rank 16 " in \
        _engine_command(objs)[2]
    # Merged pushes are full weights through the transport: no volume needed, no LoRA flags.
    merged = render(example("tiny-cpu.yaml", image="i:1",
                            overrides=["trainer.lora.rank=16", "weight_sync.lora=merged"]))
    assert "--enable-lora" not in _engine_command(merged)[2]
    assert not any(line.startswith("weight_sync.disk_dir") for line in overrides(merged))
    # Adapters inside the load requests: no volume needed, the LoRA flags still.
    tensors = render(example("tiny-cpu.yaml", image="i:1",
                             overrides=["trainer.lora.rank=16", "weight_sync.lora=tensors"]))
    assert "--enable-lora --max-lora-rank 16 " in _engine_command(tensors)[2]
    assert not any(line.startswith("weight_sync.disk_dir") for line in overrides(tensors))
    for pod in kinds(tensors, "Pod"):
        assert "checkpoints" not in {v["name"] for v in pod["spec"]["volumes"]}


def test_sglang_engine_pods_get_the_flags_lora_and_routing_replay_need():
    objs = render(example("gsm8k-gpu.yaml", image="i:1-gpu",
                          overrides=["experiment=gsm8k_qwen2.5_0.5b", "trainer.lora.rank=8",
                                     "trainer.lora.targets=[q_proj,v_proj]", "trainer.routing_replay=true"]))
    cmd = _engine_command(objs)
    args = json.loads(cmd[cmd.index("--sglang-args") + 1])
    assert args["enable_lora"] is True and args["max_lora_rank"] == 8 and args["lora_target_modules"] == ["q_proj",
                                                                                                      "v_proj"]
    assert args["enable_return_routed_experts"] is True
    # A flag the user sets wins; one that contradicts the job is refused naming it.
    body = example("gsm8k-gpu.yaml", image="i:1-gpu", overrides=["trainer.routing_replay=true"])
    body["spec"]["rollout"]["sglangArgs"]["enable_return_routed_experts"] = False
    with pytest.raises(SpecError, match=r"sglangArgs.enable_return_routed_experts=False: trainer.routing_replay=true"):
        render(body)
    plain = _engine_command(render(example("gsm8k-gpu.yaml", image="i:1-gpu")))
    assert "enable_return_routed_experts" not in plain[-1] and "enable_lora" not in plain[-1]
