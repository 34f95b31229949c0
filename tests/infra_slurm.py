"""A real Slurm cluster on loopback for tests: munged, slurmctld and two slurmd "fake nodes"
(n1, n2 on 127.0.0.1, told apart by $SLURMD_NODENAME), as RECIPES describes.

Everything runs from a private temp dir with private ports and a private munge socket, is
stopped by PID and removed afterwards. Clients find it through $SLURM_CONF.
"""

from __future__ import annotations

import os
import pwd
import random
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import infra_daemons as daemons
from charllm.engine.launch.slurmctl import PACE_ENV
from infra_runs import stop_process, wait_for

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "sacct", "sdiag")
# The followers' pace in the tests (engine.launch.slurmctl.Pace: min, max interval, client timeout, in
# seconds): Slurm is asked every 0.5 s at most, backing off to 4 s, so a test sees a job's end within
# seconds; the real pace (one call per 10 s at most) is measured by benchmarks/bench_slurm_load.py.
TEST_PACE = "0.5,4,8"
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
    controller: subprocess.Popen | None = None

    def stop_controller(self) -> None:
        """Stop slurmctld (SIGTERM: it saves its state), as a controller restart or failure does;
        the nodes' slurmd and the jobs go on."""
        assert self.controller is not None
        stop_process(self.controller)

    def start_controller(self) -> None:
        """Start slurmctld again from its saved state (no -c): the jobs it ran are still its own."""
        log = open(self.root / "daemons.out", "ab")
        self.controller = subprocess.Popen([_binary("slurmctld"), "-D", "-f", str(self.conf)], env=self.env,
                                           stdout=log, stderr=log)
        wait_for(lambda: "n1" in self.scontrol("show", "nodes"), 30, "slurmctld to answer again")

    def rpc_counts(self) -> dict[str, int]:
        """sdiag's count of each RPC the controller served since its last reset (`sdiag -r`)."""
        out = subprocess.run(["sdiag"], env=self.env, capture_output=True, text=True).stdout
        part = out.split("Remote Procedure Call statistics by message type", 1)[-1].split("by user", 1)[0]
        counted = re.finditer(r"((?:REQUEST|MESSAGE)_\w+)\s+\(\s*\d+\)\s+count:(\d+)", part)
        return {m.group(1): int(m.group(2)) for m in counted}

    def reset_rpc_counts(self) -> None:
        subprocess.run(["sdiag", "--reset"], env=self.env, capture_output=True)

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
    cluster = SlurmCluster(root=root, conf=conf, env=env, controller=ctld)
    cleanups.append(lambda: cluster.controller and stop_process(cluster.controller))   # (a restarted one)
    wait_for(lambda: "n1" in cluster.scontrol("show", "nodes"), 60, "slurmctld")   # (over 20 s once at load 10)
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
    saved = {name: os.environ.get(name) for name in ("SLURM_CONF", PACE_ENV)}
    try:
        cluster = start_cluster(root, cleanups)
        os.environ["SLURM_CONF"] = str(cluster.conf)  # launch() and its supervisor use the clients
        os.environ[PACE_ENV] = TEST_PACE
        yield cluster
    finally:
        for cleanup in reversed(cleanups):
            cleanup()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- fault injection: Slurm's clients as a busy controller answers them ------------------------------
# Each wrapper, first on PATH, takes the next line of its client's plan (FAULTS/<client>.plan) and
# acts it out, else runs the real client; every fault it injects is one line of FAULTS/injected.
# Inside a job ($SLURM_JOB_ID: the batch script's own scontrol calls) the real client always runs:
# the faults are the login node's.
FAULT_KINDS = {
    # the controller timed out (the client's own message) or could not be reached
    "fail": 'echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1',
    "unreachable": 'echo "$NAME: error: Unable to contact slurm controller (connect failure)" >&2; exit 1',
    # no answer at all: the caller's own time limit ends it
    "hang": "sleep 3600",
    # output that is not the client's: random bytes, nothing, or the real answer cut short
    "garbage": "head -c 600 /dev/urandom | base64; exit 0",
    "empty": "exit 0",
    "truncate": '"$REAL" "$@" | head -c 120; exit 0',
    # sbatch: a refusal (a policy), and a submission whose answer was lost (the job exists)
    "refuse": 'echo "sbatch: error: Batch job submission failed: Invalid qos specification" >&2; exit 1',
    "lost": '"$REAL" "$@" >/dev/null 2>&1; echo "sbatch: error: Batch job submission failed: Socket timed out on '
            'send/recv operation" >&2; exit 1',
}
WRAPPER = """#!/bin/bash
NAME={name}
REAL={real}
FAULTS={faults}
[ -z "$SLURM_JOB_ID" ] || exec "$REAL" "$@"
exec 9>>"$FAULTS/lock"
flock 9
fault=$(head -n 1 "$FAULTS/$NAME.plan" 2>/dev/null)
[ -n "$fault" ] && sed -i 1d "$FAULTS/$NAME.plan"
[ -n "$fault" ] && [ "$fault" != ok ] && echo "$(date +%s%N) $NAME $fault $*" >> "$FAULTS/injected"
flock -u 9
exec 9>&-
case "$fault" in
{cases}
*) exec "$REAL" "$@" ;;
esac
"""


@dataclass
class Faults:
    """Fault-injecting wrappers of Slurm's clients in `folder`, first on the PATH of what is started."""

    folder: Path

    def plan(self, client: str, faults: list[str]) -> None:
        """Append to `client`'s plan: one entry a call ("ok": the real client)."""
        with open(self.folder / f"{client}.plan", "a") as fh:
            fh.writelines(f"{fault}\n" for fault in faults)

    def injected(self) -> list[str]:
        """Each fault injected so far: "CLIENT FAULT ARGS"."""
        path = self.folder / "injected"
        return [line.split(" ", 1)[1] for line in path.read_text().splitlines()] if path.exists() else []

    def clear(self) -> None:
        for plan in self.folder.glob("*.plan"):
            plan.unlink()


def fault_wrappers(folder: Path, clients=("scontrol", "sbatch", "sacct", "scancel")) -> Faults:
    """Write the wrappers into folder/bin (put it first on PATH) and return their plans' keeper."""
    (folder / "bin").mkdir(parents=True)
    cases = "\n".join(f"{kind}) {action} ;;" for kind, action in FAULT_KINDS.items())
    for client in clients:
        wrapper = folder / "bin" / client
        wrapper.write_text(WRAPPER.format(name=client, real=_binary(client), faults=folder, cases=cases))
        wrapper.chmod(0o755)
    return Faults(folder)
