"""The presets' flat keyword options, built from the component config dataclasses (each default written once).

Users pass flat keywords (``DataParallelStrategy(bucket_cap_mb=50, sync="local_sgd")``, Hydra's
``strategy.bucket_cap_mb=50``). Each keyword belongs to one field of one config dataclass
(``DataParallelConfig``, ``SyncConfig``, ``TensorParallelConfig``, ``PipelineConfig``); the keyword is the
field's name unless the field's metadata names it (``metadata={"option": "data_parallel_mode"}``: the flat
name must say which dimension it is about). Defaults live in the dataclasses only; a preset may change one
deliberately (``TensorParallelStrategy`` shards its replicas by default) through ``preset_defaults``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any


def option_names(config_type: type) -> dict[str, str]:
    """Flat keyword -> field name, for one config dataclass."""
    return {f.metadata.get("option", f.name): f.name for f in fields(config_type)}


def option_defaults(config_type: type) -> dict[str, Any]:
    """Flat keyword -> default value, for one config dataclass."""
    defaults = {}
    for f in fields(config_type):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        defaults[f.metadata.get("option", f.name)] = default
    return defaults


def configs_options(configs: Mapping[str, type]) -> list[str]:
    """Every flat keyword the given config dataclasses take."""
    return [option for config_type in configs.values() for option in option_names(config_type)]


def split_options(
    options: dict[str, Any],
    configs: Mapping[str, type],
    preset_defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build one config per entry of ``configs`` (engine argument -> dataclass) from the flat ``options``.

    The options used are removed from ``options``; what remains is for the engine itself.
    """
    built: dict[str, Any] = {}
    chosen = {**(preset_defaults or {}), **options}
    for argument, config_type in configs.items():
        names = option_names(config_type)
        values = {field: chosen[option] for option, field in names.items() if option in chosen}
        for option in names:
            options.pop(option, None)
        built[argument] = config_type(**values)
    return built


def check_known(owner: str, options: Mapping[str, Any], accepted: list[str]) -> None:
    """Refuse keywords that no component and not the engine takes, with the closest known name.

    Raises:
        TypeError: An unknown keyword.
    """
    for name in options:
        if name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{owner}() got an unknown option {name!r}.{hint} Its options: {', '.join(sorted(accepted))}.")


def engine_options(engine_init: Callable[..., Any], config_arguments: Sequence[str]) -> list[str]:
    """The engine's own keyword arguments a preset passes through (launch, checkpoints, devices, ...)."""
    names = inspect.signature(engine_init).parameters
    return [name for name in names if name != "self" and name not in config_arguments]


def preset_options(
    preset: Any, options: Mapping[str, Any], engine_init: Callable[..., Any], config_arguments: Sequence[str]
) -> dict[str, Any]:
    """A preset's flat keywords as the engine's arguments: one config per component, the rest as given.

    Raises:
        TypeError: A keyword that neither the preset's components nor the engine take.
    """
    remaining = dict(options)
    configs = split_options(remaining, preset.preset_configs, preset.preset_defaults)
    accepted = [*configs_options(preset.preset_configs), *engine_options(engine_init, config_arguments)]
    check_known(preset.__name__, remaining, accepted)
    return {**configs, **remaining}


def preset_signature(preset: Any, engine_init: Callable[..., Any], config_arguments: Sequence[str]) -> inspect.Signature:
    """The signature a preset shows (``help()``, IDEs): its own sizes, then every option with its real default."""
    parameters = [p for p in inspect.signature(preset.__init__).parameters.values()
                  if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    seen = {p.name for p in parameters}
    for config_type in preset.preset_configs.values():
        for option, default in option_defaults(config_type).items():
            if option not in seen:
                default = preset.preset_defaults.get(option, default)
                parameters.append(inspect.Parameter(option, inspect.Parameter.KEYWORD_ONLY, default=default))
                seen.add(option)
    for parameter in inspect.signature(engine_init).parameters.values():
        if parameter.name in seen or parameter.name in config_arguments or parameter.name == "self":
            continue
        parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        seen.add(parameter.name)
    return inspect.Signature(parameters)
