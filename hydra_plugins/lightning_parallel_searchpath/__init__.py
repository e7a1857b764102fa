"""Hydra finds lightning_parallel's config groups (``strategy/``, ``hardware/``) by name in any app.

Hydra imports every module of the ``hydra_plugins`` namespace package it can find on ``sys.path`` and runs the
``SearchPathPlugin`` subclasses among them before composing a config (under ``@hydra.main`` and the compose API
alike). This one appends the package's ``conf/`` directory to the search path: an app's defaults list may then say
``- strategy: data`` or ``- hardware: h100_ib`` without copying our files, and an app's own ``strategy/<name>.yaml``
still wins over ours (its config directory comes first).

The directory is found with ``importlib.util.find_spec``, which locates the package without running it: Hydra loads
this plugin in every app of an environment the package is installed in, and ``pkg://lightning_parallel.conf`` would
import lightning_parallel (and torch) in each of them, whether it uses our groups or not.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


def library_config_dir() -> Path | None:
    """``lightning_parallel/conf`` of the installed package, or ``None`` when there is none (no package, zipped)."""
    spec = importlib.util.find_spec("lightning_parallel")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        conf = Path(location) / "conf"
        if conf.is_dir():
            return conf
    return None


class LightningParallelSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        conf = library_config_dir()
        if conf is not None:
            search_path.append(provider="lightning_parallel", path=f"file://{conf}")
