"""The run layer: one RL run from start to end. `driver` is the step loop; `system` starts the roles (trainer,
engine fleet, weight sync) and stops them; `handoff` moves a colocated GPU between them; `rl_batch` and `warmup`
build the trainer's batches; `outputs` is everything a run writes; `naming` picks the run a start writes (an
unfinished time-stamped run of the same settings is continued); `record`, `lock`, `dir_probe`, `task_check`,
`failure` and `stop` check a run before work, guard it while it runs and end it. This layer may import every
role (trainer, rollout, weight_sync, checkpoint, cluster, engines, observability, evaluation) and every
library; only the command line (`cli`) imports it. It is the one layer below the command line that sees the
whole `MilesConfig`: it hands each role the sections that role reads.
"""
