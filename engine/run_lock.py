"""One process at a time writes a run directory.

On a shared cluster the same run can be started twice: a requeued job while the old one still drains, or a
`forge resume` typed while the job is running. Two writers would interleave metrics and race on the
checkpoints. Rank 0 therefore holds an advisory POSIX record lock (`lockf`) on `RUN_DIR/.forge.lock` for
the whole run. The kernel drops it when the process ends in any way (SIGKILL included), so a lock never
outlives its run and there is nothing to clean up after a crash. A record lock belongs to the process, not
to the descriptor: data-loader workers forked from rank 0 do not inherit it (with `flock` they would, and
keep it for seconds after their parent was killed), and network file systems support it. The file says
who holds it, for the error a second writer gets. On a file system without locks the run goes on, with a
warning.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from engine.errors import UserError

LOCK_FILE = ".forge.lock"

log = logging.getLogger("forge.run_lock")


class RunLock:
    """The lock on a run directory, held until `release()` (or the end of the process)."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock | None:
        """Lock `run_dir` (which must exist); None where the file system cannot lock. Raises `UserError`
        naming the holder when another process has it."""
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.read(fd, 512).decode(errors="replace").strip()
            os.close(fd)
            if err.errno in (errno.EACCES, errno.EAGAIN):
                raise UserError(
                    f"{run_dir} is being written by another forge process ({holder or 'holder unknown'})",
                    "wait for that run to end or stop it, or give this one another --run-dir",
                ) from None
            log.warning("cannot lock %s (%s): a second process writing this run would go unnoticed", path, err)
            return None
        os.ftruncate(fd, 0)
        os.write(
            fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode()
        )
        return cls(fd)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None
