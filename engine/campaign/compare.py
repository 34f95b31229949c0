"""Two campaigns side by side: the CharLLM-PPT study's scale-up against scale-out table (4 x 8 H200
against 8 x 8 H100, Go et al., MICRO'25), from two campaigns instead of a spreadsheet.

For every model both campaigns train, each campaign's best fitting member (by `metric`) with its
GPUs, tokens/s, tokens/s per GPU, energy per token and power (per GPU and in all). The predicted rows
come from the plans (the speed model, as `campaign report --predicted` reads them), before anything
runs; the measured rows from the members' completed runs (as `campaign summary` reads them), where a
campaign has run. Each row says which it is.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from charllm.engine.campaign import queue, spec, state
from charllm.engine.campaign.report import PLANNED, predicted_summary
from charllm.engine.campaign.summary import campaign_summary
from charllm.probes.core.errors import UserError

PREDICTED, MEASURED = "predicted", "measured"
# The figures a best member can be chosen by, and whether more is better (`campaign compare --help` names them).
METRICS = {"tokens_per_s": True, "tokens_per_s_per_gpu": True, "energy_per_token_j": False,
           "efficiency_samples_per_s_mj": True}
DEFAULT_METRIC = "tokens_per_s"
FIGURES = ("tokens_per_s", "tokens_per_s_per_gpu", "energy_per_token_j", "power_mean_w", "power_total_w",
           "efficiency_samples_per_s_mj")
UNREADY = {PREDICTED: "no member fits", MEASURED: "no member has a completed run"}
NOT_RUN = "not run"
SCHEMA = {"model": pl.String, "source": pl.String, "campaign": pl.String, "member": pl.Int64, "name": pl.String,
          "hardware": pl.String, "variant": pl.String, "layout": pl.String, "gpus": pl.Int64,
          **{f: pl.Float64 for f in FIGURES}, "ratio": pl.Float64, "why": pl.String}


def compare(first: str, second: str, metric: str = DEFAULT_METRIC, variant: str | None = None) -> pl.DataFrame:
    """One row per model both campaigns train, source (predicted, then measured where either has
    run) and campaign: its best member by `metric` (of the optimization `variant` only, when given)
    and its figures; `ratio` is that member's `metric` over the first campaign's (1 for the first's
    own row). A campaign with no member to pick has its row with `why` and no figures. Bad input (an
    unknown campaign, one campaign twice, no model in common, an unknown metric or variant) is one
    UserError."""
    if metric not in METRICS:
        raise UserError(f"--metric {metric!r}: expected one of {', '.join(METRICS)}")
    if variant is not None and variant not in spec.VARIANTS:
        raise UserError(f"--variant {variant!r}: expected one of {', '.join(map(repr, spec.VARIANTS))}")
    names = [spec.record_name(first), spec.record_name(second)]
    if names[0] == names[1]:
        raise UserError(f"campaign compare: {first!r} and {second!r} are the same campaign ({names[0]}); give two")
    campaigns = [spec.Campaign.load(ref) for ref in (first, second)]
    sources = [_sides(c, name) for c, name in zip(campaigns, names)]
    models = [list(dict.fromkeys(m["model"] for m in side[PREDICTED])) for side in sources]
    common = [m for m in models[0] if m in models[1]]
    if not common:
        raise UserError(f"campaigns {names[0]!r} ({', '.join(models[0])}) and {names[1]!r} ({', '.join(models[1])}) "
                        "have no model in common")
    rows = []
    kinds = [PREDICTED] + ([MEASURED] if any(side[MEASURED] != NOT_RUN for side in sources) else [])
    for model in common:
        for kind in kinds:
            best = [_best(side[kind], model, metric, kind, variant) for side in sources]
            base = best[0].get(metric)
            for name, row in zip(names, best):
                value = row.get(metric)
                rows.append({"model": model, "source": kind, "campaign": name, **row,
                             "ratio": value / base if value is not None and base else None})
    return pl.DataFrame(rows, schema=SCHEMA)


def _sides(campaign: spec.Campaign, name: str) -> dict[str, Any]:
    """The campaign's members with their figures: predicted (from its plans) and measured (from its
    record), or why there are none (NOT_RUN; a damaged record costs only these)."""
    plans = campaign.plan()
    ranks = {p.member.key: p.member.experiment.world_size for p in plans}
    planned = state.Record.new(campaign, plans, {}, include_oom=False, max_parallel=1)     # never saved
    out: dict[str, Any] = {
        PREDICTED: _members(planned, predicted_summary(planned, {p.member.key: p.member.experiment for p in plans}),
                            ranks, PLANNED), MEASURED: NOT_RUN}
    try:
        if (state.directory(name) / "campaign.json").exists():
            record = queue.refresh(state.Record.load(name))
            out[MEASURED] = _members(record, campaign_summary(record), ranks, "completed")
    except UserError:
        out[MEASURED] = f"its record is damaged (charllm-tui campaign status {name} says how)"
    return out


def _members(record: state.Record, summary: pl.DataFrame, ranks: dict, ready: str) -> list[dict]:
    """Each member's model, layout and figures, and whether it is one to pick (status `ready`). Its
    GPUs are those its run measured, else its plan's ranks (a CPU run has no GPU)."""
    out = []
    for m, row in zip(record.members, summary.iter_rows(named=True)):
        gpus = row.get("gpus") or ranks.get(m.get("key"))
        tokens, power = row.get("tokens_per_s"), row.get("power_mean_w")
        out.append({"model": m.get("model") or "?", "ready": row["status"] == ready, "member": m["index"] + 1,
                    "name": m["name"], "hardware": m.get("hardware"), "variant": m.get("variant"),
                    "layout": m.get("layout"),
                    "gpus": int(gpus) if gpus else None, "tokens_per_s": tokens,
                    "tokens_per_s_per_gpu": tokens / gpus if tokens is not None and gpus else None,
                    "energy_per_token_j": row.get("energy_per_token_j"), "power_mean_w": power,
                    "power_total_w": power * gpus if power is not None and gpus else None,
                    "efficiency_samples_per_s_mj": row.get("efficiency_samples_per_s_mj")})
    return out


def _best(members: list[dict] | str, model: str, metric: str, kind: str, variant: str | None) -> dict:
    """The best of `model`'s members (of `variant`) by `metric` (the first of equals), or why there is none
    (`members` itself, when it is that)."""
    if isinstance(members, str):
        return {"why": members}
    mine = [m for m in members if m["model"] == model and variant in (None, m["variant"])]
    if not mine:
        return {"why": f"no {variant} member" if variant else "no member of the model"}
    candidates = [m for m in mine if m["ready"] and m.get(metric) is not None]
    if not candidates:
        return {"why": UNREADY[kind] if not any(m["ready"] for m in mine) else f"no member has a {metric}"}
    more = METRICS[metric]
    best = max(candidates, key=lambda m: m[metric] if more else -m[metric])
    return {k: v for k, v in best.items() if k in SCHEMA}
