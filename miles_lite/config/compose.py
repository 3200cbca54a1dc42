"""Compose a `MilesConfig` from `conf/` and command-line overrides with Hydra.

The dataclass schema is registered in Hydra's ConfigStore as `miles_lite_schema`; `conf/config.yaml`
lists it first in its defaults, so every YAML value and override is type-checked against it.

Configuration files of your own need no copy of `conf/`: `--config-dir DIR` is searched before `conf/` (a
`DIR/experiment/mine.yaml` is `experiment=mine`, a `DIR/model/tiny_llama.yaml` replaces the shipped one,
everything else comes from `conf/`), and `experiment=PATH.yaml` takes an experiment file from anywhere
(a path: it ends in .yaml/.yml or holds a `/`). Such a file is written like the ones in `conf/experiment/`,
starting with `# @package _global_`.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path
from typing import cast

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from miles_lite.config.schema import GROUPS, MilesConfig

SCHEMA_NAME = "miles_lite_schema"


def default_config_dir() -> Path:
    """`conf/` at the root of the source tree (an editable install) or beside the package."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "conf", here.parents[1] / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        "cannot find conf/config.yaml beside the miles_lite package; pass --config-dir DIR"
    )


def register_schema() -> None:
    """Put the dataclass schema in Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=MilesConfig)


class ConfigFileError(ValueError):
    """A configuration directory or experiment file given on the command line is not there."""


def experiment_file(overrides: list[str]) -> tuple[list[str], Path | None]:
    """`experiment=PATH.yaml` among `overrides`: the overrides with it as `experiment=<file stem>`, and the file
    (None when the experiment is named, not a path). ConfigFileError when the file is missing."""
    out, found = [], None
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") == "experiment" and (value.endswith((".yaml", ".yml")) or "/" in value):
            path = Path(value).expanduser()
            if not path.is_file():
                raise ConfigFileError(f"experiment={value}: no such file (an experiment given as a path is a YAML "
                                      "file like those in conf/experiment/; a name picks conf/experiment/<name>.yaml)")
            found = path.resolve()
            override = f"{key}={found.stem}"
        out.append(override)
    return out, found


def _search_path_override(overrides: list[str]) -> tuple[list[str], list[str]]:
    """`hydra.searchpath=[DIR,...]` (or `+hydra.searchpath=`) taken out of `overrides`: its directories are
    searched before `conf/` like `--config-dir` (Hydra alone would search them after it, or ignore the `+` form)."""
    rest, dirs = [], []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") == "hydra.searchpath":
            for entry in value.strip().strip("[]").split(","):
                entry = entry.strip().strip("'\"")
                if entry:
                    dirs.append(entry.removeprefix("file://"))
            continue
        rest.append(override)
    return rest, dirs


# The primary config of a composition on top of a recorded configuration (`recorded=`).
RECORDED_NAME = "miles_lite_recorded"


def _on_recorded(overrides: list[str], recorded: str, tmp: Path) -> list[str]:
    """Write `recorded` (a whole resolved configuration's YAML) as a primary config in `tmp`; the overrides with
    each config group choice (`rollout=sglang`) added after it (`+rollout=sglang`), so the group's file applies
    over the recorded values."""
    body = OmegaConf.load(io.StringIO(recorded))
    text = "defaults:\n  - miles_lite_schema\n  - _self_\n" + OmegaConf.to_yaml(body)
    (tmp / f"{RECORDED_NAME}.yaml").write_text(text)
    out = []
    for override in overrides:
        key, sep, _ = override.partition("=")
        out.append(f"+{override}" if sep and key in GROUPS else override)
    return out


def compose_dictconfig(
    overrides: list[str] | None = None, config_dir: str | Path | None = None, config_name: str = "config",
    recorded: str | None = None,
) -> DictConfig:
    """Compose `config_name` with Hydra overrides (`trainer.tp=2`, `experiment=...`, `experiment=PATH.yaml`);
    `config_dir`: a directory searched before `conf/` (see the module docstring). `recorded`: the YAML of a
    run's resolved configuration to start from instead of `conf/config.yaml` (what `miles-lite eval` does with
    a run or a checkpoint); the overrides apply over it."""
    register_schema()
    main = default_config_dir().resolve()
    overrides, exp_file = experiment_file(list(overrides or []))
    overrides, user_path = _search_path_override(overrides)
    searched: list[Path] = []
    given_dirs = [(str(config_dir), "--config-dir")] if config_dir else []
    for given, what in given_dirs + [(d, "hydra.searchpath") for d in user_path]:
        extra = Path(given).expanduser().resolve()
        if not extra.is_dir():
            raise ConfigFileError(f"{what} {given}: no such directory")
        if extra != main:
            searched.append(extra)
    with tempfile.TemporaryDirectory(prefix="miles-lite-conf-") as tmp:
        if recorded is not None:
            overrides = _on_recorded(overrides, recorded, Path(tmp))
            searched.insert(0, Path(tmp))
            config_name = RECORDED_NAME
        if exp_file is not None:
            # Hydra finds group options by name in its search path: the file goes first there, as experiment/<stem>.
            (Path(tmp) / "experiment").mkdir()
            shutil.copyfile(exp_file, Path(tmp) / "experiment" / f"{exp_file.stem}.yaml")
            if Path(tmp) not in searched:
                searched.insert(0, Path(tmp))
        primary, later = (searched[0], [*searched[1:], main]) if searched else (main, [])
        if later:
            overrides.append("hydra.searchpath=[" + ",".join(f"file://{d}" for d in later) + "]")
            if not (primary / f"{config_name}.yaml").is_file():
                # The primary config is read before the search path applies: the shipped one is offered from the
                # ConfigStore, which Hydra searches after the directories.
                shipped = main / f"{config_name}.yaml"
                if shipped.is_file():
                    ConfigStore.instance().store(name=config_name, node=OmegaConf.load(shipped))
        # Hydra keeps one global instance; composing twice in a process (tests, notebooks) needs a reset.
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(primary), version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides)


def load_config(
    overrides: list[str] | None = None, config_dir: str | Path | None = None, config_name: str = "config",
    recorded: str | None = None,
) -> MilesConfig:
    """Compose and convert to the typed `MilesConfig` dataclass (not validated; see `validate`)."""
    cfg = compose_dictconfig(overrides, config_dir, config_name, recorded)
    return cast(MilesConfig, OmegaConf.to_object(cfg))


def to_yaml(cfg: MilesConfig | DictConfig) -> str:
    """The resolved configuration as YAML (what `--cfg job` prints and each run saves)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg) if isinstance(cfg, MilesConfig) else cfg, resolve=True)
