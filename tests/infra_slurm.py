"""A real Slurm cluster on loopback for tests: munged, slurmctld and two slurmd "fake nodes"
(n1, n2 on 127.0.0.1, told apart by $SLURMD_NODENAME), as RECIPES describes.

Everything runs from a private temp dir with private ports and a private munge socket, is
stopped by PID and removed afterwards. Clients find it through $SLURM_CONF.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import infra_daemons as daemons
from infra_runs import stop_process, wait_for

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (slurmd, munged)"
    missing = [b for b in BINARIES if not shutil.which(b) and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return f"needs slurm-wlm and munge ({', '.join(missing)} not found)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "needs the munge user (apt-get install munge)"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    env: dict

    def scontrol(self, *args: str) -> str:
        return subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True).stdout

    def jobs(self) -> str:
        return subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env, capture_output=True,
                              text=True).stdout.strip()

    def cancel_all(self, timeout: float = 30) -> None:
        """Cancel every job, whole (steps and batch script), and wait until the queue is empty."""
        ids = [line.split()[0] for line in self.jobs().splitlines()]
        if ids:
            subprocess.run(["scancel", "--full", *ids], env=self.env, capture_output=True)
            deadline = time.monotonic() + timeout
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)


def _config(root: Path, ports: list[int]) -> str:
    return "\n".join([
        "ClusterName=charllmtest",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ports[0]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={root}/munge/munge.socket",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root}/jobcomp.txt",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
        "SlurmdParameters=config_overrides",
        "KillWait=30",  # Slurm's default: processes must stop on SIGTERM, not wait for its SIGKILL
        "MinJobAge=600",
        f"NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[{ports[1]}-{ports[2]}] "
        f"CPUs={CPUS_PER_NODE} Sockets=1 CoresPerSocket={CPUS_PER_NODE} ThreadsPerCore=1 RealMemory=4000 "
        "State=UNKNOWN",
        "PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP",
        ""])


def start_cluster(root: Path, cleanups: list) -> SlurmCluster:
    """Start munged, slurmctld and the slurmd nodes, appending a stop for each to `cleanups`."""
    munge = pwd.getpwnam("munge")
    (root / "munge").mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chown(root / "munge", munge.pw_uid, munge.pw_gid)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chown(key, munge.pw_uid, munge.pw_gid)
    os.chmod(key, 0o400)
    munged = subprocess.Popen(
        [_binary("munged"), "-F", f"--socket={root}/munge/munge.socket", f"--key-file={key}",
         f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/munge/munged.log",
         f"--seed-file={root}/munge/munged.seed"],
        user=munge.pw_uid, group=munge.pw_gid, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cleanups.append(lambda: stop_process(munged))
    wait_for(lambda: (root / "munge" / "munge.socket").exists(), 10, "munged")

    base = random.randint(20000, 60000 - 10)
    conf = root / "slurm.conf"
    conf.write_text(_config(root, [base, base + 1, base + 2]))
    (root / "state").mkdir()
    for node in NODES:
        (root / "spool" / node).mkdir(parents=True)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    log = open(root / "daemons.out", "ab")
    ctld = subprocess.Popen([_binary("slurmctld"), "-D", "-c", "-f", str(conf)], env=env, stdout=log, stderr=log)
    cleanups.append(lambda: stop_process(ctld))
    cluster = SlurmCluster(root=root, conf=conf, env=env)
    wait_for(lambda: "n1" in cluster.scontrol("show", "nodes"), 20, "slurmctld")
    for node in NODES:
        slurmd = subprocess.Popen([_binary("slurmd"), "-D", "-N", node, "-f", str(conf)], env=env,
                                  stdout=log, stderr=log)
        cleanups.append(lambda slurmd=slurmd: stop_process(slurmd))
    wait_for(lambda: cluster.scontrol("show", "nodes").count("State=IDLE") == len(NODES), 30, "idle nodes")
    cleanups.append(cluster.cancel_all)      # runs first: a failed test's job must not outlive its daemons
    return cluster


@pytest.fixture(scope="module")
def slurm_cluster():
    reason = skip_reason()
    if reason:
        daemons.missing(reason)
    # Not under pytest's tmp dir: that is private to root (0700) and munged runs as `munge`.
    root = Path(tempfile.mkdtemp(prefix="charllm-slurm-"))
    cleanups: list = [lambda: shutil.rmtree(root, ignore_errors=True)]
    saved = os.environ.get("SLURM_CONF")
    try:
        cluster = start_cluster(root, cleanups)
        os.environ["SLURM_CONF"] = str(cluster.conf)  # launch() and its supervisor use the clients
        yield cluster
    finally:
        for cleanup in reversed(cleanups):
            cleanup()
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
