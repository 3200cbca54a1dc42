"""`rollout.sglang_args` -> `sglang.launch_server` flags, and `rollout.reference_args` -> reference engine flags."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from miles_lite.cli.engine import add_arguments, sglang_argv
from miles_lite.config.schema import RolloutConfig
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.engines.reference.engine import add_reference_arguments, build_reference_command, reference_flags
from miles_lite.engines.sglang.command import (
    build_sglang_command,
    check_sglang_command,
    for_installed_sglang,
    sglang_flag_args,
    sglang_importable,
)


def _sglang_like_parser() -> argparse.ArgumentParser:
    """A few flags declared exactly as SGLang 0.5.10's server_args.py declares them."""
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--attention-backend", type=str)
    p.add_argument("--cuda-graph-bs", type=int, nargs="+")
    p.add_argument("--custom-weight-loader", type=str, nargs="*", default=None)
    p.add_argument("--preferred-sampling-params", type=json.loads)
    p.add_argument("--experts-shared-outer-loras", action=argparse.BooleanOptionalAction)
    p.add_argument("--base-gpu-id", type=int, default=0)
    return p


def test_scalars_and_booleans() -> None:
    argv = sglang_flag_args({"skip_tokenizer_init": True, "disable_cuda_graph": False,
                             "mem_fraction_static": 0.6, "attention_backend": "triton", "base_gpu_id": 2})
    assert argv == ["--skip-tokenizer-init", "--mem-fraction-static", "0.6", "--attention-backend", "triton",
                    "--base-gpu-id", "2"]


def test_dashed_keys_are_accepted() -> None:
    assert sglang_flag_args({"mem-fraction-static": 0.5}) == ["--mem-fraction-static", "0.5"]


def test_none_and_empty_list_are_omitted() -> None:
    assert sglang_flag_args({"attention_backend": None, "cuda_graph_bs": []}) == []


def test_lists_give_one_flag_with_all_values() -> None:
    assert sglang_flag_args({"cuda_graph_bs": [1, 2, 4], "custom_weight_loader": ("pkg.mod.fn",)}) == [
        "--cuda-graph-bs", "1", "2", "4", "--custom-weight-loader", "pkg.mod.fn"]


def test_dicts_become_json() -> None:
    argv = sglang_flag_args({"preferred_sampling_params": {"temperature": 0.5, "top_k": 3}})
    assert argv[0] == "--preferred-sampling-params"
    assert json.loads(argv[1]) == {"temperature": 0.5, "top_k": 3}


def test_boolean_optional_flags_get_no_prefix() -> None:
    assert sglang_flag_args({"experts_shared_outer_loras": False}) == ["--no-experts-shared-outer-loras"]
    assert sglang_flag_args({"experts_shared_outer_loras": True}) == ["--experts-shared-outer-loras"]


@pytest.mark.parametrize("key", ["model_path", "port", "host", "tp_size", "tp", "tensor-parallel-size", "model"])
def test_launcher_owned_flags_are_rejected(key: str) -> None:
    with pytest.raises(ValueError, match=f"rollout.sglang_args.{key} is set by the launcher"):
        sglang_flag_args({key: 1})


@pytest.mark.parametrize("key", ["--port-x", "", "a b", "-x"])
def test_malformed_keys_are_rejected(key: str) -> None:
    with pytest.raises(ValueError, match="without leading dashes"):
        sglang_flag_args({key: 1})


@pytest.mark.parametrize("value", [[{"a": 1}], [True], [None]])
def test_list_items_must_be_scalars(value: list) -> None:
    with pytest.raises(ValueError, match="cuda_graph_bs: list items"):
        sglang_flag_args({"cuda_graph_bs": value})


def test_unsupported_value_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported value"):
        sglang_flag_args({"attention_backend": object()})


def test_build_command_round_trips_through_sglang_like_parser() -> None:
    cmd = build_sglang_command("/m", 31000, 2, {"skip_tokenizer_init": True, "cuda_graph_bs": [1, 8],
                                                "preferred_sampling_params": {"temperature": 0.0},
                                                "experts_shared_outer_loras": False, "disable_cuda_graph": False},
                               python="/usr/bin/python3")
    assert cmd[:3] == ["/usr/bin/python3", "-m", "miles_lite.engines.sglang.launch"]
    ns = _sglang_like_parser().parse_args(cmd[3:])
    assert (ns.model_path, ns.port, ns.tp_size, ns.host) == ("/m", 31000, 2, "127.0.0.1")
    assert ns.skip_tokenizer_init and not ns.disable_cuda_graph
    assert ns.cuda_graph_bs == [1, 8]
    assert ns.preferred_sampling_params == {"temperature": 0.0}
    assert ns.experts_shared_outer_loras is False


def test_build_command_validates_tp_and_path() -> None:
    with pytest.raises(ValueError, match="rollout.engine_tp"):
        build_sglang_command("/m", 1, 0, {})
    with pytest.raises(ValueError, match="model.hf_path"):
        build_sglang_command("", 1, 1, {})


@pytest.mark.skipif(not sglang_importable(), reason="needs sglang importable")
def test_real_sglang_parser_accepts_the_project_defaults() -> None:
    from pathlib import Path

    import yaml

    from miles_lite.engines.sglang.command import sglang_option_names

    shipped = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "rollout" / "sglang.yaml").read_text())
    check_sglang_command(build_sglang_command("/m", 1, 1, for_installed_sglang(shipped["sglang_args"],
                                                                              sglang_option_names())))
    with pytest.raises(ValueError, match="does not know"):
        check_sglang_command(build_sglang_command("/m", 1, 1, {"no_such_flag_anywhere": 3}))


def test_check_is_a_no_op_without_sglang_or_rejects_non_sglang_commands() -> None:
    if sglang_importable():
        with pytest.raises(ValueError, match="not a sglang.launch_server"):
            check_sglang_command(["python", "-m", "other"])
    else:
        check_sglang_command(["python", "-m", "other"])  # nothing to check against here


def test_reference_flags_map_and_parse() -> None:
    cmd = build_reference_command("/m", 5000, {"max_batch_size": 8, "drop_weight_updates": True,
                                               "return_original_logprob": False, "fail_mode": "hang",
                                               "fail_after": 3}, listen_fd=7, python="py")
    assert cmd[:3] == ["py", "-m", "miles_lite.engines.reference.engine"]
    parser = argparse.ArgumentParser()
    add_reference_arguments(parser)
    ns = parser.parse_args(cmd[3:])
    assert (ns.model_path, ns.port, ns.listen_fd, ns.max_batch_size) == ("/m", 5000, 7, 8)
    assert ns.drop_weight_updates and not ns.return_original_logprob
    assert (ns.fail_mode, ns.fail_after) == ("hang", 3)


def test_reference_flags_reject_unknown_keys_and_non_bool_switches() -> None:
    with pytest.raises(ValueError, match="rollout.reference_args.batch is not a reference engine option"):
        reference_flags({"batch": 3})
    with pytest.raises(ValueError, match="drop_weight_updates must be true or false"):
        reference_flags({"drop_weight_updates": "yes"})


def test_launcher_command_factories(tmp_path) -> None:
    sg = EngineLauncher(RolloutConfig(backend="sglang", engine_tp=2, sglang_args={"skip_tokenizer_init": True}),
                        str(tmp_path), str(tmp_path / "logs"), python="py")
    cmd = sg.command_factory(3)(40000, None)
    ns = _sglang_like_parser().parse_args(cmd[3:])
    assert (ns.port, ns.tp_size, ns.base_gpu_id, ns.skip_tokenizer_init) == (40000, 2, 6, True)
    ref = EngineLauncher(RolloutConfig(backend="reference", reference_args={"threads": 2}), str(tmp_path),
                         str(tmp_path / "logs"), python="py")
    cmd = ref.command_factory(1)(40001, 9)
    assert cmd[cmd.index("--listen-fd") + 1] == "9" and cmd[cmd.index("--seed") + 1] == "1"
    assert ref.engine_id(1) == "reference-1"
    with pytest.raises(ValueError, match="rollout.backend='vllm'"):
        EngineLauncher(RolloutConfig(backend="vllm"), str(tmp_path), str(tmp_path))
    with pytest.raises(ValueError, match="is not a directory"):
        EngineLauncher(RolloutConfig(), str(tmp_path / "missing"), str(tmp_path))
    bad = EngineLauncher(RolloutConfig(reference_args={"nope": 1}), str(tmp_path), str(tmp_path))
    with pytest.raises(ValueError, match="rollout.reference_args.nope"):
        bad.command_factory(0)


def test_serve_builds_the_sglang_command() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--backend", "sglang", "--model-path", "/m", "--port", "1234", "--tp", "2",
                              "--sglang-args", '{"skip_tokenizer_init": true}'])
    cmd = sglang_argv(args)
    assert cmd[0] == sys.executable and "--skip-tokenizer-init" in cmd and cmd[cmd.index("--tp-size") + 1] == "2"
    bad = parser.parse_args(["--backend", "sglang", "--model-path", "/m", "--sglang-args", "[1]"])
    with pytest.raises(ValueError, match="must be a JSON object"):
        sglang_argv(bad)


def test_every_engine_loads_the_weight_loader_plugin(tmp_path) -> None:
    import os
    from pathlib import Path

    import miles_lite
    from miles_lite.weight_sync.loader_protocol import LOADER_FUNCTION

    sg = EngineLauncher(RolloutConfig(backend="sglang", sglang_args={"custom_weight_loader": ["my.pkg.load"]}),
                        str(tmp_path), str(tmp_path / "logs"), python="py", env={"PYTHONPATH": "/opt/sglang-site"})
    ns = _sglang_like_parser().parse_args(sg.command_factory(0)(40000, None)[3:])
    assert ns.custom_weight_loader == ["my.pkg.load", LOADER_FUNCTION]
    # SGLang installed apart keeps its own torch first; the project root comes after it, for the plugin.
    path = sg.create(0)._env["PYTHONPATH"].split(os.pathsep)
    root = str(Path(miles_lite.__file__).resolve().parent.parent)
    assert path[0] == "/opt/sglang-site" and path[-1] == root
    ref = EngineLauncher(RolloutConfig(backend="reference"), str(tmp_path), str(tmp_path / "logs"), python="py")
    cmd = ref.command_factory(0)(40001, None)
    assert cmd[cmd.index("--custom-weight-loader") + 1:][:1] == [LOADER_FUNCTION]
    bad = EngineLauncher(RolloutConfig(backend="sglang", sglang_args={"custom_weight_loader": "my.pkg.load"}),
                         str(tmp_path), str(tmp_path))
    with pytest.raises(ValueError, match="custom_weight_loader must be a list"):
        bad.command_factory(0)


# The launch flags of two SGLang versions, as far as the renamed flag goes.
SGLANG_0_5_10 = frozenset({"--model-path", "--disable-cuda-graph", "--disable-piecewise-cuda-graph"})
SGLANG_0_5_23 = frozenset({"--model-path", "--disable-cuda-graph", "--disable-prefill-cuda-graph",
                           "--cuda-graph-backend-prefill"})


@pytest.mark.parametrize("key", ["disable_piecewise_cuda_graph", "disable_prefill_cuda_graph",
                                 "disable-prefill-cuda-graph"])
def test_renamed_flags_are_spelt_as_the_installed_sglang_knows_them(key: str) -> None:
    args = {key: True, "mem_fraction_static": 0.5}
    assert for_installed_sglang(args, SGLANG_0_5_10) == {"disable_piecewise_cuda_graph": True,
                                                         "mem_fraction_static": 0.5}
    assert for_installed_sglang(args, SGLANG_0_5_23) == {"disable_prefill_cuda_graph": True,
                                                         "mem_fraction_static": 0.5}
    assert for_installed_sglang(args, None) == args  # SGLang not visible: passed as given
    # A parser that knows neither spelling: left for the parser check to name.
    assert for_installed_sglang(args, frozenset({"--model-path"})) == args


def test_both_spellings_must_agree() -> None:
    both = {"disable_piecewise_cuda_graph": True, "disable_prefill_cuda_graph": True}
    assert for_installed_sglang(both, SGLANG_0_5_23) == {"disable_prefill_cuda_graph": True}
    with pytest.raises(ValueError, match="disable_piecewise_cuda_graph and disable_prefill_cuda_graph .* different"):
        for_installed_sglang({**both, "disable_prefill_cuda_graph": False}, SGLANG_0_5_23)


def test_the_shipped_config_turns_prefill_cuda_graphs_off() -> None:
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "conf" / "rollout" / "sglang.yaml").read_text()
    assert yaml.safe_load(text)["sglang_args"]["disable_prefill_cuda_graph"] is True
    assert "FusedAddRMSNorm" in text  # the comment says why


FAKE_SERVER_ARGS = """
class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        for name in ("--model-path", "--host", "--port", "--tp-size", "--base-gpu-id"):
            parser.add_argument(name)
        parser.add_argument("--custom-weight-loader", nargs="*")
        parser.add_argument("{flag}", action="store_true")
"""
FAKE_OPTIONS = {"-h", "--help", "--model-path", "--host", "--port", "--tp-size", "--base-gpu-id",
                "--custom-weight-loader"}


@pytest.mark.parametrize("flag", ["--disable-piecewise-cuda-graph", "--disable-prefill-cuda-graph"])
def test_launcher_asks_the_engines_sglang_for_its_flags(tmp_path, flag: str) -> None:
    # An SGLang installed apart (on the engines' PYTHONPATH only) declaring one spelling of the flag.
    package = tmp_path / "site" / "sglang" / "srt"
    package.mkdir(parents=True)
    for init in (package.parent / "__init__.py", package / "__init__.py"):
        init.write_text("")
    (package / "server_args.py").write_text(FAKE_SERVER_ARGS.format(flag=flag))
    sg = EngineLauncher(RolloutConfig(backend="sglang", sglang_args={"disable_piecewise_cuda_graph": True}),
                        str(tmp_path), str(tmp_path / "logs"), env={"PYTHONPATH": str(tmp_path / "site")})
    assert sg.sglang_options() == frozenset({*FAKE_OPTIONS, flag})
    cmd = sg.command_factory(0)(40000, None)
    assert flag in cmd and len([c for c in cmd if "cuda-graph" in c]) == 1
    # The engines' SGLang is the one that judges the flags.
    bad = EngineLauncher(RolloutConfig(backend="sglang", sglang_args={"no_such_flag": 1}), str(tmp_path),
                         str(tmp_path / "logs"), env={"PYTHONPATH": str(tmp_path / "site")})
    with pytest.raises(ValueError, match=r"engines' SGLang does not know the flags \['--no-such-flag'\]"):
        bad.command_factory(0)
    # Without SGLang where the engines run, flags pass as given.
    plain = EngineLauncher(RolloutConfig(backend="sglang", sglang_args={"disable_prefill_cuda_graph": True}),
                           str(tmp_path), str(tmp_path / "logs"), env={"PYTHONPATH": str(tmp_path / "none")})
    assert plain.sglang_options() is None
    assert "--disable-prefill-cuda-graph" in plain.command_factory(0)(40000, None)
