"""Typed configuration (Hydra structured configs) and its validation. A library: it may import the other
libraries (the reward registry and plug-in loader for validation, `net` for the run's key), nothing above them.
"""

from miles_lite.config.compose import compose_dictconfig, default_config_dir, load_config, to_yaml
from miles_lite.config.schema import GROUPS, MilesConfig
from miles_lite.config.validate import ConfigError, ModelDims, model_dims, validate

__all__ = [
    "GROUPS",
    "ConfigError",
    "MilesConfig",
    "ModelDims",
    "compose_dictconfig",
    "default_config_dir",
    "load_config",
    "model_dims",
    "to_yaml",
    "validate",
]
