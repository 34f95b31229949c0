"""A campaign's execution, on disk: which member ran as which run, and how it ended.

    <runs>/.campaigns/<name>/
        campaign.json     the record below (rewritten atomically)
        supervisor.log    the campaign supervisor's output

It lives beside the runs it names, so every login node sharing the runs directory sees it (a
hidden name: run listings and the DuckDB glob pass it by). A member's own run is a run like any
other, whose manifest says which campaign and member it is; the record holds the member's planned
verdict and final status, so a summary of a campaign never depends on reading every run's files.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from charllm.engine.campaign.spec import Campaign, Plan, check_name, variant
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError, plural
from charllm.probes.core.files import read_bounded
from charllm.probes.core.formatting import clock, duration
from charllm.probes.store.rundir import FINAL_STATUSES, RunDir, write_json_atomic

# A member's statuses: waiting in the queue, its run's own statuses, or never run.
QUEUED, SKIPPED, INVALID = "queued", "skipped", "invalid"
DONE = (*FINAL_STATUSES, SKIPPED, INVALID)          # a member in one of these needs nothing more
MAX_RECORD_BYTES = 64 * 2**20


def root() -> Path:
    return paths.runs_dir() / ".campaigns"


@dataclass
class Record:
    """One campaign's execution record (campaign.json), as a plain dict kept in `data`."""

    path: Path
    data: dict

    @classmethod
    def new(cls, campaign: Campaign, plans: list[Plan], target: dict, *, include_oom: bool,
            max_parallel: int) -> "Record":
        members = []
        for p in plans:
            m = p.member
            status = QUEUED if p.runnable or (include_oom and p.verdict != "invalid") else \
                INVALID if p.verdict == "invalid" else SKIPPED
            varied = {k: v for k, v in m.varied.items() if k in campaign.varying}
            exp = m.experiment
            members.append({"index": m.index, "key": m.key, "name": exp.name, "base": m.base,
                            "model": exp.model.name, "hardware": exp.hardware.name, "layout": exp.layout_label,
                            "variant": variant(exp, m.base), "micro_batch_size": exp.training.micro_batch_size,
                            "varied": varied, "verdict": p.verdict, "reason": p.reason, "planned": p.planned,
                            "status": status, "run": None, "runs": [], "failure": None,
                            "started_ns": None, "ended_ns": None})
        data = {"name": campaign.name, "source": campaign.source, "description": campaign.description,
                "target": target, "max_parallel": max_parallel, "time_limit_s": campaign.time_limit_s,
                "include_oom": include_oom, "status": "pending", "created_ns": time.time_ns(),
                "started_ns": None, "ended_ns": None, "supervisor": {}, "members": members}
        return cls(directory(campaign.name) / "campaign.json", data)

    @classmethod
    def load(cls, name: str) -> "Record":
        """The record of campaign `name`'s execution; one line if it never ran or is damaged."""
        path = directory(name) / "campaign.json"
        try:
            data = json.loads(read_bounded(path, MAX_RECORD_BYTES, "campaign record"))
        except FileNotFoundError:
            raise UserError(f"campaign {name!r} has not run (charllm-tui campaign run {name} --target T)") from None
        except (ValueError, RecursionError):
            raise UserError(f"{path}: damaged campaign record, not valid JSON") from None
        except OSError as exc:
            raise UserError(f"{path}: cannot read the campaign record ({exc.strerror})") from None
        if not isinstance(data, dict) or not isinstance(data.get("members"), list) or \
                not all(isinstance(m, dict) for m in data["members"]):
            raise UserError(f"{path}: damaged campaign record, not a campaign's")
        return cls(path, data)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.data)

    # -- reading -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def members(self) -> list[dict]:
        return self.data["members"]

    def run_dir(self, member: dict) -> RunDir | None:
        return RunDir(paths.runs_dir() / member["run"]) if member.get("run") else None

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.members:
            out[m["status"]] = out.get(m["status"], 0) + 1
        return out

    @property
    def finished(self) -> bool:
        return all(m["status"] in DONE for m in self.members)

    def progress(self, now_ns: int | None = None) -> str:
        """One line: members by status, and the time left at the current pace."""
        counts = self.counts()
        done = sum(counts.get(s, 0) for s in FINAL_STATUSES)
        order = ("completed", "running", QUEUED, "failed", "cancelled", SKIPPED, INVALID)
        parts = [f"{counts[s]:,} {s}" for s in order if counts.get(s)]
        line = f"{self.name}: {plural(len(self.members), 'member')} ({', '.join(parts)})"
        left = self.time_left(now_ns)
        if left is not None:
            line += f"; about {duration(left, 0)} left at the current pace"
        elif self.data.get("status") in FINAL_STATUSES and done:
            line += f"; {self.data['status']} at {clock(self.data.get('ended_ns'))}"
        return line

    def time_left(self, now_ns: int | None = None) -> float | None:
        """Seconds until the queue is through at the pace of the members finished so far (None
        before one has finished, or when nothing is left)."""
        took = [(m["ended_ns"] - m["started_ns"]) / 1e9 for m in self.members
                if m["status"] in FINAL_STATUSES and m.get("started_ns") and m.get("ended_ns")]
        left = [m for m in self.members if m["status"] not in DONE]
        if not took or not left:
            return None
        now = now_ns or time.time_ns()
        running = [(now - m["started_ns"]) / 1e9 for m in left if m.get("started_ns")]
        mean = sum(took) / len(took)
        queued = len(left) - len(running)
        lanes = max(1, int(self.data.get("max_parallel") or 1))
        return max(0.0, sum(max(0.0, mean - r) for r in running) / lanes + queued * mean / lanes)


def directory(name: str) -> Path:
    return root() / check_name(name)


def recorded() -> list[str]:
    """The names of the campaigns that have a record here."""
    base = root()
    return sorted(d.name for d in base.iterdir() if (d / "campaign.json").is_file()) if base.is_dir() else []


def member_status(record: Record, member: dict) -> str:
    """A member's status as its run says it now (a running member's run may have ended since the
    record was written)."""
    rd = record.run_dir(member)
    if rd is None or member["status"] in DONE:
        return member["status"]
    try:
        return rd.manifest().status
    except UserError:
        return member["status"]
