"""Both trainer roles offer every `TrainerRole` call with the protocol's parameters."""

from __future__ import annotations

import inspect

import pytest

from miles_lite.cluster.local_trainer import LocalTrainer
from miles_lite.cluster.ray_trainer import RayTrainerGroup
from miles_lite.cluster.role import TrainerRole
from miles_lite.weight_sync.senders import ShardSenders, WeightSource


def _calls(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(protocol).items()
            if inspect.isfunction(member) and not name.startswith("_")}


def test_the_protocol_covers_weight_sync_and_checkpoints() -> None:
    calls = set(_calls(TrainerRole)) | set(_calls(WeightSource)) | set(_calls(ShardSenders))
    assert {"train_step", "save_checkpoint", "restore_checkpoint", "finalize_checkpoint", "weight_shards",
            "layouts", "probe_logprobs", "join_weight_group", "send_weight_bucket", "close"} <= calls


@pytest.mark.parametrize("role", [LocalTrainer, RayTrainerGroup])
def test_role_implements_every_call(role: type) -> None:
    for protocol in (TrainerRole, WeightSource, ShardSenders):
        for name, expected in _calls(protocol).items():
            method = getattr(role, name, None)
            assert method is not None, f"{role.__name__} lacks {name}"
            got = inspect.signature(method)
            assert list(got.parameters) == list(expected.parameters), f"{role.__name__}.{name}: {got} vs {expected}"
            defaults = {k: p.default for k, p in expected.parameters.items()}
            assert {k: p.default for k, p in got.parameters.items()} == defaults, f"{role.__name__}.{name} defaults"
