"""The library's Hydra config groups, shipped in the package (package data).

- ``strategy/``: one file per preset (``single``, ``data``, ``tensor``, ``pipeline``, ``hybrid``, ``auto``), each listing
  every option with the preset's default; ``strategy/plan/``: tensor-parallel plans written out (``llama``).
- ``hardware/``: the profiles the planner and the ScalingMonitor predict for (``cpu_local``, ``h100_ib``, ...).
- ``plan.yaml``: the planner's own primary config, for ``python -m lightning_parallel.plan`` outside a project with
  a ``conf/config.yaml`` (the model and its data given as ``_target_`` overrides).

Any Hydra app finds the groups by name: the ``hydra_plugins.lightning_parallel_searchpath`` plugin, installed with
the package, appends ``pkg://lightning_parallel.conf`` to every app's search path. The interpolations the strategy
files make into the app's config: ``${trainer.accelerator}`` (``single``) and ``${hardware}`` (``auto``).
"""

from pathlib import Path

#: This directory (a plain directory of an installed package: ``--config-dir`` of the planner and the dry run).
CONFIG_DIR = Path(__file__).resolve().parent

#: The planner's primary config in :data:`CONFIG_DIR`.
PLANNER_CONFIG = "plan"
