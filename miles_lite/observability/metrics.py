"""Prometheus metrics of a run: one `MetricsRegistry` per process, labelled with the run and the role.

Every metric is named ``miles_lite_*`` with its unit in the name and carries the labels ``run`` and
``role`` (trainer | rollout | driver). The registry owns its own ``CollectorRegistry`` (never the
process-wide default one), so several registries can live in one process (tests, colocated roles).

The driver hands each finished step to :meth:`MetricsRegistry.publish_step` as one flat dict.
Keys it understands (anything else is ignored here and still reaches the metrics file):

======================================  ==========================================================
stats key                               metric (and how the value is applied)
======================================  ==========================================================
``rollout/tokens_per_second``           ``miles_lite_rollout_tokens_per_second`` (set)
``rollout/generated_tokens``            ``miles_lite_rollout_generated_tokens_total`` (inc)
``rollout/request_latency_seconds``     ``miles_lite_rollout_request_latency_seconds`` (observe each; list) and
                                        ``miles_lite_rollout_request_latency_quantile_seconds{quantile=0.5|0.95}``
                                        (set: the step's own requests)
``rollout/retried_requests``            ``miles_lite_rollout_retried_requests_total`` (inc)
``rollout/dynamic_sampling_rounds``     ``miles_lite_dynamic_sampling_rounds`` (set)
``rollout/stale_dropped``               ``miles_lite_stale_dropped_groups_total`` (inc; async rollouts too old)
``rollout/mixed_version_samples``       ``miles_lite_mixed_version_samples_total`` (inc; tokens of two versions)
``rollout/staleness_mean``              ``miles_lite_staleness_versions{stat="mean"}`` (set, versions behind)
``rollout/staleness_max``               ``miles_lite_staleness_versions{stat="max"}`` (set)
``rollout/agents_failed``               ``miles_lite_agents_dropped_total{reason="failed"}`` (inc; agent slots dropped)
``rollout/agent_timeouts``              ``miles_lite_agents_dropped_total{reason="timeout"}`` (inc)
``rollout/tito_mismatch``               ``miles_lite_session_tito_mismatch_total`` (inc; turns whose stored ids a fresh
                                        tokenisation would change)
``rollout/session_engine_moves``        ``miles_lite_session_engine_moves_total`` (inc; sessions moved to other engines)
``rollout/session_diverged``            ``miles_lite_session_diverged_requests_total`` (inc; requests refused, HTTP 400)
``reward/mean``                         ``miles_lite_reward_mean`` (set)
``reward/std``                          ``miles_lite_reward_std`` (set)
``reward/values/<name>``                ``miles_lite_reward_value{reward=<name>}`` (observe each; list) and
                                        ``miles_lite_reward_function_mean{reward=<name>}`` (set: the step's mean)
``reward/exact_accuracy``               ``miles_lite_exact_accuracy_ratio`` (set, 0..1)
``algo/zero_signal_share``              ``miles_lite_zero_signal_groups_ratio`` (set, 0..1)
``kl/ref_k3``                           ``miles_lite_kl_nats`` (set, nats per token; only with a KL reference)
``entropy``                             ``miles_lite_entropy_nats`` (set, nats per token)
``grad_norm``                           ``miles_lite_grad_norm`` (set, L2 norm before clipping)
``loss/total``                          ``miles_lite_loss`` (set)
``skipped``                             ``miles_lite_nonfinite_skipped_steps_total`` (inc by the value, 0 or 1)
``mismatch/logp_abs_diff_mean``         ``miles_lite_logp_diff_mean_nats`` (set, |train - rollout|)
``mismatch/logp_abs_diff_max``          ``miles_lite_logp_diff_max_nats`` (set)
``mismatch/is_raw_mean``                ``miles_lite_is_ratio_mean{kind="raw"}`` (set)
``mismatch/is_applied_mean``            ``miles_lite_is_ratio_mean{kind="applied"}`` (set)
``mismatch/masked_fraction``            ``miles_lite_is_masked_tokens_ratio`` (set, 0..1)
``time/<phase>_seconds``                ``miles_lite_step_phase_seconds{phase=<phase>}`` (set; phases below)
``weight_version``                      ``miles_lite_weight_version`` (set)
``eval/<measure>``                      ``miles_lite_held_out_accuracy_ratio{measure=<measure>}`` (set; every
                                        ``experiment.eval_every`` steps; measures in ``EVAL_MEASURES``)
``eval/<set>/<measure>``                ``miles_lite_eval_set_value{set=<set>,measure=<measure>}`` (set; an
                                        evaluation set's reward_mean, avg@k, pass@j; also `set_eval_sets`)
``moe/router_agreement``                ``miles_lite_moe_router_agreement_ratio`` (set, 0..1; MoE models)
``moe/layer<i>/load_max_share``         ``miles_lite_moe_expert_load_max_share_ratio{layer=<i>}`` (set)
``moe/load_max_share``                  ``miles_lite_moe_expert_load_max_share_ratio{layer="mean"}`` (set)
``moe/layer<i>/load_cv``                ``miles_lite_moe_expert_load_cv{layer=<i>}`` (set)
``moe/load_cv``                         ``miles_lite_moe_expert_load_cv{layer="mean"}`` (set)
``moe/aux_loss``                        ``miles_lite_moe_aux_loss`` (set; 1.0 when balanced)
======================================  ==========================================================

The trainer-side keys (``entropy``, ``grad_norm``, ``skipped``, ``kl/ref_k3``) are the names the
trainer's ``train_step`` returns, so the driver passes its stats through unchanged.
``publish_step`` also sets ``miles_lite_step``. Events that do not follow the step rhythm have
their own methods: engine states and restarts, weight syncs, checkpoints. Request latencies and
retries come from the rollout manager's per-call stats (`rl_batch.rollout_stats`) through ``publish_step``.
The list keys feed a histogram (distributions over any window) and a per-step gauge: a rate over a window
holds no value once a step outlasts the window, and a 7B step outlasts the dashboard's minute.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector

PREFIX = "miles_lite_"
ROLES = ("trainer", "rollout", "driver")
PHASES = ("generate", "eval", "reward", "logprobs", "train", "sync", "checkpoint")
# Held-out evaluation shares (`experiment.eval_every`), as `EvalResult` names them.
EVAL_MEASURES = ("exact", "exact_format", "right_number_in_solution", "right_number_anywhere")
ENGINE_STATES = ("starting", "healthy", "dead", "replacing", "stale", "sleeping")
TRANSPORTS = ("distributed", "ipc", "ipc_handles", "disk")
IS_KINDS = ("raw", "applied")

# Request latencies of a tiny CPU engine are tens of ms; SGLang requests of long completions minutes.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# The worklog reward set spans 0..5.25; single functions 0..1. No negative bound: prometheus_client
# drops a histogram's `_sum` when its first bucket is negative, and the dashboard's mean needs it
# (negative rewards still count, in the `le="0"` bucket).
REWARD_BUCKETS = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5)
# The per-step latency gauge's quantiles (the dashboard's median and tail).
LATENCY_QUANTILES = (0.5, 0.95)


@dataclass(frozen=True)
class _Scalar:
    """A stats key whose float value is set on (or added to) a gauge/counter child."""

    metric: str
    labels: tuple[tuple[str, str], ...] = ()
    add: bool = False


# stats key -> metric attribute (on MetricsRegistry) and extra label values.
_SCALAR_KEYS: dict[str, _Scalar] = {
    "rollout/tokens_per_second": _Scalar("rollout_tokens_per_second"),
    "rollout/generated_tokens": _Scalar("rollout_generated_tokens", add=True),
    "rollout/retried_requests": _Scalar("retried_requests", add=True),
    "rollout/dynamic_sampling_rounds": _Scalar("dynamic_sampling_rounds"),
    "rollout/stale_dropped": _Scalar("stale_dropped", add=True),
    "rollout/mixed_version_samples": _Scalar("mixed_version_samples", add=True),
    "rollout/staleness_mean": _Scalar("staleness", (("stat", "mean"),)),
    "rollout/staleness_max": _Scalar("staleness", (("stat", "max"),)),
    "rollout/agents_failed": _Scalar("agents_dropped", (("reason", "failed"),), add=True),
    "rollout/agent_timeouts": _Scalar("agents_dropped", (("reason", "timeout"),), add=True),
    "rollout/tito_mismatch": _Scalar("tito_mismatch", add=True),
    "rollout/session_engine_moves": _Scalar("session_engine_moves", add=True),
    "rollout/session_diverged": _Scalar("session_diverged", add=True),
    "reward/mean": _Scalar("reward_mean"),
    "reward/std": _Scalar("reward_std"),
    "reward/exact_accuracy": _Scalar("exact_accuracy"),
    "algo/zero_signal_share": _Scalar("zero_signal_share"),
    "kl/ref_k3": _Scalar("kl"),
    "entropy": _Scalar("entropy"),
    "grad_norm": _Scalar("grad_norm"),
    "loss/total": _Scalar("loss"),
    "skipped": _Scalar("nonfinite_skipped", add=True),
    "mismatch/logp_abs_diff_mean": _Scalar("logp_diff_mean"),
    "mismatch/logp_abs_diff_max": _Scalar("logp_diff_max"),
    "mismatch/is_raw_mean": _Scalar("is_ratio_mean", (("kind", "raw"),)),
    "mismatch/is_applied_mean": _Scalar("is_ratio_mean", (("kind", "applied"),)),
    "mismatch/masked_fraction": _Scalar("is_masked_ratio"),
    "weight_version": _Scalar("weight_version"),
    **{f"eval/{m}": _Scalar("held_out_accuracy", (("measure", m),)) for m in EVAL_MEASURES},
    **{f"time/{p}_seconds": _Scalar("phase_seconds", (("phase", p),)) for p in PHASES},
    "moe/router_agreement": _Scalar("moe_router_agreement"),
    "moe/load_max_share": _Scalar("moe_load_max_share", (("layer", "mean"),)),
    "moe/load_cv": _Scalar("moe_load_cv", (("layer", "mean"),)),
    "moe/aux_loss": _Scalar("moe_aux_loss"),
}
# Per-layer expert load of an MoE model (`trainer/routing.py`): `moe/layer<i>/<measure>` -> metric attribute.
_MOE_LAYER_KEY = re.compile(r"^moe/layer(\d+)/(load_max_share|load_cv)$")
_MOE_LAYER_METRICS = {"load_max_share": "moe_load_max_share", "load_cv": "moe_load_cv"}
_LIST_KEYS = ("rollout/request_latency_seconds",)
REWARD_VALUES_PREFIX = "reward/values/"
STEP_KEYS: tuple[str, ...] = (*_SCALAR_KEYS, *_LIST_KEYS, REWARD_VALUES_PREFIX + "<name>",
                               "moe/layer<i>/load_max_share", "moe/layer<i>/load_cv")


def _as_float(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"stats[{key!r}] must be a number, got {type(value).__name__} ({value!r})")
    return float(value)


def _as_floats(key: str, value: object) -> list[float]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"stats[{key!r}] must be a list of numbers (one per completion/request), "
                        f"got {type(value).__name__}")
    return [_as_float(key, v) for v in value]


def _quantiles(values: list[float], qs: Iterable[float]) -> list[float]:
    """Linearly interpolated quantiles of non-empty `values`."""
    ordered = sorted(values)
    out = []
    for q in qs:
        pos = q * (len(ordered) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return out


class MetricsRegistry:
    """The ``miles_lite_*`` metrics of one process, bound to ``run`` and ``role`` labels.

    Args:
        run: run name (label ``run``); non-empty.
        role: trainer | rollout | driver (label ``role``).
    """

    def __init__(self, run: str, role: str) -> None:
        if not run:
            raise ValueError("MetricsRegistry run must be a non-empty run name (experiment.run_name)")
        if role not in ROLES:
            raise ValueError(f"MetricsRegistry role={role!r} is not one of {ROLES}")
        self.run = run
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        base = ("run", "role")

        def gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(PREFIX + name, doc, [*base, *extra], registry=self.registry)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(PREFIX + name, doc, [*base, *extra], registry=self.registry)

        self.step = gauge("step", "Last completed optimizer step")
        self.held_out_accuracy = gauge("held_out_accuracy_ratio",
                                       "Share of held-out problems solved by greedy decoding at the last evaluation",
                                       "measure")
        self.eval_set_value = gauge("eval_set_value", "An evaluation set's measure at its last evaluation (mean "
                                    "reward, avg@k, pass@j)", "set", "measure")
        self.weight_version = gauge("weight_version", "Weight version the trainer last pushed to the engines")
        self.rollout_tokens_per_second = gauge("rollout_tokens_per_second",
                                               "Generated tokens per second of wall time in the last rollout")
        self.rollout_generated_tokens = counter("rollout_generated_tokens", "Completion tokens generated")
        self.request_latency = Histogram(
            PREFIX + "rollout_request_latency_seconds", "Latency of one generate request to an engine",
            list(base), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.request_latency_quantile = gauge("rollout_request_latency_quantile_seconds",
                                              "Latency quantile of the last step's generate requests", "quantile")
        self.retried_requests = counter("rollout_retried_requests", "Generate requests retried after a failure")
        self.dynamic_sampling_rounds = gauge("dynamic_sampling_rounds",
                                             "Sampling rounds dynamic sampling needed to fill the last batch")
        self.stale_dropped = counter("stale_dropped_groups",
                                     "Rollout groups dropped as more than rollout.max_staleness versions old")
        self.mixed_version_samples = counter("mixed_version_samples",
                                             "Completions whose tokens came from two weight versions")
        self.staleness = gauge("staleness_versions", "Versions a step's samples lag the trainer by", "stat")
        self.agents_dropped = counter("agents_dropped", "Agent slots dropped: the agent failed or timed out", "reason")
        self.tito_mismatch = counter("session_tito_mismatch",
                                     "Agent-session turns whose stored ids a fresh tokenisation would change")
        self.session_engine_moves = counter("session_engine_moves", "Agent sessions moved to another engine")
        self.session_diverged = counter("session_diverged_requests",
                                        "Agent-session requests refused for a history diverging from the session's")
        self.reward_mean = gauge("reward_mean", "Mean total reward of the last step's completions")
        self.reward_std = gauge("reward_std", "Standard deviation of the last step's total rewards")
        self.reward_value = Histogram(
            PREFIX + "reward_value", "Reward of one completion per reward function ('total' = weighted sum)",
            [*base, "reward"], buckets=REWARD_BUCKETS, registry=self.registry)
        self.reward_function_mean = gauge("reward_function_mean",
                                          "Mean reward of the last step's completions per reward function "
                                          "('total' = weighted sum)", "reward")
        self.exact_accuracy = gauge("exact_accuracy_ratio",
                                    "Share of completions with the right answer in the exact format")
        self.zero_signal_share = gauge("zero_signal_groups_ratio",
                                       "Share of groups whose completions all got the same reward")
        self.kl = gauge("kl_nats", "KL(policy || reference) per response token")
        self.entropy = gauge("entropy_nats", "Policy entropy per response token")
        self.grad_norm = gauge("grad_norm", "Global gradient L2 norm before clipping")
        self.loss = gauge("loss", "Total loss of the last optimizer step")
        self.nonfinite_skipped = counter("nonfinite_skipped_steps",
                                         "Optimizer steps skipped: a non-finite loss or gradient, or a diverged update")
        self.logp_diff_mean = gauge("logp_diff_mean_nats",
                                    "Mean |trainer - rollout| log-prob of sampled tokens")
        self.logp_diff_max = gauge("logp_diff_max_nats", "Max |trainer - rollout| log-prob of sampled tokens")
        self.is_ratio_mean = gauge("is_ratio_mean", "Mean importance-sampling ratio, raw or as applied", "kind")
        self.is_masked_ratio = gauge("is_masked_tokens_ratio", "Share of response tokens masked by the IS correction")
        self.phase_seconds = gauge("step_phase_seconds", "Wall time of one phase of the last step", "phase")
        self.sync_seconds = gauge("weight_sync_seconds", "Wall time of the last weight push", "transport")
        self.sync_bytes = counter("weight_sync_bytes", "Bytes of weights pushed to the engines", "transport")
        self.syncs = counter("weight_syncs", "Weight pushes completed", "transport")
        self.probe_logp_diff = gauge("probe_logp_diff_nats",
                                     "Mean |trainer - engine| log-prob on probe sequences after the last push")
        self.ckpt_blocked = gauge("checkpoint_blocked_seconds",
                                  "Training time blocked by the last checkpoint (host snapshot)")
        self.ckpt_flush = gauge("checkpoint_flush_seconds", "Background flush time of the last checkpoint")
        self.ckpt_bytes = gauge("checkpoint_bytes", "Size of the last committed checkpoint")
        self.ckpts = counter("checkpoints", "Checkpoints committed")
        self.ckpt_step = gauge("checkpoint_step", "Step of the newest committed checkpoint")
        self.engines = gauge("engines", "Rollout engines per lifecycle state", "state")
        self.engine_restarts = counter("engine_restarts", "Rollout engines replaced after a failure")
        self.moe_router_agreement = gauge("moe_router_agreement_ratio",
                                          "Share of token-layer top-k expert sets the trainer's router picks as the "
                                          "rollout's did (MoE models)")
        self.moe_load_max_share = gauge("moe_expert_load_max_share_ratio",
                                        "Share of routed tokens taken by the busiest expert, per MoE layer "
                                        "(layer=\"mean\": over layers)", "layer")
        self.moe_load_cv = gauge("moe_expert_load_cv",
                                 "Coefficient of variation of the experts' routed tokens, per MoE layer "
                                 "(layer=\"mean\": over layers)", "layer")
        self.moe_aux_loss = gauge("moe_aux_loss", "Load-balancing loss of the routers (1.0 when balanced)")
        self._extra: list[Collector] = []

    # -- step ---------------------------------------------------------------------------------
    def set_eval_sets(self, stats: Mapping[str, object]) -> None:
        """Set `eval/<set>/<measure>` values (evaluations before and after RL happen outside any step)."""
        for key, value in stats.items():
            _, name, measure = key.split("/", 2)
            self.eval_set_value.labels(self.run, self.role, name, measure).set(_as_float(key, value))

    def publish_step(self, step: int, stats: Mapping[str, object]) -> None:
        """Apply one step's stats dict (keys in the module table; others ignored).

        Args:
            step: the optimizer step just finished (>= 0).
            stats: flat dict; scalar keys hold numbers, list keys hold lists of numbers.

        Raises:
            TypeError: a known key holds a value of the wrong type (the message names the key).
            ValueError: a negative step or a negative value for a counter key.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"publish_step step must be an int >= 0, got {step!r}")
        for key, value in stats.items():
            spec = _SCALAR_KEYS.get(key)
            if spec is not None:
                number = _as_float(key, value)
                child = getattr(self, spec.metric).labels(self.run, self.role, *(v for _, v in spec.labels))
                if spec.add:
                    if number < 0 or math.isnan(number):
                        raise ValueError(f"stats[{key!r}] counts events and must be >= 0, got {number}")
                    child.inc(number)
                else:
                    child.set(number)
            elif key.startswith("eval/") and key.count("/") == 2:
                self.set_eval_sets({key: value})
            elif (moe := _MOE_LAYER_KEY.match(key)) is not None:
                metric = getattr(self, _MOE_LAYER_METRICS[moe.group(2)])
                metric.labels(self.run, self.role, moe.group(1)).set(_as_float(key, value))
            elif key == "rollout/request_latency_seconds":
                latencies = _as_floats(key, value)
                for seconds in latencies:
                    self.request_latency.labels(self.run, self.role).observe(seconds)
                if latencies:
                    for q, seconds in zip(LATENCY_QUANTILES, _quantiles(latencies, LATENCY_QUANTILES), strict=True):
                        self.request_latency_quantile.labels(self.run, self.role, f"{q:g}").set(seconds)
            elif key.startswith(REWARD_VALUES_PREFIX):
                name = key[len(REWARD_VALUES_PREFIX):]
                if not name:
                    raise ValueError(f"stats key {key!r} needs a reward function name after the prefix")
                hist = self.reward_value.labels(self.run, self.role, name)
                rewards = _as_floats(key, value)
                for reward in rewards:
                    hist.observe(reward)
                if rewards:
                    self.reward_function_mean.labels(self.run, self.role, name).set(sum(rewards) / len(rewards))
        self.step.labels(self.run, self.role).set(step)

    # -- events -------------------------------------------------------------------------------
    def set_engine_states(self, counts: Mapping[str, int]) -> None:
        """Engines per lifecycle state; states absent from `counts` are set to 0.

        Raises:
            ValueError: an unknown state name (the fleet's states are ``ENGINE_STATES``).
        """
        unknown = sorted(set(counts) - set(ENGINE_STATES))
        if unknown:
            raise ValueError(f"unknown engine state(s) {unknown}; known states are {ENGINE_STATES}")
        for state in ENGINE_STATES:
            self.engines.labels(self.run, self.role, state).set(counts.get(state, 0))

    def engine_restarted(self, count: int = 1) -> None:
        """`count` dead engines were replaced by new ones (0 still creates the series, at 0)."""
        if count < 0:
            raise ValueError(f"engine_restarted count must be >= 0, got {count}")
        self.engine_restarts.labels(self.run, self.role).inc(count)

    def sync_done(self, transport: str, seconds: float, nbytes: int, version: int,
                  probe_logp_diff: float | None = None) -> None:
        """A weight push finished: wall `seconds`, `nbytes` moved, now at `version`.

        `probe_logp_diff` is the verification's mean per-token |logp diff| (nats), when verified.
        """
        if transport not in TRANSPORTS:
            raise ValueError(f"sync_done transport={transport!r} is not one of {TRANSPORTS}")
        if nbytes < 0:
            raise ValueError(f"sync_done nbytes must be >= 0, got {nbytes}")
        self.sync_seconds.labels(self.run, self.role, transport).set(seconds)
        self.sync_bytes.labels(self.run, self.role, transport).inc(nbytes)
        self.syncs.labels(self.run, self.role, transport).inc()
        self.weight_version.labels(self.run, self.role).set(version)
        if probe_logp_diff is not None:
            self.probe_logp_diff.labels(self.run, self.role).set(probe_logp_diff)

    def checkpoint_blocked(self, seconds: float) -> None:
        """The host snapshot of a checkpoint held training for `seconds`."""
        self.ckpt_blocked.labels(self.run, self.role).set(seconds)

    def checkpoint_step(self, step: int) -> None:
        """The newest committed checkpoint of the run is of `step` (a background save committed, or a resume)."""
        self.ckpt_step.labels(self.run, self.role).set(step)

    def checkpoint_committed(self, flush_seconds: float, nbytes: int, step: int | None = None) -> None:
        """A checkpoint's background flush finished and was committed (`nbytes` on disk, of `step`)."""
        if step is not None:
            self.ckpt_step.labels(self.run, self.role).set(step)
        self.ckpt_flush.labels(self.run, self.role).set(flush_seconds)
        self.ckpt_bytes.labels(self.run, self.role).set(nbytes)
        self.ckpts.labels(self.run, self.role).inc()

    # -- plumbing -----------------------------------------------------------------------------
    def register_collector(self, collector: Collector) -> None:
        """Add a scrape-time collector (e.g. the NVML one of `gpu.py`) to this registry."""
        self.registry.register(collector)
        self._extra.append(collector)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what `/metrics` serves)."""
        return generate_latest(self.registry)

    def metric_names(self) -> list[str]:
        """Family names this registry defines (counters with their ``_total``, histograms as base name)."""
        names = []
        for family in self.registry.collect():
            names.append(family.name + "_total" if family.type == "counter" else family.name)
        return sorted(names)
