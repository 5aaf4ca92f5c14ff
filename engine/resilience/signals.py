"""Preemption: SIGTERM / SIGUSR1 ask the run to save and stop after the current step.

Schedulers (SLURM with `--signal`, Kubernetes, spot reclaim) send SIGTERM or SIGUSR1 some time before
they kill the job. The handler only records the request; the training loop finishes its step, writes an
emergency checkpoint and raises `Preempted`, which the CLI turns into exit code `PREEMPTED_EXIT` so the
job script can requeue. A watchdog started with the first signal ends the process with
`SHUTDOWN_TIMEOUT_EXIT` if that takes longer than `train.shutdown_timeout_sec` (a save cut short leaves
no COMPLETE marker, so the next run resumes from the checkpoint before it). Further signals while saving
are ignored: they cannot interrupt the save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later" — the emergency checkpoint is on disk
SHUTDOWN_TIMEOUT_EXIT = 76  # the save did not finish in time; the run resumes from the previous checkpoint
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

log = logging.getLogger("forge.resilience")


class Preempted(Exception):
    """The run stopped on a preemption signal after saving at `step`."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None) -> None:
        super().__init__(f"stopped by {signal_name} at step {step}; checkpoint {checkpoint}")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class StopRequest:
    """Records the first preemption signal and arms the shutdown watchdog."""

    def __init__(self, shutdown_timeout_sec: float, force_exit: Callable[[int], None] = os._exit) -> None:
        self.timeout = shutdown_timeout_sec
        self.force_exit = force_exit
        self.signal_name: str | None = None
        self.watchdog: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def handle(self, signum: int, frame: object = None) -> None:
        if self.signal_name is not None:
            log.warning("%s received while already stopping; ignored", signal.Signals(signum).name)
            return
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: saving a checkpoint after this step, then stopping", self.signal_name)
        self.watchdog = threading.Timer(self.timeout, self.expire)
        self.watchdog.daemon = True
        self.watchdog.start()

    def expire(self) -> None:
        log.error("shutdown took longer than train.shutdown_timeout_sec = %s s; exiting now", self.timeout)
        for handler in logging.getLogger("forge").handlers + log.handlers:
            handler.flush()
        self.force_exit(SHUTDOWN_TIMEOUT_EXIT)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle the signals while the block runs (only the main thread may install handlers)."""
        if threading.current_thread() is not threading.main_thread():
            log.info("not in the main thread: preemption signals keep their default handling")
            yield self
            return
        previous = {sig: signal.signal(sig, self.handle) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.watchdog is not None:
                self.watchdog.cancel()
                self.watchdog.join()
