"""The CharLLM-PPT artifact's results as a campaign: each imported run gets the experiment it ran,
and the tree becomes a campaign record, so `campaign summary` and `campaign report` read the
paper's own data.

The artifact writes each run to `results/<sweep>/<model>/<model>_<layout>_<variant>/`
(scripts/experiments/*/<model>/main/parallel_<layout>/*.sh, ZEUS_CSV_PATH): `<sweep>` is
`optimization-sweep-h200`, `-h100` (and `-fsdp`), or `microbatch-sweep-h200` (`-fsdp`), whose runs are
named `<model>_<layout>_mbs<N>` and ran with recomputation (`01000`) at micro batch N. That is the
shipped preset `ppt-<gpu>-<model>-<layout>-<variant>` (tools/generate_ppt_experiments.py).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from charllm.engine.campaign import state
from charllm.engine.campaign.spec import VARIANTS, Member, campaigns, check_name, plan_member, variant
from charllm.engine.campaign.state import Record, directory
from charllm.engine.model import catalog
from charllm.engine.model.experiment import Experiment
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir

_SWEEP = re.compile(r"^(?P<kind>optimization|microbatch)-sweep-(?P<gpu>h200|h100)(?:-fsdp)?$")
_RUN = re.compile(r"^(?P<model>[a-z0-9.-]+)_(?P<layout>\d+)_(?:(?P<code>[01]{5})|mbs(?P<mbs>\d+))$")
# The artifact's figure scripts (scripts/visualization/figure_4.py: 'EP4-TP2-PP1': 1, 'EP8-TP1-PP1': 2)
# number the two H200 Mixtral 8x7B layouts the other way round from its YAML files (layout 1:
# tensor_model_parallel_size 1, expert_model_parallel_size 8), which are what ran.
MIXTRAL_LABELS = ("mixtral-8x7b layouts follow the artifact's YAML files, which are what ran (layout 1: TP1 EP8, "
                  "layout 2: TP2 EP4); its figure scripts number them the other way round (figure_4.py)")


def experiment_for(folder: Path) -> tuple[Experiment, str] | None:
    """The experiment an artifact run folder ran (`results/<sweep>/<model>/<run>`), and the preset
    it comes from; None for a folder that names none of the artifact's runs."""
    parts = Path(folder).parts[-3:]
    if len(parts) != 3:
        return None
    sweep, model, name = parts
    s, r = _SWEEP.match(sweep), _RUN.match(name)
    if not s or not r or r["model"] != model:
        return None
    preset = f"ppt-{s['gpu']}-{model}-{r['layout']}-{r['code'] or '01000'}"
    if preset not in catalog.entries("experiments"):
        return None
    exp = Experiment.load(preset)
    if r["mbs"]:
        exp.set("micro_batch_size", int(r["mbs"]))
        exp.name = f"{preset}-mbs{r['mbs']}"
    return exp, preset


def attach(run: RunDir, folder: Path) -> str | None:
    """Give an imported run the experiment its folder names (experiment.toml, and the manifest's
    `experiment`); returns the preset, or None where the folder names none."""
    found = experiment_for(folder)
    if found is None:
        return None
    exp, preset = found
    exp.save(run.experiment_path)
    notes = list(run.read_manifest().get("notes") or [])
    if exp.model.name == "mixtral-8x7b":
        notes.append(MIXTRAL_LABELS)
    run.update_manifest(experiment=preset, name=exp.name, notes=notes)
    return preset


def record_tree(name: str, root: Path, imported: list[tuple[Path, RunDir]]) -> Record:
    """An imported results tree as a finished campaign: one member per imported run. Its record
    folder is made here, never one that exists (campaign_name chose a free name)."""
    state.root().mkdir(parents=True, exist_ok=True)
    try:
        directory(name).mkdir()
    except FileExistsError:
        raise UserError(f"campaign {name!r}: its record was made meanwhile by another; import again") from None
    members = []
    for index, (folder, run) in enumerate(imported):
        manifest = run.manifest()              # "failed" for a crash (importers.MIN_SAMPLES)
        found = experiment_for(folder)
        exp = found[0] if found else None
        base = found[1] if found else folder.name
        members.append({
            "index": index, "key": str(folder), "name": exp.name if exp else run.id, "base": base,
            "model": exp.model.name if exp else None, "hardware": exp.hardware.name if exp else None,
            "layout": exp.layout_label if exp else None, "variant": variant(exp, base) if exp else None,
            "micro_batch_size": exp.training.micro_batch_size if exp else None,
            "varied": _varied(folder), "verdict": None, "reason": "", "status": manifest.status, "run": run.id,
            "planned": plan_member(Member(index, base, {}, {}, exp)).planned if exp else None,
            "runs": [], "failure": manifest.failure, "started_ns": manifest.started_ns,
            "ended_ns": manifest.ended_ns})
    now = time.time_ns()
    record = Record(directory(name) / "campaign.json", {
        "name": name, "source": f"import:{root}", "description": f"imported from {root}", "target": {},
        "max_parallel": 1, "time_limit_s": None, "include_oom": False, "status": "completed", "created_ns": now,
        "started_ns": now, "ended_ns": now, "supervisor": {}, "members": members})
    record.data.update(state.outcome(record))     # failed where a folder was a crash
    record.save()
    return record


def _varied(folder: Path) -> dict:
    """What a run folder's name says it varies: its variant, or its micro batch size."""
    r = _RUN.match(Path(folder).name)
    if not r:
        return {}
    if r["mbs"]:
        return {"micro_batch_size": int(r["mbs"])}
    code = r["code"]
    return {"variant": VARIANTS[int(code[0]) + 2 * int(code[1])]}


def campaign_name(root: Path, name: str | None) -> tuple[str, str]:
    """The campaign an imported tree becomes, and a note when it is not the name asked for: --name,
    else the tree's folder name, made a valid name. A name a campaign has (a record, or a campaign
    file) is never taken over: --name's is refused, and the folder's becomes the first free NAME-2,
    NAME-3, ..."""
    text = name or Path(root).expanduser().resolve().name
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip(".-")[:64] or "imported"
    try:
        text = check_name(text)
    except UserError:
        text = "imported"
    files = campaigns()

    def taken(candidate: str) -> bool:
        return candidate in files or os.path.lexists(directory(candidate))
    if not taken(text):
        return text, ""
    if name is not None:
        raise UserError(f"--name {name}: campaign {text!r} exists already; choose another name")
    n = 2
    while taken(f"{text[:60]}-{n}"):
        n += 1
    return f"{text[:60]}-{n}", f" (campaign {text!r} exists already)"
