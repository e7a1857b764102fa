"""The timeout layers of tests/conftest.py hold: every launch's own budget is below the pytest-timeout of its test."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from tests.conftest import FIXTURE_LAUNCH_BUDGETS, OWN_LAUNCH_BUDGET, OWN_WORK, timeout_for

ROOT = Path(__file__).resolve().parents[2]


def literal_timeouts(path: Path) -> list[tuple[str, int, float]]:
    """(called name, line, seconds) of each call with a numeric ``timeout=`` keyword, other than a strategy's (a
    collective's timeout, not a launch budget)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name.endswith("Strategy"):
            continue
        for keyword in node.keywords:
            if keyword.arg == "timeout" and isinstance(keyword.value, ast.Constant) and isinstance(keyword.value.value, (int, float)):
                found.append((name, node.lineno, keyword.value.value))
    return found


def default_timeout(function: str) -> float:
    tree = ast.parse((ROOT / "tests/harness.py").read_text())
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
    names = [a.arg for a in node.args.args][-len(node.args.defaults):]
    return dict(zip(names, (d.value for d in node.args.defaults), strict=True))["timeout"]


def test_every_launch_budget_of_a_distributed_test_is_below_its_timeout():
    too_long, shared = [], []
    for path in sorted((ROOT / "tests/distributed").glob("*.py")):
        for name, line, seconds in literal_timeouts(path):
            if path.name == "conftest.py":  # the shared launches: their budget is FIXTURE_LAUNCH_BUDGETS'
                shared.append(seconds)
                assert seconds in FIXTURE_LAUNCH_BUDGETS.values(), f"conftest.py:{line}: a launch of {seconds} s"
            elif seconds > OWN_LAUNCH_BUDGET:
                too_long.append(f"{path.name}:{line} {name}(timeout={seconds})")
    for function in ("run_distributed", "run_distributed_jobs"):
        if default_timeout(function) > OWN_LAUNCH_BUDGET:
            too_long.append(f"harness.{function}'s default {default_timeout(function)}")
    assert shared, "tests/distributed/conftest.py gives its launches no budget of its own any more"
    assert not too_long, f"raise OWN_LAUNCH_BUDGET in tests/conftest.py above {too_long}"


@pytest.mark.parametrize(
    ("fixtures", "distributed", "launch_budget"),
    [
        (("four_rank_launch", "tmp_path"), True, 2700),
        (("eight_rank_launch",), True, 2700),
        (("tmp_path",), True, OWN_LAUNCH_BUDGET),
    ],
)
def test_a_test_outlives_the_launches_it_waits_for(fixtures, distributed, launch_budget):
    assert timeout_for(fixtures, distributed) == launch_budget + OWN_WORK > launch_budget


def test_tests_without_launches_keep_the_default():
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert timeout_for(("tmp_path",), distributed=False) is None
    assert settings["timeout"] == 600
    # The timeout covers fixture setup (a shared launch starts inside the first test that asks for it).
    assert not settings.get("timeout_func_only", False)
