"""`UpdateGuard`: Adam's step bound holds for any gradients, the ordinary step takes no snapshot, and an undone
step leaves parameters, optimizer state and counters exactly as they were."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from miles_lite.trainer.guard import UpdateGuard, adam_element_bound, all_finite


class Leaf(SimpleNamespace):
    """A Megatron optimizer as the guard sees it: a torch optimizer and the main -> model params copy."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer=optimizer, copies=0)

    def _copy_main_params_to_model_params(self) -> None:
        self.copies += 1


class FusedAdam(torch.optim.Optimizer):
    """Adam counting steps per param group, as the fused Adams of TransformerEngine/apex do."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "bias_correction": True})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            t = group["step"]
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt().add_(group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** t))


def _params(seed: int = 0, scale: float = 0.02) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g) * scale) for shape in ((64, 32), (32,), (16, 8, 4))]


def _grads(params: list[torch.nn.Parameter], step: int, kind: str) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        if kind == "constant":  # the worst case for |m_hat / sqrt(v_hat)|: every gradient alike
            p.grad = torch.full_like(p, 0.3)
        elif kind == "spike":  # long quiet, then a large gradient
            p.grad = torch.full_like(p, 1e-6 if step < 15 else 50.0)
        elif kind == "sparse":
            p.grad = torch.randn(p.shape, generator=g) * (torch.rand(p.shape, generator=g) < 0.1)
        else:
            p.grad = torch.randn(p.shape, generator=g).pow(3)  # heavy tails


def _ratio(before: list[torch.Tensor], params: list[torch.nn.Parameter]) -> float:
    pairs = zip(params, before, strict=True)
    delta = math.sqrt(sum(float((p.detach().double() - b.double()).square().sum()) for p, b in pairs))
    weight = math.sqrt(sum(float(b.double().square().sum()) for b in before))
    return delta / weight


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.5, 0.9), amsgrad=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.99, 0.95)),  # b1^2 > b2: a growing series
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.0, 0.999), foreach=True),
    lambda ps: FusedAdam(ps, lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1),
], ids=["adamw", "adam-l2", "amsgrad", "b1sq-over-b2", "no-momentum", "fused"])
@pytest.mark.parametrize("kind", ["constant", "spike", "sparse", "heavy"])
def test_the_bound_holds_for_any_gradients(make, kind: str) -> None:
    params = _params()
    opt = make(params)
    guard = UpdateGuard(Leaf(opt), max_ratio=10.0)  # above every bound here: never a snapshot
    for step in range(30):
        _grads(params, step, kind)
        before = [p.detach().clone() for p in params]
        bound = guard.prepare()
        opt.step()
        check = guard.check()
        assert check.ratio is None and not check.diverged and check.bound == bound
        assert _ratio(before, params) <= bound, (step, _ratio(before, params), bound)
    assert guard.snapshots_taken == 0


def test_constant_gradients_reach_the_element_bound() -> None:
    # The bound is tight: with one gradient repeated, |m_hat / sqrt(v_hat)| is exactly 1 at every step, and
    # the bound at step 1 is 1 too.
    assert adam_element_bound(0.9, 0.98, 1) == pytest.approx(1.0)
    for step in (2, 10, 100, 10_000):
        assert adam_element_bound(0.9, 0.98, step) >= 1.0
    assert adam_element_bound(0.9, 0.0, 3) == math.inf
    assert adam_element_bound(0.0, 0.0, 3) == 1.0
    assert adam_element_bound(0.999, 0.5, 10_000) == math.inf
    with pytest.raises(ValueError, match="step must be >= 1"):
        adam_element_bound(0.9, 0.98, 0)


def test_an_ordinary_step_takes_no_snapshot() -> None:
    # Training's learning rates: the bound is orders of magnitude under the default limit.
    params = _params(scale=0.02)
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.98), weight_decay=0.1)
    guard = UpdateGuard(Leaf(opt), max_ratio=0.5)
    for step in range(20):
        _grads(params, step, "heavy")
        assert guard.prepare() < 0.5 * 1e-2
        opt.step()
        assert guard.check().ratio is None
    assert guard.snapshots_taken == 0
    with pytest.raises(RuntimeError, match="no snapshot to restore"):
        guard.restore()


def _state_copy(opt: torch.optim.Optimizer) -> tuple[list, list]:
    state = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
             for g in opt.param_groups for p in g["params"]]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, groups


def _assert_identical(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_identical(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_identical(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.1),
], ids=["adamw", "fused"])
@pytest.mark.parametrize("host_snapshot", [False, True])
def test_a_diverged_step_is_undone_exactly(make, host_snapshot: bool) -> None:
    params = _params()
    opt = make(params)
    leaf = Leaf(opt)
    guard = UpdateGuard(leaf, max_ratio=0.5, host_snapshot=host_snapshot)
    for step in range(3):  # some ordinary steps first: there is state to restore
        _grads(params, step, "heavy")
        guard.prepare()
        opt.step()
        assert not guard.check().diverged
    weights = [p.detach().clone() for p in params]
    state, groups = _state_copy(opt)
    for g in opt.param_groups:
        g["lr"] = 1e3  # a learning rate off by orders of magnitude
    groups = [{**g, "lr": 1e3} for g in groups]
    _grads(params, 3, "heavy")
    assert guard.prepare() > 0.5
    opt.step()
    check = guard.check()
    assert check.diverged and check.ratio > 0.5 and check.ratio <= check.bound
    assert check.ratio == pytest.approx(_ratio(weights, params), rel=1e-5)
    guard.restore()
    _assert_identical([p.detach() for p in params], weights)
    _assert_identical(_state_copy(opt), (state, groups))
    assert leaf.copies == 1  # the model's copies of the weights follow
    # The next step continues as if the undone one had never been taken.
    for g in opt.param_groups:
        g["lr"] = 1e-3
    twin = [torch.nn.Parameter(w.clone()) for w in weights]
    twin_opt = make(twin)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # not sharing the moment tensors
    _grads(params, 4, "heavy")
    _grads(twin, 4, "heavy")
    opt.step()
    twin_opt.step()
    _assert_identical([p.detach() for p in params], [p.detach() for p in twin])


def test_a_first_step_undone_leaves_no_state() -> None:
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e3)
    guard = UpdateGuard(Leaf(opt), max_ratio=0.5)
    weights = [p.detach().clone() for p in params]
    _grads(params, 0, "heavy")
    guard.prepare()
    opt.step()
    assert guard.check().diverged
    guard.restore()
    assert not opt.state
    _assert_identical([p.detach() for p in params], weights)


def test_another_optimizer_is_measured_exactly() -> None:
    # No bound for SGD: every step is snapshotted and measured (in fp32).
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    guard = UpdateGuard(Leaf(opt), max_ratio=0.5)
    for step in range(3):
        _grads(params, step, "heavy")
        before = [p.detach().clone() for p in params]
        assert guard.prepare() == math.inf
        opt.step()
        check = guard.check()
        assert check.ratio == pytest.approx(_ratio(before, params), rel=1e-5)
    assert guard.snapshots_taken == 3


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="trainer.max_update_ratio=0 must be > 0"):
        UpdateGuard(Leaf(torch.optim.SGD(_params(), lr=0.1)), max_ratio=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_finds_one_bad_element_in_any_buffer(dtype: torch.dtype, bad: float) -> None:
    buffers = [torch.randn(64, dtype=dtype), torch.zeros(0, dtype=dtype), torch.randn(1000, dtype=dtype)]
    assert bool(all_finite(buffers))
    for where in (0, 517, 999):
        buffers[2][where] = bad
        assert not bool(all_finite(buffers)), (dtype, bad, where)
        buffers[2][where] = 0.0
    # Mixed precisions (an fp32 and a bf16 gradient buffer) in one call; no tensors at all count as finite.
    assert bool(all_finite([torch.ones(3), torch.ones(3, dtype=torch.bfloat16)]))
    assert bool(all_finite([]))


def _counting_measure(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from miles_lite.trainer import guard as guard_module

    calls: list[int] = []
    measure = guard_module._GroupNorms.measure

    def counted(groups, layout):
        calls.append(1)
        return measure(groups, layout)

    monkeypatch.setattr(guard_module._GroupNorms, "measure", staticmethod(counted))
    return calls


def test_the_weights_norms_are_measured_every_50_steps_and_carried_in_between(monkeypatch) -> None:
    """No device work and no host sync in an ordinary step's bound between measurements; the carried bound still
    holds, and stays within 1% of the bound from measured norms."""
    calls = _counting_measure(monkeypatch)
    params = _params()
    opt = FusedAdam(params, lr=1e-7, betas=(0.9, 0.98), weight_decay=0.1)
    guard = UpdateGuard(Leaf(opt), max_ratio=0.5)
    for step in range(120):
        _grads(params, step, "heavy")
        before = [p.detach().clone() for p in params]
        bound = guard.prepare()
        fresh_bound = UpdateGuard(Leaf(opt), max_ratio=0.5).prepare()  # from norms measured now
        assert fresh_bound <= bound <= fresh_bound * 1.01, step
        opt.step()
        assert not guard.check().diverged
        assert _ratio(before, params) <= bound
    # Measured at steps 0, 50 and 100 (the fresh guards measured once each: 120 more).
    assert len(calls) == 3 + 120
    assert guard.snapshots_taken == 0


def test_a_carried_bound_over_the_limit_is_measured_before_any_snapshot(monkeypatch) -> None:
    params = _params()
    opt = FusedAdam(params, lr=1e-4, betas=(0.9, 0.98))
    guard = UpdateGuard(Leaf(opt), max_ratio=0.5)
    for step in range(20):  # the carried range widens a little every step
        _grads(params, step, "heavy")
        guard.prepare()
        opt.step()
    _grads(params, 20, "heavy")
    exact = UpdateGuard(Leaf(opt), max_ratio=0.5).prepare()
    calls = _counting_measure(monkeypatch)
    guard.max_ratio = exact * 1.001  # above the bound from measured norms, below the carried one
    assert guard.prepare() == pytest.approx(exact)
    assert len(calls) == 1 and guard.snapshots_taken == 0


def test_a_restore_of_the_weights_is_measured_again(monkeypatch) -> None:
    params = _params()
    opt = FusedAdam(params, lr=1e-7)
    guard = UpdateGuard(Leaf(opt), max_ratio=0.5)
    _grads(params, 0, "heavy")
    guard.prepare()
    opt.step()
    with torch.no_grad():
        for p in params:
            p.mul_(10.0)  # a checkpoint restore writes other weights
    calls = _counting_measure(monkeypatch)
    guard.prepare()
    assert not calls  # carried: the guard cannot see the write
    guard.invalidate()  # what the trainer's checkpoint restore calls
    bound = guard.prepare()
    assert len(calls) == 1 and bound == pytest.approx(UpdateGuard(Leaf(opt), max_ratio=0.5).prepare())
