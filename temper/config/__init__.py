"""Configs: the Configurable base, named recipes and strict JSON round trips.

The tyro-based command-line layer (temper.config.cli) is not imported here, so components that
only need `Configurable` do not pay for importing tyro.
"""

from __future__ import annotations

from temper.config.configurable import Configurable
from temper.config.recipes import (
    RecipeInfo,
    default_recipe,
    get_recipe,
    list_recipes,
    recipe,
)
from temper.config.serialize import (
    LoadedConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)

__all__ = [
    "Configurable",
    "LoadedConfig",
    "RecipeInfo",
    "config_from_dict",
    "config_to_dict",
    "default_recipe",
    "get_recipe",
    "list_recipes",
    "load_config",
    "recipe",
    "save_config",
]
