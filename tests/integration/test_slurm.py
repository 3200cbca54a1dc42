"""`sbatch slurm/train.sh` on a real local Slurm: slurmctld, two slurmd fake nodes with fake GPUs, munge.

(a) A heterogeneous job (trainer component on n1, rollout component on n2) runs a very short
    `miles-lite train`, ends COMPLETED with exit code 0 and leaves the run's artifacts; its engine
    ran in the rollout gang, on n2.
(b) A single-allocation job (two parallel job steps on one node) gets SIGUSR1 through
    `scancel --batch`: the driver checkpoints and exits 0, the script requeues the job, and the
    requeued attempt (same job id, same run directory) resumes from that checkpoint; its driver is then
    SIGKILLed (no goodbye): the script requeues the job again, and the third attempt resumes from the
    newest committed checkpoint and completes; each attempt's engine ran on the Ray node of the rollout step.
(c) The rollout component's node loses its slurmd mid-run: the job completes, and every process of the job
    (the Ray node and engine there) ends with it, although the job's end cannot reach that node.

The cluster comes from scripts/slurm-up.sh and goes with scripts/slurm-down.sh. Without the Debian
packages the module is skipped, except in CI (the CI environment variable set), where it installs
them through scripts/install-services.sh or fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from miles_lite.checkpoint.resume import newest_complete

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SLURM_BINARIES = ("sbatch", "scontrol", "scancel", "slurmctld", "slurmd", "munged")
# A run of a few seconds per step: no warm-up, no presampling, one engine, tiny groups and evaluation.
SHORT_RUN = [
    "experiment.warmup=none",
    "data.presample.enabled=false",
    "rollout.engines=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "experiment.eval_size=2",
    "data.synthetic.eval_size=2",
]
JOB_TIMEOUT_S = 420.0


def _have_slurm() -> bool:
    return all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in SLURM_BINARIES)


def _free_port_pair() -> tuple[int, int]:
    """Two free TCP ports: one for slurmctld and the first of two consecutive ones for the slurmd pair."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            if base >= 65000:
                continue
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        with socket.socket() as c:
            c.bind(("127.0.0.1", 0))
            ctld = c.getsockname()[1]
        if ctld not in (base, base + 1):
            return ctld, base
    raise RuntimeError("no two consecutive free TCP ports found on 127.0.0.1")


@dataclass
class SlurmCluster:
    """The local cluster of scripts/slurm-up.sh and the client calls the tests make against it."""

    state: Path
    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(cmd, env=env or self.env, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done.stdout

    def sbatch(self, options: list[str], script: str, overrides: list[str], env: dict[str, str]) -> int:
        """Submit `script` from the repository root; returns the job id."""
        out = self.run("sbatch", "--parsable", *options, script, *overrides, env={**self.env, **env})
        return int(out.strip().split(";")[0].split("+")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` of the job (its first component) as a field -> value mapping."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).splitlines()[0]
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, done: Callable[[dict[str, str]], bool], what: str,
                 timeout_s: float = JOB_TIMEOUT_S, logs: Path | None = None) -> dict[str, str]:
        """Poll `scontrol show job` until `done(fields)`; TimeoutError shows the job and its logs."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job(job_id)
            if done(fields):
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: {what} not reached in {timeout_s:.0f} s; state "
                                   f"{fields.get('JobState')} ({fields.get('Reason')})\n{_tail_logs(logs)}")
            time.sleep(1.0)

    def daemon_log(self, job_id: int, lines: int = 40) -> str:
        """slurmctld/slurmd log lines that mention the job (why Slurm failed a launch)."""
        out = []
        for path in sorted(self.state.rglob("slurm*.log")):
            hits = [ln for ln in path.read_text(errors="replace").splitlines()
                    if re.search(rf"\b(JobId=|job ?){job_id}\b", ln, re.I)]
            out.append(f"--- {path.name}\n" + "\n".join(hits[-lines:]))
        return "\n" + "\n".join(out)


def _tail_logs(logs: Path | None, chars: int = 3000) -> str:
    if logs is None or not logs.is_dir():
        return ""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in sorted(logs.glob("*.log")))


def _finished(fields: dict[str, str]) -> bool:
    return fields.get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    if not _have_slurm():
        if not os.environ.get("CI"):
            pytest.skip("Slurm is not installed (Debian: slurm-wlm slurmctld slurmd slurm-client munge; "
                        "scripts/install-services.sh installs them)")
        subprocess.run(["bash", str(REPO / "scripts/install-services.sh")], check=True, timeout=900)
        assert _have_slurm(), "scripts/install-services.sh ran but the Slurm binaries are still missing"
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the Slurm test needs root (slurmd runs jobs as their user, munged keys)")
        pytest.skip("the Slurm test needs root")
    # munged refuses a socket below a directory that is not world-executable (pytest's tmp is 0700).
    state = Path(tempfile.mkdtemp(prefix="miles-slurm-", dir="/tmp"))
    state.chmod(0o755)
    ctld_port, node_port = _free_port_pair()
    env = {**os.environ, "MILES_SLURM_STATE": str(state), "MILES_SLURM_CTLD_PORT": str(ctld_port),
           "MILES_SLURM_NODE_PORT": str(node_port), "SLURM_CONF": str(state / "etc/slurm.conf")}
    up = subprocess.run(["bash", str(REPO / "scripts/slurm-up.sh")], env=env, capture_output=True, text=True,
                        timeout=120)
    try:
        assert up.returncode == 0, f"slurm-up.sh failed:\n{up.stdout}{up.stderr}"
        cluster = SlurmCluster(state, env)
        nodes = cluster.run("sinfo", "-h", "-N", "-o", "%N %T %G").split("\n")
        assert {line.split()[0] for line in nodes if line} == {"n1", "n2"}
        yield cluster
    finally:
        subprocess.run(["bash", str(REPO / "scripts/slurm-down.sh")], env=env, capture_output=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def job_env(tmp_path: Path) -> dict[str, str]:
    """Environment of a submitted job: its run root, a small Ray, and no host-wide `ray stop`."""
    return {
        "MILES_LITE_RUN_ROOT": str(tmp_path / "runs"),
        # The fake nodes share this host with other programs: `ray stop` would end their Ray too.
        "MILES_SLURM_RAY_STOP": "0",
        "MILES_RAY_OBJECT_STORE_BYTES": str(200 * 1024**2),
        "MILES_RAY_READY_TIMEOUT": "180",
    }


def _submit(slurm: SlurmCluster, job_env: dict[str, str], options: list[str], script: str,
            overrides: list[str]) -> tuple[int, Path]:
    root = Path(job_env["MILES_LITE_RUN_ROOT"])
    root.mkdir(parents=True, exist_ok=True)
    job_id = slurm.sbatch(["--time=10", f"--output={root}/%x-%j.out", *options], script, overrides, job_env)
    return job_id, root / f"miles-lite-{job_id}"


def _assert_engines_on(run_dir: Path, slurm_node: str, attempts: int = 1) -> None:
    """Every engine of the run (one per attempt) ran under `slurm_node`, on a Ray node of the rollout role."""
    placements = [json.loads(line) for line in (run_dir / "logs/engines.jsonl").read_text().splitlines()]
    where = [(p["slurm_node"], p["node_role"]) for p in placements]
    assert where == [(slurm_node, "rollout")] * attempts, placements
    log = (run_dir / "logs/trainer.log").read_text(errors="replace")
    assert f"(Slurm node {slurm_node}), a rollout node" in log.replace("\n", ""), log[-3000:]


def test_hetjob_short_run_completes_with_artifacts(slurm: SlurmCluster, job_env: dict[str, str]) -> None:
    job_id, run_dir = _submit(slurm, job_env, ["--gres=gpu:2"], "slurm/train-hetjob.sh",
                              ["experiment.steps=2", *SHORT_RUN])
    fields = slurm.wait_job(job_id, _finished, "the end of the job", logs=run_dir / "logs")
    batch_log = (run_dir / "logs/slurm.out").read_text(errors="replace")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), batch_log + _tail_logs(run_dir / "logs")

    # Roles as gangs: the head (trainer) on component 0's node, the rollout Ray node on component 1's.
    assert "hetjob: trainer nodes n1 (component 0), rollout nodes n2 (component 1)" in batch_log
    assert re.search(r"wait_ray: 2 nodes alive \(miles_rollout=\d+, miles_trainer=\d+\)", batch_log), batch_log
    for name in ("ray-head.log", "ray-rollout.log", "trainer.log"):
        assert (run_dir / "logs" / name).stat().st_size > 0, name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == 2 and not summary["stopped_by_signal"]
    # The engine ran in the rollout gang: under component 1's node, on the Ray node its rollout step started.
    _assert_engines_on(run_dir, "n2")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002"]
    config = (run_dir / "config.yaml").read_text()
    assert "mode: ray" in config and f"run_name: miles-lite-{job_id}" in config
    # The driver joined the job's Ray cluster instead of starting its own.
    assert re.search(r"ray_address: \S+:" + str(20000 + job_id % 10000), config), config
    # Ray was stopped inside the allocation and its per-job temp dir removed.
    assert not Path(f"/tmp/miles-ray-{job_id}").exists()
    # The run's key lived in the job's private directory (the driver was told its path) and went with the job;
    # the engine asked for it.
    assert "api_key_file: null" in config and not list(Path("/tmp").glob(f"miles-key-{job_id}.*"))
    engine_log = next((run_dir / "logs").glob("reference-*.log"))
    assert "API key required" in engine_log.read_text(errors="replace")


def _driver_pid(job_id: int) -> int | None:
    """Pid of the job's `miles-lite train` process (None while there is none)."""
    wanted = f"SLURM_JOB_ID={job_id}".encode()
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            if len(args) > 2 and args[1].endswith(b"miles-lite") and args[2] == b"train" and \
                    wanted in (proc / "environ").read_bytes().split(b"\0"):
                return int(proc.name)
        except (OSError, ValueError):
            continue
    return None


def _wait_for_step(slurm: SlurmCluster, job_id: int, run_dir: Path, pattern: str, after: int = 0) -> None:
    """Wait until the trainer log, past its first `after` characters, matches `pattern` (a step line)."""
    trainer_log = run_dir / "logs/trainer.log"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (trainer_log.exists() and re.search(pattern, trainer_log.read_text(errors="replace")[after:], re.M)):
        fields = slurm.job(job_id)
        assert not _finished(fields), f"job ended before {pattern}: {fields}\n{_tail_logs(run_dir / 'logs')}"
        assert time.monotonic() < deadline, f"no {pattern} within {JOB_TIMEOUT_S:.0f} s\n{_tail_logs(run_dir / 'logs')}"
        time.sleep(1.0)


def test_usr1_checkpoints_requeues_and_a_killed_driver_requeues_too(slurm: SlurmCluster,
                                                                    job_env: dict[str, str]) -> None:
    # Enough steps that the signal, sent once step 1 is logged, lands mid-run and the second attempt reaches its
    # kill three steps after its resume, even on an idle machine (a step takes about a second there) and when the
    # signal lands late (at step 10 of 16 on a loaded machine, which left the kill too late for the run's end).
    steps = 24
    job_id, run_dir = _submit(slurm, job_env, ["--nodes=1", "--gres=gpu:2"], "slurm/train.sh",
                              [f"experiment.steps={steps}", "checkpoint.interval=2", *SHORT_RUN])
    trainer_log = run_dir / "logs/trainer.log"

    # Signal once the driver is inside its RL loop (its handlers are installed by then).
    _wait_for_step(slurm, job_id, run_dir, r"^step 1/")
    slurm.run("scancel", "--batch", "--signal=USR1", str(job_id))

    # The script requeues the job after the driver's clean stop; Slurm holds a requeued job back for
    # the credential lifetime (cred_expire=10 in the test cluster), then starts it again by itself.
    slurm.wait_job(job_id, lambda f: f.get("Restarts") == "1" and f.get("JobState") == "PENDING",
                   "the requeue", timeout_s=240, logs=run_dir / "logs")
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved and 1 <= saved[-1] < steps, f"checkpoints after the stop: {saved}"
    stopped_at = saved[-1]

    # The second attempt's driver dies without a goodbye (SIGKILL, as the OOM killer ends it) once it has
    # checkpointed after its resume: the script requeues the job again, and the third attempt resumes from
    # the newest committed checkpoint.
    before = len(trainer_log.read_text(errors="replace"))
    _wait_for_step(slurm, job_id, run_dir, rf"^step {stopped_at + 3}/", after=before)
    pid = _driver_pid(job_id)
    assert pid is not None, _tail_logs(run_dir / "logs")
    os.kill(pid, signal.SIGKILL)
    slurm.wait_job(job_id, lambda f: f.get("Restarts") == "2" and f.get("JobState") == "PENDING",
                   "the requeue after the kill", timeout_s=240, logs=run_dir / "logs")
    # The newest committed checkpoint: a save in flight may have committed after the driver's end (its trainer
    # finishes the commit), before `latest` could be read here.
    newest = newest_complete(run_dir / "checkpoints")
    assert newest is not None
    killed_at = int(newest.name.split("_")[1])
    assert killed_at > stopped_at

    fields = slurm.wait_job(job_id, _finished, "the end of the requeued job", logs=run_dir / "logs")
    log = trainer_log.read_text(errors="replace")
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "2"), (
        log[-4000:] + slurm.daemon_log(job_id))
    assert "received SIGUSR1" in log
    attempts = log.split("==== ")
    assert len(attempts) == 4 and [f"attempt {i}" in attempts[i + 1] for i in range(3)] == [True] * 3, log[-4000:]
    # Each attempt resumed where the one before left its newest checkpoint, in the same run directory (the
    # driver's console wraps long lines, so the message is matched with line breaks removed).
    for attempt, step in ((attempts[2], stopped_at), (attempts[3], killed_at)):
        resumed = re.search(r"resumed from\s*(\S+?)\s*at step (\d+)", attempt.replace("\n", ""))
        assert resumed, attempt[-4000:]
        assert int(resumed.group(2)) == step and str(run_dir / "checkpoints") in resumed.group(1)
        assert not re.search(rf"^step {step}/", attempt, re.M)
    assert re.search(rf"^step {steps}/{steps}", attempts[3], re.M)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == steps and not summary["stopped_by_signal"]
    batch_log = (run_dir / "logs/slurm.out").read_text(errors="replace")
    assert "steps: trainer nodes n1" in batch_log and f"requeueing job {job_id} (stopped by SIGUSR1)" in batch_log
    assert f"requeueing job {job_id} (the driver exited with code 137)" in batch_log, batch_log
    # One node, two steps: the engine ran on the Ray node of the rollout step, in every attempt.
    _assert_engines_on(run_dir, "n1", attempts=3)


def _seconds(fields: dict[str, str]) -> float:
    from datetime import datetime

    start, end = (datetime.fromisoformat(fields[k]) for k in ("StartTime", "EndTime"))
    return (end - start).total_seconds()


def test_impossible_placement_and_unknown_key_fail_before_ray(slurm: SlurmCluster, job_env: dict[str, str]) -> None:
    # One node split between the roles (the fake node's 4 GPUs and 2 CPUs, --exclusive): 2 GPUs and 1 CPU
    # each; a tp=2 trainer (a CPU per rank) and 4 engines (a GPU and a CPU each) cannot fit.
    short = [o for o in SHORT_RUN if not o.startswith("rollout.engines=")]
    job_id, run_dir = _submit(slurm, job_env, ["--nodes=1", "--gres=gpu:2"], "slurm/train.sh",
                              ["rollout.engines=4", "trainer.tp=2", *short])
    typo_id, typo_dir = _submit(slurm, job_env, ["--nodes=1", "--gres=gpu:2"], "slurm/train.sh",
                                ["trainer.tpp=2", *SHORT_RUN])
    for jid, rdir in ((job_id, run_dir), (typo_id, typo_dir)):
        fields = slurm.wait_job(jid, _finished, "the end of the job", timeout_s=120, logs=rdir / "logs")
        batch_log = (rdir / "logs/slurm.out").read_text(errors="replace")
        assert fields["JobState"] == "FAILED" and _seconds(fields) < 10, (fields, batch_log)
        assert not (rdir / "logs/ray-head.log").exists(), "Ray was started"
        assert "nothing was started" in batch_log
        if jid == job_id:
            lines = [ln for ln in batch_log.splitlines() if "placement:" in ln]
            assert len(lines) == 2, batch_log  # one line per role: asked vs available
            assert ("the trainer gang (2 bundles) asks CPU 2; the trainer share of the allocation (1 node(s), "
                    "2 GPU(s) and 1 CPU(s) each) has CPU 1 in total") in lines[0], lines[0]
            assert ("the rollout gang (4 bundles) asks CPU 4, GPU 4, miles_rollout 4; the rollout share of the "
                    "allocation (1 node(s), 2 GPU(s) and 1 CPU(s) each) has CPU 1, GPU 2, miles_rollout 2 in total"
                    ) in lines[1], lines[1]
        else:
            assert "unknown key trainer.tpp (trainer has no field 'tpp'); closest known: trainer.tp" in batch_log


def test_driver_error_line_reaches_the_batch_log(slurm: SlurmCluster, job_env: dict[str, str]) -> None:
    # A heterogeneous job's shares are Ray's to check: the trainer gang (tp=2 ranks of 2 GPUs) asks more
    # GPUs than component 0's node has, and fails as soon as it asks, not after the timeout.
    job_id, run_dir = _submit(slurm, job_env, ["--gres=gpu:2"], "slurm/train-hetjob.sh",
                              ["trainer.tp=2", "cluster.trainer_gpus_per_rank=2", "cluster.placement_timeout_s=300",
                               *SHORT_RUN])
    fields = slurm.wait_job(job_id, _finished, "the end of the job", logs=run_dir / "logs")
    batch_log = (run_dir / "logs/slurm.out").read_text(errors="replace")
    assert fields["JobState"] == "FAILED", batch_log
    line = next((ln for ln in batch_log.splitlines() if "driver exited with code" in ln), "")
    assert ("GangDoesNotFit: the trainer gang asks 2 bundles of CPU 1, GPU 2, miles_trainer 1; the cluster's nodes "
            "hold 1 such bundle(s)") in line, batch_log
    # The whole job (Ray's start included) took less than the placement timeout it would have waited.
    assert _seconds(fields) < 300, fields


def _job_processes(job_ids: set[int]) -> list[str]:
    """Processes of this host whose environment names one of `job_ids` (SLURM_JOB_ID): the job's tasks and
    everything they started (Ray, engines), wherever Slurm placed them among the fake nodes."""
    wanted = {f"SLURM_JOB_ID={i}".encode() for i in job_ids}
    steps = tuple(f"slurmstepd: [{i}.".encode() for i in job_ids)  # a step's own daemon (no such variable)
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (set((proc / "environ").read_bytes().split(b"\0")) & wanted
                    or (proc / "cmdline").read_bytes().startswith(steps)) and \
                    (proc / "stat").read_text().split()[2] != "Z":
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name} {command[:160]}")
        except OSError:  # it ended meanwhile
            continue
    return found


def test_a_lost_rollout_node_leaves_no_job_step_behind(slurm: SlurmCluster, job_env: dict[str, str]) -> None:
    # The watchdog of each Ray step polls at short periods here, as the test waits for it.
    env = {**job_env, "MILES_SLURM_WATCH_S": "2", "MILES_RAY_HEAD_LOST_S": "10"}
    job_id, run_dir = _submit(slurm, env, ["--gres=gpu:2"], "slurm/train-hetjob.sh",
                              ["experiment.steps=4", *SHORT_RUN])
    trainer_log = run_dir / "logs/trainer.log"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (trainer_log.exists() and re.search(r"^step 1/", trainer_log.read_text(errors="replace"), re.M)):
        assert not _finished(slurm.job(job_id)), _tail_logs(run_dir / "logs")
        assert time.monotonic() < deadline, f"no RL step within {JOB_TIMEOUT_S:.0f} s\n{_tail_logs(run_dir / 'logs')}"
        time.sleep(1.0)
    # The rollout component's node loses its slurmd: the job's end can no longer reach the step running there.
    slurmd_n2 = slurm.state / "state" / "slurmd-n2.pid"
    os.kill(int(slurmd_n2.read_text()), signal.SIGKILL)
    try:
        fields = slurm.wait_job(job_id, lambda f: f.get("JobState") in {"COMPLETING", "COMPLETED", "FAILED"},
                                "the end of the job", logs=run_dir / "logs")
        ended = time.monotonic()
        batch_log = (run_dir / "logs/slurm.out").read_text(errors="replace")
        assert "exit code 0" in batch_log, (fields, batch_log)
        # Every process of the job, the lost node's Ray and engines included, ends with it.
        ids = {job_id, job_id + 1}
        left = _job_processes(ids)
        while left and time.monotonic() - ended < 90:
            time.sleep(1.0)
            left = _job_processes(ids)
        assert not left, "\n".join(left) + _tail_logs(run_dir / "logs")
        rollout_log = (run_dir / "logs/ray-rollout.log").read_text(errors="replace")
        assert re.search(r"(is no longer running|is gone \(10s\)); stopping this Ray node", rollout_log), rollout_log
        assert "attempt 2/" not in rollout_log, rollout_log  # never restarted against a head that is gone
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps_done"] == 4
    finally:
        # The node comes back (its slurmd restarted) and finishes the job's clean-up; later tests need both nodes.
        subprocess.run(["/usr/sbin/slurmd", "-f", slurm.env["SLURM_CONF"], "-N", "n2"], env=slurm.env, check=True,
                       timeout=60)
        # The lost node's part of the job stays completing until slurmctld gives the node up (SlurmdTimeout,
        # 300 s by default); an administrator's down-and-resume ends it at once.
        slurm.run("scontrol", "update", "nodename=n2", "state=down", "reason=slurmd lost in a test")
        try:
            slurm.run("scontrol", "update", "nodename=n2", "state=resume")
        except RuntimeError as err:
            # ReturnToService=2: the restarted slurmd's registration may return the node before the resume does,
            # and Slurm refuses to resume a node that is no longer down.
            node_state = slurm.run("sinfo", "-h", "-n", "n2", "-o", "%T").strip()
            if "Invalid node state" not in str(err) or node_state.startswith(("down", "drain")):
                raise
        deadline = time.monotonic() + 300
        while slurm.run("sinfo", "-h", "-N", "-o", "%T").split() != ["idle", "idle"]:
            assert time.monotonic() < deadline, slurm.run("sinfo", "-N") + slurm.daemon_log(job_id) + "\n".join(
                _job_processes({job_id, job_id + 1}))
            time.sleep(1.0)
