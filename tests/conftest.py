"""Timeouts in layers: a launch's own budget ends a hung launch first; pytest-timeout only ends what outlives it.

pytest-timeout (``timeout`` in pyproject.toml, 600 s) times a test's setup, call and teardown together
(``timeout_func_only`` is false), so the test that first asks for a shared launch's fixture pays for the whole launch
inside its own timeout. A launch whose budget is longer than that timeout was cut off by pytest-timeout (a stack dump
of the test process) before its own budget could kill it and report the ranks' output. Here each test gets a timeout
above the largest budget of the launches it may wait for, plus the time of its own work in this process:

* tests that use the shared 4- and 8-rank launches (``tests/distributed/conftest.py``, budget 2700 s each);
* other ``distributed`` tests (their launches' budgets are at most 900 s; ``tests/unit/test_timeouts.py`` reads every
  launch call's budget from the sources and fails if one grows past what these timeouts leave room for);
* everything else keeps pyproject's 600 s. A ``@pytest.mark.timeout`` on a test wins.
"""

from __future__ import annotations

import pytest

#: Seconds a test may spend beyond its launch: its single-device references and checks in this process.
OWN_WORK = 600
#: The budget of each fixture that starts a launch (tests/distributed/conftest.py: ``timeout=2700``).
FIXTURE_LAUNCH_BUDGETS = {"four_rank_launch": 2700, "eight_rank_launch": 2700}
#: The largest budget a distributed test gives a launch of its own (test_context_parallel, test_compile,
#: test_transformers: 900 s).
OWN_LAUNCH_BUDGET = 900


def timeout_for(fixturenames: list[str] | tuple[str, ...], distributed: bool) -> int | None:
    """The pytest-timeout of a test that uses ``fixturenames`` (``None``: pyproject's default)."""
    budgets = [FIXTURE_LAUNCH_BUDGETS[name] for name in fixturenames if name in FIXTURE_LAUNCH_BUDGETS]
    if distributed:
        budgets.append(OWN_LAUNCH_BUDGET)
    return max(budgets) + OWN_WORK if budgets else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue
        seconds = timeout_for(getattr(item, "fixturenames", ()), item.get_closest_marker("distributed") is not None)
        if seconds is not None:
            item.add_marker(pytest.mark.timeout(seconds))


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that leaves a process group in the pytest process fails here, and the group is destroyed.

    Left alone, the next test that starts one fails with "trying to initialize the default process group twice" and
    every in-process distributed test after it fails the same way, far from the test that caused it.
    """
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if before or not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()
    pytest.fail("this test left a process group initialised in the pytest process; destroy it (the group is now destroyed)")
