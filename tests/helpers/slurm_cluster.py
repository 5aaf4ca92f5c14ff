"""A real single-node SLURM cluster for the `slurm` tests: slurmctld + slurmd + munged on 127.0.0.1.

Needs root and apt (Debian's packages: slurmctld, slurmd, slurm-client, munge; installed without recommends,
which would pull in ~40 unneeded plugin packages). No systemd and no cgroups: the daemons fork themselves,
track job processes through /proc, and are stopped at the end by the PIDs in their pid files, never by name.
munged is shared by the whole machine; it is started only if none answers and then stopped with the cluster.

    python -m tests.helpers.slurm_cluster up DIR     # prints `export SLURM_CONF=DIR/slurm.conf`
    python -m tests.helpers.slurm_cluster down DIR
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN = Path("/run/munge")


class ClusterUnavailable(Exception):
    """This machine cannot host the test cluster (not root, no apt): the tests skip, except under CI."""


def can_host() -> str | None:
    """Why this machine cannot host the cluster, or None if it can."""
    if os.geteuid() != 0:
        return "the SLURM test cluster needs root (it installs Debian packages and starts daemons)"
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return "the SLURM test cluster needs apt-get to install slurmctld, slurmd, slurm-client and munge"
    return None


def run(*cmd: str, user: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    if user is not None:
        cmd = ("runuser", "-u", user, "--", *cmd)
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)


def install_packages() -> None:
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run("apt-get", "update", "-qq", env=env, timeout=600)
    run("apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES, env=env, timeout=600)


def munge_answers() -> bool:
    cred = subprocess.run(["munge", "-n"], capture_output=True)
    return cred.returncode == 0 and subprocess.run(["unmunge"], input=cred.stdout, capture_output=True).returncode == 0


def start_munge() -> bool:
    """Make sure munged answers; True when this call started it. It refuses to run as root (its log directory
    belongs to user munge), and without systemd nobody creates its socket directory."""
    if munge_answers():
        return False
    if not MUNGE_KEY.exists() or MUNGE_KEY.stat().st_size == 0:
        run("mungekey", "--create", f"--keyfile={MUNGE_KEY}", user="munge")
    run("install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", str(MUNGE_RUN))
    try:
        run("/usr/sbin/munged", user="munge")
    except subprocess.CalledProcessError as err:  # another process's munged came up meanwhile: use it
        with contextlib.suppress(RuntimeError):
            wait_for(munge_answers, 10, "")
            return False
        raise RuntimeError(f"munged did not start: {err.stderr.strip()}") from err
    wait_for(munge_answers, 10, "munged did not answer")
    return True


def wait_for(ready, seconds: float, failure: str) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.1)


def slurm_conf(base: Path) -> str:
    """One node named as `hostname -s` (slurmd insists), reached on 127.0.0.1 so no name lookup is needed,
    with the CPUs and memory slurmd detects; requeue allowed, and soon restarted; jobs start as soon as they
    are submitted."""
    host = socket.gethostname().split(".")[0]
    node = run("slurmd", "-C").stdout.splitlines()[0]
    return "\n".join(
        [
            "ClusterName=forgetest",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            # A requeued job waits for its old credentials to expire before it may start again (120 s by default;
            # started sooner, SLURM kills it: "Job credential revoked"); 10 s keeps the requeue tests short.
            "AuthInfo=cred_expire=10",
            f"StateSaveLocation={base}/state",
            f"SlurmdSpoolDir={base}/spool",
            f"SlurmctldPidFile={base}/slurmctld.pid",
            f"SlurmdPidFile={base}/slurmd.pid",
            f"SlurmctldLogFile={base}/slurmctld.log",
            f"SlurmdLogFile={base}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MailProg=/bin/true",
            "JobRequeue=1",
            "ReturnToService=2",
            "SlurmdTimeout=10",
            "KillWait=5",
            "MinJobAge=600",
            "SchedulerParameters=batch_sched_delay=0",
            f"{node} NodeAddr=127.0.0.1 State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


class Cluster:
    """A started cluster; `env` is what a client needs (SLURM_CONF)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.conf = base / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.started_munge = False

    def start(self) -> Cluster:
        install_packages()
        self.started_munge = start_munge()
        for sub in ("state", "spool"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(slurm_conf(self.base))
        run("/usr/sbin/slurmctld", "-f", str(self.conf), env=self.env)
        run("/usr/sbin/slurmd", "-f", str(self.conf), env=self.env)
        wait_for(self.node_idle, 30, f"the node did not become idle; see {self.base}/slurmctld.log and slurmd.log")
        return self

    def node_idle(self) -> bool:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env).stdout
        return states.strip() == "idle"

    def stop(self) -> None:
        pid_files = [self.base / "slurmd.pid", self.base / "slurmctld.pid"]
        if self.started_munge:
            pid_files.append(MUNGE_RUN / "munged.pid")
        for pid_file in pid_files:
            if pid_file.exists() and pid_file.read_text().strip():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)


def main(argv: list[str]) -> None:
    action, base = argv[0], Path(argv[1]).resolve()
    cluster = Cluster(base)
    if action == "up":
        if reason := can_host():
            sys.exit(reason)
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        cluster.started_munge = False  # shared by the machine: left running
        cluster.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
