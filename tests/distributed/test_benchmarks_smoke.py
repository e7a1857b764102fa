"""Every benchmark ``make benchmark`` runs, in its smoke mode: a change that breaks a benchmark fails here.

``benchmarks/smoke.py`` runs each script's ``main(["--smoke", "--results", DIR])`` in this process (tiny model,
one round, its summary and report written under DIR) with the scripts' 2-rank worker runs in one 2-rank launch
started once. ``hot_path.py``'s jobs are the shared 4-rank launch's: its report is written from that launch.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from benchmarks import hot_path as hot_path_script
from benchmarks import smoke
from tests import hot_path

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED = REPO_ROOT / "benchmarks" / "results"
#: Scripts whose smoke runs elsewhere in the suite, not in :func:`test_every_benchmark_runs_in_its_smoke_mode`.
ELSEWHERE = {
    "hot_path": "its jobs are the shared 4-rank launch (test_hot_path_report_from_the_shared_launch)",
    # Each layout is a fresh recipes/train.py process (Hydra, the planner's dry run, the monitor: ~10 s of CPU
    # each, 6 of them with the overhead runs); the recipe's planner and monitor path is tested in test_recipe.py.
    "planner_accuracy": "six fresh recipe processes, over the suite's time budget: `python benchmarks/smoke.py --only planner_accuracy`",
}


def _committed_digest() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(COMMITTED.iterdir()) if p.is_file()}


def test_make_benchmark_runs_only_scripts_with_a_smoke_test():
    """A script added to ``make benchmark`` without a smoke mode here fails this test."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    target = makefile.split("\nbenchmark:", 1)[1].split("\n\n", 1)[0]
    scripts = re.findall(r"benchmarks/(\w+)\.py", target)
    assert scripts, "no benchmarks/*.py under the Makefile's benchmark target"
    assert set(scripts) == set(smoke.SCRIPTS) | {"hot_path"}, (set(scripts), smoke.SCRIPTS)
    assert set(ELSEWHERE) <= set(scripts)


def test_every_benchmark_runs_in_its_smoke_mode(tmp_path):
    names = [name for name in smoke.SCRIPTS if name not in ELSEWHERE]
    before = _committed_digest()
    failures = smoke.run_smokes(tmp_path, names)
    assert not any(failures.values()), "\n".join(f"{n}: {why}" for n, why in failures.items() if why)
    for name in names:
        report = (tmp_path / name / f"{name}.md").read_text()
        assert report.startswith("# ") and "|---" in report, f"{name}.md has no table:\n{report}"
        data = json.loads((tmp_path / name / f"{name}.json").read_text())
        assert data, name
        assert not list((tmp_path / name).glob(".scratch-*")), f"{name} left its scratch folder"
    assert _committed_digest() == before, "a smoke run changed the committed results in benchmarks/results/"


def test_hot_path_report_from_the_shared_launch(four_rank_launch, tmp_path):
    results, _, _ = four_rank_launch
    rows = hot_path_script.write_results({name: results[name] for name in hot_path.specs()}, tmp_path)
    committed = json.loads((COMMITTED / "hot_path.json").read_text())["layouts"]
    assert set(rows) == set(committed)
    assert all(set(rows[layout]) == set(committed[layout]) for layout in rows), rows
    report = (tmp_path / "hot_path.md").read_text()
    assert all(f"| {layout} |" in report for layout in rows), report

