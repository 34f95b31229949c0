"""Helpers for campaign tests: the tiny CPU campaign's files, waiting on a campaign, and how many of
its members ran at once."""

from __future__ import annotations

from charllm.engine.campaign.state import Record
from charllm.probes.store.rundir import RunDir
from infra_runs import wait_for


def tiny_campaign(charllm_dirs, name: str = "tiny", *, iters: int = 6, max_parallel: int = 2,
                  target: str = "local", extra: str = "") -> str:
    """2 layouts x 3 micro batches of tiny-local (6 members), `max_parallel` at once."""
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.toml").write_text(
        'experiments = ["tiny-local"]\n[axes]\nmicro_batch_size = [1, 2, 4]\n'
        f"train_iters = [{iters}]\n[[layouts]]\ntensor_model_parallel_size = 1\n[[layouts]]\n"
        f'tensor_model_parallel_size = 2\n[target]\nname = "{target}"\nmax_parallel = {max_parallel}\n{extra}')
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
