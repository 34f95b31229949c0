"""A campaign is data: its file is read with one line per mistake, its members are every base x layout
x axis value, and `campaign plan` plans each (no process is started here)."""

from __future__ import annotations

import json

import pytest

from charllm.engine.campaign.spec import Campaign, parse_time_limit, variant
from infra_cli import one_error_line, run


def write(charllm_dirs, name: str, text: str):
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.toml").write_text(text)


def test_the_shipped_microbatch_sweep_plans_59_of_60_and_refuses_one_by_the_batch_rule(capsys):
    code, out, err = run(capsys, "campaign", "plan", "ppt-microbatch", "--json")
    assert code == 0, err
    members = json.loads(out)
    assert len(members) == 60
    refused = [m for m in members if m["verdict"] == "invalid"]
    assert [m["name"] for m in refused] == ["ppt-h200-mixtral-8x7b-1-01000-mbs8"]
    assert "must be divisible by micro_batch_size x data-parallel size" in refused[0]["reason"]
    assert all(m["verdict"] in ("fits", "tight") for m in members if m not in refused)
    assert {m["varied"]["micro_batch_size"] for m in members} == {1, 2, 4, 8}
    code, out, _ = run(capsys, "campaign", "plan", "ppt-microbatch")
    assert code == 0 and "60 members: 59 planned to run, 0 skipped (do not fit), 1 invalid" in " ".join(out.split())


def test_the_shipped_sweeps_are_the_papers(capsys):
    sizes = {name: len(Campaign.load(name).members()) for name in
             ("ppt-parallelism", "ppt-optimization", "ppt-microbatch", "ppt-h100")}
    assert sizes == {"ppt-parallelism": 15, "ppt-optimization": 60, "ppt-microbatch": 60, "ppt-h100": 68}
    # the artifact's 188 jobs: the H200 optimization and micro-batch sweeps and the H100 sweep (the parallelism
    # sweep is the optimization sweep's 01000 runs)
    assert sizes["ppt-optimization"] + sizes["ppt-microbatch"] + sizes["ppt-h100"] == 188
    # H100 llama3-70b TP1 PP32 on our uneven split: planned per stage, and without recomputation too big for an
    # H100, as the paper's OOM marks expect
    pp32 = {p.member.experiment.name: p.verdict for p in Campaign.load("ppt-h100").plan()
            if p.member.experiment.name.startswith("ppt-h100-llama3-70b-4-")}
    assert pp32 == {"ppt-h100-llama3-70b-4-00000": "does not fit", "ppt-h100-llama3-70b-4-10000": "does not fit",
                    "ppt-h100-llama3-70b-4-01000": "fits", "ppt-h100-llama3-70b-4-11000": "fits"}
    optimization = Campaign.load("ppt-optimization").members()
    per_variant = {}
    for m in optimization:
        per_variant.setdefault(variant(m.experiment, m.base), []).append(m)
    assert {k: len(v) for k, v in per_variant.items()} == {"base": 15, "overlap": 15, "recompute": 15,
                                                           "overlap + recompute": 15}
    skipped = [p for p in Campaign.load("ppt-optimization").plan() if p.verdict == "does not fit"]
    assert skipped and all(p.skip_reason.startswith("skipped: does not fit (planned ") for p in skipped)


def test_members_are_bases_by_layouts_by_axis_values(charllm_dirs):
    write(charllm_dirs, "grid", 'experiments = ["tiny-local"]\n[axes]\nmicro_batch_size = [1, 2, 4]\n'
                                "train_iters = [6]\n[[layouts]]\ntensor_model_parallel_size = 1\n"
                                "[[layouts]]\ntensor_model_parallel_size = 2\n[target]\nmax_parallel = 2\n"
                                'time_limit = "00:10:00"\n')
    campaign = Campaign.load("grid")
    members = campaign.members()
    assert [(m.experiment.parallel.tensor_model_parallel_size, m.experiment.training.micro_batch_size)
            for m in members] == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)]
    assert all(m.experiment.training.train_iters == 6 for m in members)
    assert [m.experiment.name for m in members][:2] == ["tiny-local-tp1-mbs1", "tiny-local-tp1-mbs2"]
    assert len({m.key for m in members}) == 6 and campaign.max_parallel == 2 and campaign.time_limit_s == 600


@pytest.mark.parametrize(
    "text, words",
    [
        (
            'experiments = ["tiny-local"]\n[axes]\nmicro_batch_sise = [1, 2]\n',
            "axes.micro_batch_sise: key: unknown key 'micro_batch_sise'; did you mean 'micro_batch_size'?",
        ),
        (
            'experiments = ["tiny-local"]\n[axes]\nmicro_batch_size = []\n',
            "axes.micro_batch_size = []: must be a non-empty list",
        ),
        (
            'experiments = ["tiny-local"]\n[axes]\nmicro_batch_size = 2\n',
            "axes.micro_batch_size = 2: must be a non-empty list",
        ),
        (
            'experiments = ["tiny-local"]\n[axes]\nmicro_batch_size = ["x"]\n',
            "micro_batch_size: expected an integer, got 'x'",
        ),
        ('experiments = ["tiny-local"]\n[axes]\nmicro_batch_size = [1, 1]\n', "a value is listed twice"),
        ('experiments = ["no-such-*"]\n', "experiments: 'no-such-*' matches no experiment"),
        ("experiments = []\n", "experiments = []: give a list of experiment names"),
        ('experiment = ["tiny-local"]\n', "unknown key 'experiment'; did you mean 'experiments'?"),
        ('experiments = ["tiny-local"]\n[[layouts]]\nlr = 0.1\n', "layouts[1].lr: not a parallel setting ([training])"),
        (
            'experiments = ["tiny-local"]\n[target]\nmax_parallel = 0\n',
            "target.max_parallel = 0: must be an integer from 1",
        ),
        (
            'experiments = ["tiny-local"]\n[target]\ntime_limit = "forever"\n',
            "target.time_limit = 'forever': give seconds",
        ),
        ('experiments = ["tiny-local"]\n[target]\nnodes = 2\n', "unknown key 'target.nodes'"),
    ],
)
def test_a_bad_campaign_is_one_line_naming_the_key(text, words, charllm_dirs, capsys):
    write(charllm_dirs, "bad", text)
    code, out, err = run(capsys, "campaign", "plan", "bad")
    line = one_error_line(err)
    assert code == 2 and "campaign 'bad'" in line and words in line, line


def test_keys_says_what_a_file_takes(capsys):
    code, out, _ = run(capsys, "campaign", "keys")
    assert code == 0
    for key in ("experiments", "axes", "layouts", "target.max_parallel", "target.time_limit"):
        assert key in out


@pytest.mark.parametrize("value, seconds", [(90, 90.0), ("90", 5400.0), ("01:30", 90.0), ("1:00:00", 3600.0),
                                            ("2-00:00:00", 172800.0)])
def test_time_limits_read_as_slurm_writes_them(value, seconds):
    """Seconds, or Slurm's --time forms: a lone number is minutes, MM:SS, HH:MM:SS, D-HH:MM:SS."""
    assert parse_time_limit(value, "t") == seconds


def test_chosen_layouts_become_a_campaign_file_whose_members_are_those_layouts(charllm_dirs):
    from charllm.engine.campaign.spec import from_layouts, save_new
    from charllm.engine.model.experiment import Experiment
    from charllm.probes.core.errors import UserError

    base = Experiment.load("ppt-h100-llama3-70b-1-01000")
    layouts = []
    for tp, pp, vp in ((8, 1, None), (4, 2, 2), (8, 4, None)):
        exp = base.copy()
        exp.parallel.tensor_model_parallel_size, exp.parallel.pipeline_model_parallel_size = tp, pp
        exp.parallel.virtual_pipeline_model_parallel_size = vp
        exp.training.micro_batch_size = 2          # all alike: an axis of one value
        layouts.append(exp)
    table = from_layouts(base.name, base, layouts + layouts[:1], "three layouts")   # the repeat is dropped
    assert table["axes"] == {"micro_batch_size": [2]}
    assert table["layouts"][0] == {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 1,
                                   "virtual_pipeline_model_parallel_size": "none"}
    path = save_new("chosen", table)
    assert path == charllm_dirs["config"] / "campaigns" / "chosen.toml"
    members = Campaign.load("chosen").members()
    assert [{**m.experiment.to_dict(), "name": e.name} for m, e in zip(members, layouts)] == \
        [e.to_dict() for e in layouts] and len(members) == 3
    with pytest.raises(UserError, match="'chosen': already exists"):
        save_new("chosen", table)
    with pytest.raises(UserError, match="'tiny-local': already exists"):   # a shipped one would be hidden
        save_new("tiny-local", table)
    odd = layouts[0].copy()
    odd.training.micro_batch_size = 1
    with pytest.raises(UserError, match=r"the layouts differ in micro_batch_size \(2, 1\)"):
        from_layouts(base.name, base, [layouts[0], odd])
    (one,) = from_layouts(base.name, base, layouts[1:2])["layouts"]       # one layout: still named by TP and PP
    assert one == {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2,
                   "virtual_pipeline_model_parallel_size": 2}
    with pytest.raises(UserError, match="experiments: 'no-such' matches no experiment"):
        save_new("broken", {**table, "experiments": ["no-such"]})
    assert not (charllm_dirs["config"] / "campaigns" / "broken.toml").exists()      # nothing left written
