"""Helpers for campaign tests: the tiny CPU campaign's files, waiting on a campaign, and how many of
its members ran at once."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

from charllm.engine.campaign.state import Record
from charllm.probes.store.rundir import RunDir
from infra_runs import wait_for


def tiny_campaign(charllm_dirs, name: str = "tiny", *, iters: int = 6, max_parallel: int = 2,
                  target: str = "local", extra: str = "", micro_batches=(1, 2, 4), layouts=(1, 2)) -> str:
    """len(layouts) tensor-parallel sizes x len(micro_batches) micro batches of tiny-local (by default
    2 x 3: 6 members), `max_parallel` at once."""
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.toml").write_text(
        f'experiments = ["tiny-local"]\n[axes]\nmicro_batch_size = {list(micro_batches)}\ntrain_iters = [{iters}]\n'
        + "".join(f"[[layouts]]\ntensor_model_parallel_size = {tp}\n" for tp in layouts)
        + f'[target]\nname = "{target}"\nmax_parallel = {max_parallel}\n{extra}')
    return name


def record(name: str) -> Record:
    from charllm.engine.campaign.queue import refresh

    return refresh(Record.load(name))


def wait_until(name: str, predicate, timeout: float, what: str) -> Record:
    """The campaign's record once `predicate` holds for it (one may not be written yet)."""
    from charllm.probes.core.errors import UserError

    def ready():
        try:
            r = record(name)
        except UserError:   # not written yet
            return None
        return r if predicate(r) else None
    return wait_for(ready, timeout, f"campaign {name}: {what}")


def runs_of(rec: Record) -> list[RunDir]:
    return [rec.run_dir(m) for m in rec.members if m.get("run")]


def most_at_once(rec: Record) -> int:
    """The most member runs that ran at one moment (from their manifests' start and end: a Slurm
    member is created when it is queued, and starts when its job does)."""
    spans = []
    for rd in runs_of(rec):
        m = rd.manifest()
        if m.started_ns and m.ended_ns:
            spans.append((m.started_ns, m.ended_ns))
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    alive = best = 0
    for _, step in events:
        alive += step
        best = max(best, alive)
    return best


# -- hostile records (issue 35): what a reader finds planted in the runs directory -----------------
def plant_record(runs, name: str, members: list[dict], *, status: str = "running", folder=None, **fields) -> Path:
    """Write campaign `name`'s record as someone else could have (no supervisor, made long ago) into
    `folder` (default <runs>/.campaigns/NAME); each member a dict of the fields it overrides."""
    folder = Path(folder) if folder is not None else Path(runs) / ".campaigns" / name
    folder.mkdir(parents=True, exist_ok=True)
    base = {"key": "", "name": "m", "base": "tiny-local", "layout": "TP1 PP1 DP2", "varied": {}, "verdict": "fits",
            "reason": "", "planned": None, "status": "queued", "run": None, "runs": [], "failure": None,
            "started_ns": None, "ended_ns": None}
    record = {"name": name, "source": "planted", "description": "", "target": {"kind": "local", "name": "local"},
              "max_parallel": 1, "time_limit_s": None, "include_oom": False, "status": status, "created_ns": 1,
              "started_ns": 1, "ended_ns": None, "supervisor": {},
              "members": [{**base, "index": i, "key": str(i), **m} for i, m in enumerate(members)], **fields}
    (folder / "campaign.json").write_text(json.dumps(record))
    return folder


@contextlib.contextmanager
def forged_run(path):
    """A run directory at `path` that says it is running, owned by a supervisor that died, and whose
    recorded process is a real `sleep` this test started (its true identity, copied from /proc):
    what a reader that acted on it would kill. Yields the victim, reaped at the end."""
    from charllm.probes.core import procid
    from charllm.probes.store.rundir import RunDir

    dead = subprocess.Popen(["sleep", "60"])
    supervisor = procid.identify(dead.pid)
    dead.kill()
    dead.wait()
    victim = subprocess.Popen(["sleep", "600"], start_new_session=True)   # a group leader, as a run's step is
    try:
        rd = RunDir.create(Path(path), "launch")
        step = {**procid.identify(victim.pid), "pgid": victim.pid, "node": "n0"}
        rd.write_manifest({"id": rd.id, "kind": "train", "status": "running", "created_ns": 1, "started_ns": 1,
                           "target": {"kind": "local", "name": "local"}, "supervisor": supervisor,
                           "launched_from": supervisor, "processes": [step]})
        yield victim
    finally:
        victim.kill()
        victim.wait()
