"""What a campaign shows, in sentences with their numbers (`campaign report NAME --findings`).

Each finding compares members that differ in one thing only: the micro batch, communication overlap,
activation recomputation, or the layout. Its numbers are `campaign summary`'s figures of the members'
completed runs, each pair named by its member numbers, so the summary reproduces every one. The last
finding sets the plans beside the measurements. A comparison whose figures the runs lack (CPU runs have
no power bursts) is left out, never guessed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

import polars as pl

from charllm.engine.campaign.spec import VARIANTS
from charllm.engine.campaign.state import Record, member_status
from charllm.engine.campaign.summary import campaign_summary
from charllm.probes.analysis.render import format_figure, metric_label
from charllm.probes.core.errors import plural

# The figures each comparison reads, in the order it says them (the paper's: bursts with the micro
# batch; speed and energy with overlap and recomputation).
BURSTS = ("power_p99_w", "power_max_rise_w_per_s", "spikes_over_limit_count", "time_over_limit_s",
          "throttle_sw_power_cap_frac")
SPEED = ("tokens_per_s", "energy_per_token_j")
SHOWN_CONTEXTS = 3      # pairs a line lists before it counts the rest (--format json has them all)


@dataclass(frozen=True)
class Pair:
    """Two members that differ in the finding's one thing: `before` (the reference) and `after`."""

    context: str                  # what they share, in words ("tiny-dense TP1 PP1 DP2")
    members: tuple[int, int]      # member numbers, as `campaign summary` numbers them
    values: tuple[float, float]

    @property
    def change_pct(self) -> float | None:
        before, after = self.values
        return 100 * (after / before - 1) if before else None

    def to_dict(self, metric: str) -> dict:
        return {"metric": metric, "context": self.context, "members": list(self.members),
                "values": list(self.values), "change_pct": self.change_pct}


@dataclass
class Finding:
    kind: str                     # micro_batch | overlap | recompute | layout | plan
    title: str
    lines: list[str] = field(default_factory=list)
    evidence: list[dict] = field(default_factory=list)

    @property
    def members(self) -> list[int]:
        return sorted({n for e in self.evidence for n in e["members"]})

    def to_dict(self) -> dict:
        return {"kind": self.kind, "title": self.title, "lines": self.lines, "members": self.members,
                "evidence": self.evidence}


def findings(record: Record, summary: pl.DataFrame | None = None) -> list[Finding]:
    """Every finding the campaign's completed members support, in the order above."""
    summary = campaign_summary(record) if summary is None else summary
    rows = {r["member"]: r for r in summary.to_dicts() if r["status"] == "completed"}
    members = [(m, rows[m["index"] + 1]) for m in record.members if m["index"] + 1 in rows]
    several_models = len({m.get("model") for m, _ in members}) > 1
    out = []
    for kind, one_thing, metrics in (("micro_batch", _micro_batch, ("tokens_per_s", *BURSTS)),
                                     ("overlap", _bit(1), SPEED), ("recompute", _bit(2), SPEED)):
        pairs = _pairs(members, one_thing, several_models)
        if pairs:
            finding = _compared(kind, pairs, metrics)
            if finding.lines:
                out.append(finding)
    out += [f for f in (_layouts(members, several_models), _plan(members)) if f is not None]
    return out


def describe(record: Record, found: list[Finding]) -> list[str]:
    """The findings as `campaign report --findings` prints them (and the Campaign screen shows them)."""
    done = sum(1 for m in record.members if member_status(record, m) == "completed")
    lines = [f"campaign {record.name}: {plural(len(found), 'finding')} from {done} of "
             f"{plural(len(record.members), 'member')} completed (numbers: campaign summary {record.name})"]
    if not found:
        lines.append("  none yet: a finding needs two completed members alike but for the micro batch, overlap, "
                     "recomputation or layout, or a plan beside a run")
    for n, f in enumerate(found, 1):
        lines.append(f"{n}. {f.title} (members {', '.join(map(str, f.members))})")
        lines += [f"   - {line}" for line in f.lines]
    return lines


# -- which members differ in one thing -------------------------------------------------------------------
Thing = Callable[[dict], tuple]   # a member -> (its value of the thing, what else it is, that in words)


def _micro_batch(m: dict) -> tuple:
    mbs = m.get("micro_batch_size")
    if not isinstance(mbs, int) or isinstance(mbs, bool):   # (a command's axis may hold any value)
        return None, (), []
    return mbs, _rest(m, "micro_batch_size", variant=m.get("variant")), [m.get("variant") or "",
                                                                         *_others(m, "micro_batch_size")]


def _bit(bit: int) -> Thing:
    """Overlap (1) or recomputation (2): one bit of the paper's variant code (spec.VARIANTS)."""
    def thing(m: dict) -> tuple:
        if m.get("variant") not in VARIANTS:
            return None, (), []
        code, mbs = VARIANTS.index(m["variant"]), m.get("micro_batch_size")
        other = code & ~bit    # the other bit, as the two members share it
        words = [f"micro batch {mbs}", *(["with " + VARIANTS[other]] if other else []), *_others(m, "micro_batch_size")]
        return bool(code & bit), _rest(m, "micro_batch_size", variant=other, micro_batch_size=mbs), words
    return thing


# settings the variant or the layout already says, and so not among a member's other settings
_SAID = ("overlap", "recompute", "parallel_size", "sequence_parallel")


def _others(m: dict, *varies: str) -> list[str]:
    """A member's varied settings besides the thing compared, its layout and its variant, as key=value."""
    return [f"{k}={v}" for k, v in sorted((k.split(".")[-1], str(v)) for k, v in m.get("varied", {}).items())
            if not any(word in k for word in (*_SAID, *varies))]


def _rest(m: dict, *varies: str, **known) -> tuple:
    """What a member is besides the thing compared: model, hardware, layout and its other settings."""
    return (m.get("model"), m.get("hardware"), m.get("layout"), *sorted(known.items()), tuple(_others(m, *varies)))


def _pairs(members: list[tuple[dict, dict]], thing: Thing, several_models: bool) -> dict[tuple, list]:
    """{(before, after): [(context, before's member and row, after's)]}: in each group of members alike
    but for the thing, the smallest value of it against the largest."""
    groups: dict[tuple, dict] = {}
    words: dict[tuple, list[str]] = {}
    for m, row in members:
        value, rest, said = thing(m)
        if value is not None:
            groups.setdefault(rest, {}).setdefault(value, (m, row))
            words[rest] = said
    out: dict[tuple, list] = {}
    for rest, by_value in groups.items():
        if len(by_value) < 2:
            continue
        low, high = min(by_value), max(by_value)
        m = by_value[low][0]
        context = ", ".join(w for w in (_context(m, several_models), *words[rest]) if w)
        out.setdefault((low, high), []).append((context, by_value[low], by_value[high]))
    return out


def _context(m: dict, several_models: bool) -> str:
    words = [m.get("model") or "?"] if several_models else []
    words.append(m.get("layout") or m["name"])
    return " ".join(words)


# -- the sentences -----------------------------------------------------------------------------------------
def _compared(kind: str, pairs: dict[tuple, list], metrics: tuple[str, ...]) -> Finding:
    finding = Finding(kind, "")
    titles = []
    for (low, high), found in pairs.items():
        titles.append(_title(kind, low, high))
        for metric in metrics:
            measured = [Pair(context, (a[0]["index"] + 1, b[0]["index"] + 1), (a[1][metric], b[1][metric]))
                        for context, a, b in found if a[1].get(metric) is not None and b[1].get(metric) is not None]
            if measured:   # (which comparison, where a campaign holds several: micro batch 2 and 4 against 1)
                finding.lines.append(_line(metric, measured, titles[-1] if len(pairs) > 1 else None))
                finding.evidence += [p.to_dict(metric) for p in measured]
    finding.title = "; ".join(dict.fromkeys(titles))
    return finding


def _title(kind: str, low, high) -> str:
    if kind == "micro_batch":
        return f"micro batch {high} against {low}"
    return f"with {kind} against without" if kind == "overlap" else "with full recomputation against without"


def _line(metric: str, pairs: list[Pair], which: str | None = None) -> str:
    """"tokens per second: +38% on TP1 PP1 DP2 (members 1 -> 3: 2,831 -> 3,905 tokens/s), ..."."""
    said = [f"{_signed(p.change_pct)} on {p.context} (members {p.members[0]} -> {p.members[1]}: "
            f"{format_figure(metric, p.values[0])} -> {format_figure(metric, p.values[1])})"
            for p in pairs[:SHOWN_CONTEXTS]]
    more = len(pairs) - SHOWN_CONTEXTS
    if more > 0:
        changes = [p.change_pct for p in pairs if p.change_pct is not None]
        said.append(f"and {more} more (median of all {_signed(statistics.median(changes))})" if changes
                    else f"and {more} more")
    return f"{metric_label(metric)}{f', {which}' if which else ''}: " + ", ".join(said)


def _signed(pct: float | None) -> str:
    """+1.5%; a change that rounds to nothing is +0.0%, never -0.0%."""
    return "n/a (from 0)" if pct is None else f"{round(pct, 1) + 0.0:+.1f}%"


def _layouts(members: list[tuple[dict, dict]], several_models: bool) -> Finding | None:
    """The fastest layout against the slowest, among members alike but for the layout."""
    groups: dict[tuple, list] = {}
    for m, row in members:
        if m.get("layout") and row.get("tokens_per_s") is not None:
            key = _rest({**m, "layout": None}, "micro_batch_size", variant=m.get("variant"),
                        micro_batch_size=m.get("micro_batch_size"))
            groups.setdefault(key, []).append((m, row))
    finding = Finding("layout", "the fastest layout against the slowest")
    for found in groups.values():
        if len({m["layout"] for m, _ in found}) < 2:
            continue
        slow = min(found, key=lambda p: p[1]["tokens_per_s"])
        fast = max(found, key=lambda p: p[1]["tokens_per_s"])
        where = f"{fast[0].get('model') or '?'}, " if several_models else ""
        pair = Pair(f"{where}{fast[0]['layout']} against {slow[0]['layout']}",
                    (slow[0]["index"] + 1, fast[0]["index"] + 1),
                    (slow[1]["tokens_per_s"], fast[1]["tokens_per_s"]))
        finding.lines.append(f"{pair.context}: {_signed(pair.change_pct)} tokens per second (members "
                             f"{pair.members[0]} -> {pair.members[1]}: {format_figure('tokens_per_s', pair.values[0])}"
                             f" -> {format_figure('tokens_per_s', pair.values[1])})")
        finding.evidence.append(pair.to_dict("tokens_per_s"))
    return finding if finding.lines else None


def _plan(members: list[tuple[dict, dict]]) -> Finding | None:
    """How far the plans were from the measurements: the mean error and the worst member."""
    finding = Finding("plan", "predicted against measured")
    for error, planned, what in (("step_error_pct", "planned_step_s", "step time"),
                                 ("power_error_pct", "planned_power_w", "mean power")):
        errors = [(m["index"] + 1, row[error], row[planned]) for m, row in members if row.get(error) is not None]
        if not errors:
            continue
        worst = max(errors, key=lambda e: abs(e[1]))
        finding.lines.append(f"{what}: the plans were off by {statistics.mean(abs(e) for _, e, _ in errors):.1f}% "
                             f"on average over {len(errors)} members, at most {_signed(worst[1])} (member {worst[0]})")
        finding.evidence += [{"metric": error, "members": [n], "values": [value], "planned": plan}
                             for n, value, plan in errors]
    return finding if finding.lines else None
