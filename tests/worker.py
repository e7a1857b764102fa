"""Entry point of multi-process test jobs: ``python -m tests.worker SPEC.json RESULT.pt``.

Run as a script so that Lightning's default launcher re-runs it once per extra rank.
"""

import json
import sys
from pathlib import Path

from tests.harness import JobSpec, run_job

if __name__ == "__main__":
    spec = JobSpec(**json.loads(Path(sys.argv[1]).read_text()))
    run_job(spec, save_path=Path(sys.argv[2]))
