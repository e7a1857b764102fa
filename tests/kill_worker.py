"""Train on one rank, saving every step, and hang (to be killed) in the middle of the second save.

``python -m tests.kill_worker FORMAT DIRECTORY``: the second save writes its bytes, tears one of its files
in half (a write cut short), touches ``DIRECTORY/hanging`` and sleeps until the test sends SIGKILL.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from lightning_parallel.checkpoint import files
from lightning_parallel.strategies import checkpoint_files
from tests.checkpoint_worker import Run, run

if __name__ == "__main__":
    save_format, directory = sys.argv[1], Path(sys.argv[2])
    publish = files.publish
    calls = [0]

    def publish_or_hang(partial: Path, final: Path) -> None:
        calls[0] += 1
        if calls[0] == 2:
            torn = max((p for p in [partial, *partial.glob("*")] if p.is_file()), key=lambda p: p.stat().st_size)
            torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
            (directory / "hanging").touch()
            time.sleep(600)
        publish(partial, final)

    files.publish = checkpoint_files.publish = publish_or_hang
    run(Run(name="killed", strategy="data", steps=4, strategy_kwargs={"save_format": save_format},
            checkpoint_every=1, checkpoint_dir=str(directory)), devices=1)
