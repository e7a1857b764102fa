"""The environment of a process this library starts on its own (a measurement, a benchmark's job), not as a rank.

Lightning (and torchrun, SLURM, MPI) tell a process it is a rank of a job through environment variables; a child that
inherits them from a rank would join, or wait for, that job. No Lightning here.
"""

from __future__ import annotations

import os

#: Variables by which Lightning would take a process for a rank of the job that started it.
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                      "LOCAL_WORLD_SIZE", "JSM_NAMESPACE_SIZE")
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "LSB_", "KUBEFLOW_")


def standalone_environment() -> dict[str, str]:
    """This process's environment without what makes a child one of a distributed job's ranks."""
    return {key: value for key, value in os.environ.items()
            if key not in LAUNCHER_VARIABLES and not key.startswith(LAUNCHER_PREFIXES)}
