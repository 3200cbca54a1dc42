"""Stock SGLang servers: the `sglang.launch_server` command line built from `rollout.sglang_args`."""
