"""Compose a `MilesConfig` from `conf/` and command-line overrides with Hydra.

The dataclass schema is registered in Hydra's ConfigStore as `miles_lite_schema`; `conf/config.yaml`
lists it first in its defaults, so every YAML value and override is type-checked against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from miles_lite.config.schema import MilesConfig

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


def compose_dictconfig(
    overrides: list[str] | None = None, config_dir: str | Path | None = None, config_name: str = "config"
) -> DictConfig:
    """Compose `config_name` from `config_dir` with Hydra overrides (`trainer.tp=2`, `experiment=...`)."""
    register_schema()
    directory = Path(config_dir) if config_dir else default_config_dir()
    # Hydra keeps one global instance; composing twice in a process (tests, notebooks) needs a reset.
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(directory.resolve()), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides or []))


def load_config(
    overrides: list[str] | None = None, config_dir: str | Path | None = None, config_name: str = "config"
) -> MilesConfig:
    """Compose and convert to the typed `MilesConfig` dataclass (not validated; see `validate`)."""
    cfg = compose_dictconfig(overrides, config_dir, config_name)
    return cast(MilesConfig, OmegaConf.to_object(cfg))


def to_yaml(cfg: MilesConfig | DictConfig) -> str:
    """The resolved configuration as YAML (what `--cfg job` prints and each run saves)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg) if isinstance(cfg, MilesConfig) else cfg, resolve=True)
