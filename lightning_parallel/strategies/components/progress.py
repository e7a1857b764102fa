"""Where every rank last was: a hang becomes an error that names the rank, the step and the stage of it.

A rank that stops calling collectives (a stuck data loader, a deadlock, a ``training_step`` that skips the
model on one rank) leaves the others waiting in a collective until the process group's ``timeout``; gloo
then says only that a receive timed out. Each rank therefore writes where it is — step and phase — to the
job's key-value store (one small write per phase, no collective), and a rank whose collective timed out
reads them all back and adds the report to its error::

    Ranks at the hang: rank 0: step 3, training_step, in its 1st collective (reduce) · rank 1: step 3,
    training_step — the rank(s) behind, which never reached the collective the others wait in: [1]
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.strategies.components.base import Component

if TYPE_CHECKING:
    from lightning_parallel.strategies.host import EngineHost

log = logging.getLogger(__name__)

#: Phases of one optimizer step, in order.
PHASES = ("training_step", "backward", "optimizer_step")

#: How gloo and NCCL say that a collective waited past the process group's timeout.
_TIMEOUT = re.compile(r"timed out|timeout|Timeout|watchdog", re.IGNORECASE)

_KEY = "lightning_parallel/progress/{rank}"

#: How often a rank's position reaches the store at most. A hang lasts the process group's timeout (a minute or
#: more), so a position a second old names the same step and phase; writing every phase of every step would be
#: several round trips to one store host per rank per step (thousands per step at a thousand ranks).
WRITE_INTERVAL_S = 1.0
#: Under NCCL, a rank still in one place after this fraction of the process group's timeout is reported.
STALL_FRACTION = 0.9


class _LatestValueWriter:
    """Writes the latest value put to ``store[key]`` from a background thread, at most once per ``interval``.

    The training thread only swaps a string; the thread writes while the training thread waits in a collective too
    (the store's client is thread-safe). Errors writing (the store's host gone at the end of a job) stop it quietly.
    """

    def __init__(
        self, store: dist.Store, key: str, interval: float, stall_after: float | None = None,
        on_stall: Callable[[float], None] | None = None,
    ) -> None:
        self.store, self._key, self._interval = store, key, interval
        self._latest: str | None = None
        self._written: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._stall_after, self._on_stall = stall_after, on_stall
        self._last_progress = time.monotonic()
        self._stall_reported = False
        self._thread = threading.Thread(target=self._run, name="lightning_parallel-progress", daemon=True)
        self._thread.start()

    def put(self, value: str) -> None:
        self._latest = value
        self.touch()
        self._wake.set()

    def touch(self) -> None:
        """Progress that is not written (a validation step): the stall clock starts again."""
        self._last_progress = time.monotonic()
        self._stall_reported = False

    def flush(self) -> None:
        with self._lock:
            value = self._latest
            if value is not None and value != self._written:
                self.store.set(self._key, value)
                self._written = value

    def close(self) -> None:
        """Stop the thread and wait for it: it must not be inside a store call when the process group goes."""
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._closed:
            woken = self._wake.wait(timeout=self._interval)
            self._wake.clear()
            if self._closed:
                return
            try:
                if woken:
                    self.flush()
                    self._stop.wait(self._interval)  # at most one write per interval; close() ends the wait
                self._check_stall()
            except Exception:  # noqa: BLE001 - a progress note must never take a job down
                return

    def _check_stall(self) -> None:
        still = time.monotonic() - self._last_progress
        if self._on_stall is not None and self._stall_after is not None and not self._stall_reported and still > self._stall_after:
            self._stall_reported = True
            self._on_stall(still)


class ProgressReport(Component):
    """Records each rank's step and phase in the store; on a timed-out collective, reports them all."""

    def __init__(self, engine: EngineHost) -> None:
        super().__init__(engine)
        self._store: dist.Store | None = None
        self._phase: str | None = None  # the phase of the step this rank is in
        self._collectives = 0  # the strategy's collectives called in it so far
        self._writer: _LatestValueWriter | None = None

    def around_step(self, hook: str, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if hook == "training_step":
            self._record("training_step")
        elif self._writer is not None:
            self._writer.touch()  # evaluation steps are progress too (not a stall)
        return run()

    def around_backward(self, run: Callable[[], Tensor], loss: Tensor) -> Tensor:
        self._record("backward")
        return run()

    def around_optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], run: Callable[[Callable[[], Any]], Any]) -> Any:
        self._record("optimizer_step")
        return run(closure)

    def on_exception(self, exception: BaseException) -> None:
        if not _TIMEOUT.search(str(exception)) or self.store is None:
            return
        if self._writer is not None:
            self._writer.flush()  # this rank's own last position, before reading everyone's
        report = self.report()
        if report:
            exception.args = (f"{exception.args[0] if exception.args else exception}\n{report}", *exception.args[1:])
        # The ranks this process launched are stuck (that is the hang): end them, or they would outlive the job.
        launcher = self.engine.launcher
        if isinstance(launcher, _SubprocessScriptLauncher) and getattr(launcher, "procs", None):
            launcher.kill(signal.SIGKILL)

    @property
    def store(self) -> dist.Store | None:
        """The default process group's store (torch keeps it private; checked against torch 2.13)."""
        if self._store is None and dist.is_initialized():
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def _record(self, phase: str) -> None:
        self._phase, self._collectives = phase, 0
        self._write("")

    def record_collective(self, name: str) -> None:
        """Called by the strategy's own collectives (``self.log(sync_dist=True)``, broadcasts, barriers)."""
        if self._phase is not None:
            self._collectives += 1
            self._write(name)

    def _write(self, collective: str) -> None:
        store = self.store
        module = self.engine.lightning_module
        if store is None or self.engine.world_size == 1 or module is None or module._trainer is None:
            return
        if self._writer is None or self._writer.store is not store:
            # NCCL's watchdog ends a process whose collective timed out without a Python error, so the report in
            # on_exception may never be made: the writer's thread reports a rank that stopped moving before that.
            timeout = self.engine.process_group_timeout.total_seconds()
            nccl = dist.get_backend() == "nccl"
            self._writer = _LatestValueWriter(
                store, _KEY.format(rank=self.engine.global_rank), WRITE_INTERVAL_S,
                stall_after=STALL_FRACTION * timeout if nccl else None, on_stall=self._report_stall,
            )
        self._writer.put(f"{module.trainer.global_step}:{self._phase}:{self._collectives}:{collective}")

    def _report_stall(self, seconds: float) -> None:
        # Every rank warns for itself: the one that stopped may be any.
        log.warning(
            "lightning_parallel: rank %d has made no progress for %.0f s (the process group's timeout is %.0f s; NCCL "
            "then ends the process without a Python error). %s",
            self.engine.global_rank, seconds, self.engine.process_group_timeout.total_seconds(), self.report(),
        )

    def teardown(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def report(self) -> str:
        """Every rank's last step and phase, and which ranks are behind the furthest one."""
        store = self.store
        if store is None:
            return ""
        where: dict[int, tuple[int, int, int]] = {}
        names: dict[int, str] = {}
        for rank in range(self.engine.world_size):
            key = _KEY.format(rank=rank)
            try:
                if store.check([key]):
                    step, phase, count, names[rank] = store.get(key).decode().split(":")
                    where[rank] = (int(step), PHASES.index(phase), int(count))
            except (RuntimeError, ValueError):  # the store's host may be gone too
                continue
        if not where:
            return ""
        furthest = max(where.values())
        behind = [rank for rank in range(self.engine.world_size) if where.get(rank, (-1, -1, -1)) < furthest]
        parts = [
            f"rank {rank}: step {step}, {PHASES[phase]}" + (f", in its collective #{count} ({names[rank]})" if count else "")
            for rank, (step, phase, count) in sorted(where.items())
        ]
        missing = [rank for rank in range(self.engine.world_size) if rank not in where]
        if missing:
            parts.append(f"no progress recorded by rank(s) {missing}")
        return (
            "lightning_parallel: a collective timed out. Where each rank was (optimizer step, phase, the strategy's "
            "collectives in it): "
            + " · ".join(parts)
            + (f" — the rank(s) behind, which never reached the collective the others wait in: {behind}" if behind else "")
            + ". Look at what those ranks do at that point (data loading, a branch that skips the model, a deadlock)."
        )
