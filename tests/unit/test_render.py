"""The pure MilesJob renderer: objects, commands, gangs, validation and determinism."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from launcher.crd_schema import apply_defaults, load_crd, openapi_schema
from launcher.render import CONFIG_HASH_ANNOTATION, HASH_ANNOTATION, render
from launcher.spec import SpecError, parse_job

K8S = Path(__file__).resolve().parents[2] / "k8s"


def example(name: str, **spec_updates: object) -> dict:
    body = yaml.safe_load((K8S / "examples" / name).read_text())
    body["metadata"].update(namespace="research", uid="uid-123", generation=1)
    # The examples leave spec.image to the operator's default (tests/unit/test_pods_together.py).
    body["spec"]["image"] = "registry.example/miles-lite:1.0"
    body["spec"].update(copy.deepcopy(spec_updates))
    return body


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def test_tiny_cpu_renders_every_object_with_owner_and_labels():
    objs = render(example("tiny-cpu.yaml"))
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("ConfigMap", "tiny-cpu-config"), ("NetworkPolicy", "tiny-cpu"), ("Service", "tiny-cpu-trainer"),
        ("Service", "tiny-cpu-rollout"), ("Job", "tiny-cpu-trainer"), ("Pod", "tiny-cpu-rollout-0"),
        ("Pod", "tiny-cpu-rollout-1"),
    ]
    for o in objs:
        assert o["metadata"]["namespace"] == "research"
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "mileslite.dev/v1alpha1", "kind": "MilesJob", "name": "tiny-cpu",
                       "uid": "uid-123", "controller": True, "blockOwnerDeletion": True}
        assert o["metadata"]["labels"]["mileslite.dev/job"] == "tiny-cpu"
        assert len(o["metadata"]["annotations"][HASH_ANNOTATION]) == 16


def test_overrides_user_first_then_deployment_facts():
    (cm,) = by_kind(render(example("tiny-cpu.yaml")), "ConfigMap")
    lines = cm["data"]["overrides"].splitlines()
    assert lines[:3] == ["experiment=tiny_cpu", "trainer=cpu", "experiment.steps=20"]
    urls = ("rollout.engine_urls=['http://tiny-cpu-rollout-0.tiny-cpu-rollout.research.svc:30000',"
            "'http://tiny-cpu-rollout-1.tiny-cpu-rollout.research.svc:30000']")
    for expected in ("rollout.backend=reference", "rollout.engines=2", urls, "rollout.engine_tp=1",
                     "checkpoint.dir=/checkpoints/checkpoints", "checkpoint.interval=10", "checkpoint.resume=auto",
                     "fault_tolerance.max_engine_restarts=3", "observability.metrics_port=9400",
                     "observability.metrics_host=node", "cluster=local"):
        assert expected in lines, expected
    assert not any(line.startswith("model.hf_path") for line in lines)


def test_trainer_job_is_indexed_and_fails_fast():
    objs = render(example("tiny-cpu.yaml"))
    (job,) = by_kind(objs, "Job")
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == \
        ("Indexed", 1, 1, 0)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "tiny-cpu-trainer" and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["command"][:2] == ["bash", "-euc"]
    assert "mapfile -t OVERRIDES < /etc/miles-lite/overrides" in c["command"][2]
    assert 'exec miles-lite train "${OVERRIDES[@]}"' in c["command"][2]
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"config": "/etc/miles-lite", "checkpoints": "/checkpoints",
                      "api-key": "/var/run/miles-lite/api-key", "tmp": "/tmp", "work": "/work"}
    (cm,) = by_kind(objs, "ConfigMap")
    # The pods' config hash covers the overrides less the engine count and URLs (followed at run time).
    kept = [line for line in cm["data"]["overrides"].splitlines()
            if not line.startswith(("rollout.engines=", "rollout.engine_urls="))]
    overrides_hash = hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]
    assert spec["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] == overrides_hash
    assert cm["data"]["engines"].splitlines() == [
        f"http://tiny-cpu-rollout-{i}.tiny-cpu-rollout.research.svc:30000" for i in range(2)]
    assert "rollout.engine_urls_file=/etc/miles-lite/engines" in cm["data"]["overrides"].splitlines()


def test_scaling_engines_changes_no_pod_but_the_ones_added_or_removed():
    body = example("tiny-cpu.yaml")
    two = render(body)
    body["spec"]["rollout"]["engines"] = 3
    three = render(body)
    hashes = [{o["metadata"]["name"]: o["metadata"]["annotations"][HASH_ANNOTATION] for o in x
               if o["kind"] in ("Job", "Pod")} for x in (two, three)]
    assert set(hashes[1]) - set(hashes[0]) == {"tiny-cpu-rollout-2"}
    assert all(hashes[0][name] == hashes[1][name] for name in hashes[0])


def test_reference_engine_pods_have_stable_dns_and_probe():
    pods = by_kind(render(example("tiny-cpu.yaml")), "Pod")
    for i, pod in enumerate(pods):
        spec = pod["spec"]
        assert (spec["hostname"], spec["subdomain"]) == (f"tiny-cpu-rollout-{i}", "tiny-cpu-rollout")
        assert spec["restartPolicy"] == "Never"
        assert pod["metadata"]["labels"]["mileslite.dev/engine-index"] == str(i)
        (c,) = spec["containers"]
        assert "exec miles-lite engine --host 0.0.0.0 --port 30000" in c["command"][2]
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert "nvidia.com/gpu" not in str(c.get("resources"))


def test_gsm8k_gpu_sglang_engines_gpus_and_volcano_gangs():
    objs = render(example("gsm8k-gpu.yaml"))
    groups = {o["metadata"]["name"]: o for o in by_kind(objs, "PodGroup")}
    assert groups["gsm8k-qwen05b-trainer"]["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert groups["gsm8k-qwen05b-trainer"]["spec"] == {"minMember": 1, "queue": "default",
                                                       "minResources": {"nvidia.com/gpu": "2"}}
    assert groups["gsm8k-qwen05b-rollout"]["spec"]["minMember"] == 2
    pod = by_kind(objs, "Pod")[0]
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gsm8k-qwen05b-rollout"
    assert pod["spec"]["schedulerName"] == "volcano"
    c = pod["spec"]["containers"][0]
    assert c["command"] == [
        "miles-lite", "engine", "--backend", "sglang", "--model-path", "/models/Qwen2.5-0.5B-Instruct",
        "--host", "0.0.0.0", "--port", "30000", "--tp", "1", "--sglang-args",
        '{"attention_backend": "triton", "mem_fraction_static": 0.6, "sampling_backend": "pytorch", '
        '"skip_tokenizer_init": true}',
    ]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    (job,) = by_kind(objs, "Job")
    tpl = job["spec"]["template"]
    assert tpl["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gsm8k-qwen05b-trainer"
    assert tpl["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    ckpt = next(v for v in tpl["spec"]["volumes"] if v["name"] == "checkpoints")
    assert ckpt == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "miles-checkpoints"}}
    (cm,) = by_kind(objs, "ConfigMap")
    assert "model.hf_path=/models/Qwen2.5-0.5B-Instruct" in cm["data"]["overrides"].splitlines()


def test_coscheduling_and_kueue_membership():
    objs = render(example("gsm8k-gpu.yaml", gang={"scheduler": "coscheduling", "timeoutSeconds": 120}))
    groups = by_kind(objs, "PodGroup")
    assert {g["apiVersion"] for g in groups} == {"scheduling.x-k8s.io/v1alpha1"}
    assert all(g["spec"]["scheduleTimeoutSeconds"] == 120 for g in groups)
    pod = by_kind(objs, "Pod")[0]
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "gsm8k-qwen05b-rollout"
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"

    objs = render(example("gsm8k-gpu.yaml", gang={"scheduler": "kueue", "queue": "team-a"}))
    assert by_kind(objs, "PodGroup") == []
    (job,) = by_kind(objs, "Job")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "kueue.x-k8s.io/pod-group-name" not in job["spec"]["template"]["metadata"]["labels"]
    pod = by_kind(objs, "Pod")[1]
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "gsm8k-qwen05b-rollout"
    assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
    assert "schedulerName" not in pod["spec"]


def test_multi_replica_trainer_forms_a_ray_cluster():
    objs = render(example("tiny-cpu.yaml", trainer={"replicas": 3}))
    (job,) = by_kind(objs, "Job")
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert "ray start --head --port=6379" in script
    assert "ray start --address=tiny-cpu-trainer-0.tiny-cpu-trainer.research.svc:6379" in script
    assert "ray health-check" in script and "deadline" in script
    trainer_svc = next(o for o in by_kind(objs, "Service") if o["metadata"]["name"] == "tiny-cpu-trainer")
    assert {p["name"] for p in trainer_svc["spec"]["ports"]} == {"metrics", "ray"}
    assert trainer_svc["spec"]["clusterIP"] == "None"
    (cm,) = by_kind(objs, "ConfigMap")
    assert {"cluster=ray", "cluster.ray_address=auto"} <= set(cm["data"]["overrides"].splitlines())


def test_render_is_deterministic_and_hashes_follow_the_spec():
    a, b = render(example("tiny-cpu.yaml")), render(example("tiny-cpu.yaml"))
    assert a == b
    changed = render(example("tiny-cpu.yaml", overrides=["experiment=tiny_cpu", "experiment.steps=40"]))
    h = {o["metadata"]["name"]: o["metadata"]["annotations"][HASH_ANNOTATION] for o in a}
    h2 = {o["metadata"]["name"]: o["metadata"]["annotations"][HASH_ANNOTATION] for o in changed}
    assert h["tiny-cpu-config"] != h2["tiny-cpu-config"]
    jobs = [by_kind(x, "Job")[0]["metadata"]["annotations"][HASH_ANNOTATION] for x in (a, changed)]
    assert jobs[0] != jobs[1]
    svcs = [[s["metadata"]["annotations"][HASH_ANNOTATION] for s in by_kind(x, "Service")] for x in (a, changed)]
    assert svcs[0] == svcs[1]


def test_every_semantic_problem_is_reported_at_once():
    body = example("gsm8k-gpu.yaml")
    body["metadata"]["name"] = "Bad_Name"
    body["spec"]["model"] = {}
    body["spec"]["rollout"]["gpusPerEngine"] = 0
    body["spec"]["gang"] = {"scheduler": "kueue"}
    body["spec"]["metrics"] = {"port": 30000}
    with pytest.raises(SpecError) as err:
        render(body)
    fields = [p.split(":")[0] for p in err.value.problems]
    assert fields == ["metadata.name", "spec.rollout.gpusPerEngine", "spec.model.hfPath", "spec.gang.queue",
                      "spec.metrics.port"]


def test_operator_owned_overrides_and_flags_are_refused():
    with pytest.raises(SpecError, match=r"spec.overrides\[1\]: checkpoint.dir is set by the operator"):
        render(example("tiny-cpu.yaml", overrides=["algo=gspo", "checkpoint.dir=/tmp/x"]))
    with pytest.raises(SpecError, match=r"spec.overrides\[0\]: cluster is set"):
        render(example("tiny-cpu.yaml", overrides=["+cluster=ray"]))
    with pytest.raises(SpecError, match="sglangArgs.port"):
        render(example("gsm8k-gpu.yaml", rollout={"engines": 1, "sglangArgs": {"port": 1234}}))


def test_sglang_engine_command_is_what_miles_lite_engine_parses():
    """The pod's command parses with `miles-lite engine`'s own parser into the SGLang command it execs."""
    import argparse

    from miles_lite.cli.engine import add_arguments, sglang_argv

    body = example("gsm8k-gpu.yaml", rollout={"engines": 1, "gpusPerEngine": 2,
                                             "sglangArgs": {"tp_size": 2, "enable_x": True, "off": False}})
    cmd = by_kind(render(body), "Pod")[0]["spec"]["containers"][0]["command"]
    assert cmd[:3] == ["miles-lite", "engine", "--backend"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(cmd[2:])
    assert (args.backend, args.tp, args.port, args.host) == ("sglang", 2, 30000, "0.0.0.0")
    assert json.loads(args.sglang_args) == {"enable_x": True, "off": False}
    sglang = sglang_argv(args)
    assert sglang[1:3] == ["-m", "miles_lite.engines.sglang.launch"] and "--custom-weight-loader" in sglang
    assert sglang[sglang.index("--tp-size") + 1] == "2" and "--enable-x" in sglang and "--off" not in sglang


def test_engine_tp_from_sglang_args_reaches_the_trainer_config():
    body = example("gsm8k-gpu.yaml", rollout={"engines": 1, "gpusPerEngine": 2, "sglangArgs": {"tp_size": 2}})
    (cm,) = by_kind(render(body), "ConfigMap")
    assert "rollout.engine_tp=2" in cm["data"]["overrides"].splitlines()


def test_crd_defaults_equal_renderer_defaults():
    """A job the API server defaulted renders exactly like the same job before defaulting."""
    schema = openapi_schema(load_crd(K8S / "crd.yaml"))
    minimal = {"apiVersion": "mileslite.dev/v1alpha1", "kind": "MilesJob",
               "metadata": {"name": "m", "namespace": "n", "uid": "u"},
               "spec": {"image": "img", "rollout": {"backend": "reference", "gpusPerEngine": 0}}}
    defaulted = apply_defaults(schema, minimal)
    assert defaulted["spec"]["trainer"]["replicas"] == 1 and defaulted["spec"]["gang"]["scheduler"] == "none"
    assert parse_job(defaulted) == parse_job(minimal)
    assert render(defaulted)[1:] == render(minimal)[1:]  # the ConfigMap records the spec as submitted


def test_pod_fields_the_api_server_refuses_are_named_on_the_milesjob():
    body = example("tiny-cpu.yaml")
    body["spec"].update(image="my image:1", env=[{"name": "1 bad name", "value": "x"}],
                        serviceAccountName="Bad_SA")
    body["spec"]["trainer"]["resources"] = {"requests": {"cpu": "lots", "bad key!": 1}}
    body["spec"]["rollout"]["nodeSelector"] = {"bad key!": "ok", "example.com/pool": "a b"}
    body["spec"]["checkpoint"] = {"volume": {"claimName": "UPPER"}}
    with pytest.raises(SpecError) as err:
        parse_job(body)
    lines = err.value.problems
    fields = sorted(line.split(":")[0] for line in lines)
    assert fields == ["spec.checkpoint.volume.claimName", "spec.env[0].name", "spec.image",
                      "spec.rollout.nodeSelector['bad key!']", "spec.rollout.nodeSelector['example.com/pool']",
                      "spec.serviceAccountName", "spec.trainer.resources.requests['bad key!']",
                      "spec.trainer.resources.requests['cpu']"], lines
    assert any("'lots' must be a quantity such as 2, 500m or 16Gi" in line for line in lines)


@pytest.mark.parametrize("image", ["miles-lite:1.0", "registry.example:5000/team/miles-lite:1.0-gpu",
                                   "localhost/miles-lite@sha256:" + "a" * 64, "ubuntu"])
def test_image_references_the_runtime_parses_are_accepted(image):
    body = example("tiny-cpu.yaml")
    body["spec"]["image"] = image
    assert parse_job(body).image == image
