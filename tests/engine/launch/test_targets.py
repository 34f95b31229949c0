"""Targets: parsing, validation messages, and command building (no processes started)."""

from __future__ import annotations

import shlex

import pytest

from charllm.engine.launch import slurm, ssh
from charllm.engine.launch.launcher import plan
from charllm.engine.launch.targets import LOCAL, describe, from_record, get_target, load_file, load_targets, runs_here
from charllm.engine.model.experiment import Experiment
from charllm.probes.core import paths, procid
from charllm.probes.core.errors import UserError

GOOD = """
[lab]
kind = "ssh"
hosts = ["node1", "10.0.0.2"]
user = "me"
port = 2222
identity_file = "~/.ssh/id_ed25519"
env_setup = "module load cuda; conda activate train"

[hpc]
kind = "slurm"
partition = "gpu"
account = "proj"
qos = "high"
time = "01:00:00"
constraint = "H100"
gpus_per_node = 8
sbatch_lines = ["--exclusive"]
"""


def write(text: str):
    path = paths.targets_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_local_is_built_in_without_a_file():
    assert load_targets() == ({"local": LOCAL}, {})
    assert get_target("local") is LOCAL


def test_targets_file_parses_every_kind():
    write(GOOD)
    targets, problems = load_targets()
    assert problems == {}
    assert targets["lab"].hosts == ("node1", "10.0.0.2") and targets["lab"].port == 2222
    assert targets["hpc"].gpus_per_node == 8 and targets["hpc"].sbatch_lines == ("--exclusive",)
    assert from_record(targets["lab"].to_dict()) == targets["lab"]


def test_target_file_given_explicitly(tmp_path):
    other = tmp_path / "t.toml"
    other.write_text(GOOD)
    assert get_target("hpc", other).partition == "gpu"


@pytest.mark.parametrize("text, message", [
    ('[a]\nkind = "ssh"\nhosts = ["h"]\nhostz = 1\n', "unknown key 'hostz'; did you mean 'hosts'?"),
    ('[a]\nkind = "shh"\n', "did you mean 'ssh'?"),
    ('[a]\nkind = "ssh"\n', "at least one host"),
    ('[a]\nkind = "ssh"\nhosts = ["-oProxyCommand=x"]\n', "not a host name"),
    ('[a]\nkind = "ssh"\nhosts = ["h"]\nport = 70000\n', "between 1 and 65535"),
    ('[a]\nkind = "slurm"\ngpus_per_node = "8"\n', "must be an integer"),
    ('[a]\nkind = "slurm"\nhosts = ["h"]\n', "unknown key 'hosts'"),
    ('[local]\nkind = "ssh"\nhosts = ["h"]\n', "built in"),
    ('[a\n', "invalid TOML"),
])
def test_bad_targets_are_one_line_errors(text, message):
    write(text)
    with pytest.raises(UserError) as err:
        load_file(paths.targets_file())
    assert message in str(err.value) and "\n" not in str(err.value)
    name = text[1:text.index("]")] if "]" in text else "a"
    if name == "local":  # built in: a [local] table cannot shadow it, and launching there needs no file
        assert get_target(name) is LOCAL
        return
    with pytest.raises(UserError) as err:
        get_target(name)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_bad_target_costs_only_itself():
    write(GOOD + '\n[broken]\nkind = "ftp"\n')
    targets, problems = load_targets()
    assert sorted(targets) == ["hpc", "lab", "local"]
    assert list(problems) == ["broken"] and "kind = 'ftp'" in problems["broken"]
    assert get_target("local") is LOCAL and get_target("lab").hosts == ("node1", "10.0.0.2")
    with pytest.raises(UserError, match=r"\[broken\]\.kind = 'ftp': must be one of"):
        get_target("broken")


def test_a_file_that_is_not_toml_leaves_local_working():
    write("[a\n")
    assert get_target("local") is LOCAL
    with pytest.raises(UserError, match="invalid TOML"):
        get_target("a")


def test_unknown_target_names_the_nearest():
    write(GOOD)
    with pytest.raises(UserError, match="did you mean 'hpc'"):
        get_target("hcp")


def test_ssh_remote_commands_cannot_inject_shell(tmp_path):
    write(GOOD)
    target = get_target("lab")
    exp = Experiment.load("tiny-local")
    exp.cluster.nodes = 2
    run_dir = tmp_path / "x; touch PWNED $(id)"
    steps, script = plan(exp, target, run_dir)
    assert script is None
    for step in steps:
        line = target.in_process_group(step.argv)
        # The remote shell sees: setsid -w bash -c '<read the token, exec $0>' '<inner>'; the inner
        # line runs exactly argv.
        outer = shlex.split(line)
        assert outer[:5] == ["setsid", "-w", "bash", "-c", procid.TOKEN_FROM_STDIN] and len(outer) == 6
        inner = outer[5]
        # its identity first, then the env line as written (a line of its own), then argv, quoted
        setup = (procid.REMOTE_IDENTITY + "; " + ssh._STOP_WITH_CONNECTION
                 + "trap : TERM\nmodule load cuda; conda activate train\n")
        assert inner.startswith(setup) and inner.endswith("\nexit $?")
        assert shlex.split(inner.removeprefix(setup).removesuffix("\nexit $?")) == step.argv
    assert target.ssh_argv("node1")[-2:] == ["--", "node1"]


def test_slurm_script_has_directives_and_per_node_steps(tmp_path):
    write(GOOD)
    target = get_target("hpc")
    exp = Experiment.load("tiny-local")
    exp.cluster.nodes = 2
    exp.hardware.vendor = "nvidia"
    steps, script = plan(exp, target, tmp_path / "run")
    for line in ("#SBATCH --nodes=2", "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --qos=high",
                 "#SBATCH --time=01:00:00", "#SBATCH --constraint=H100", "#SBATCH --exclusive",
                 "#SBATCH --gpus-per-node=2"):
        assert line in script.splitlines()
    assert "srun --overlap" in script and "--kill-on-bad-exit=1" in script
    assert '--node-rank="$SLURM_NODEID"' in script and '--node "$SLURMD_NODENAME"' in script
    assert not any(p in script for p in slurm.PLACEHOLDERS)


def _torchrun_summary(rank: int, code: int) -> str:
    # The tail of torchrun's ChildFailedError summary, as it lands in a node's train log.
    return (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "Root Cause (first observed failure):\n[0]:\n"
        "  time      : 2026-11-21_07:00:00\n  host      : vm\n"
        f"  rank      : {rank} (local_rank: 0)\n  exitcode  : {code} (pid: 4242)\n"
    )


def test_failure_names_the_killed_rank_not_the_peer_that_exited_after_it(tmp_path):
    from charllm.engine.launch.process import killed_first, rank_failure

    echo = tmp_path / "train-n1.log"      # rank 0 noticed its peer vanish and exited 1, first
    killed = tmp_path / "train-n2.log"    # rank 1 was killed by SIGKILL
    quiet = tmp_path / "train-n3.log"     # no summary at all
    echo.write_text(_torchrun_summary(0, 1))
    killed.write_text(_torchrun_summary(1, -9))
    quiet.write_text("iter 3/20\n")
    # one node, both ranks in its summary: the first *observed* failure is the echo
    both = tmp_path / "train-n4.log"
    both.write_text(
        _torchrun_summary(1, -9).replace("Root Cause (first observed failure):\n", "Failures:\n")
        + "------\nRoot Cause (first observed failure):\n"
        + _torchrun_summary(0, 1).split("ChildFailedError:\n")[1]
    )
    assert rank_failure("n4", both) == "node n4, rank 1 (local rank 0) was killed by SIGKILL"
    order = killed_first([echo, quiet, killed])
    assert order == [killed, echo, quiet]
    assert rank_failure("n2", order[0]) == "node n2, rank 1 (local rank 0) was killed by SIGKILL"


def test_the_killed_rank_is_named_even_when_its_node_reports_after_the_peer(tmp_path):
    # The CI race: rank 0's node exits 1 at once, the killed rank's node a moment later.
    import sys

    from charllm.engine.launch.process import Proc
    from charllm.engine.launch.supervise import Supervisor
    from charllm.engine.launch.target import Step
    from charllm.probes.store.rundir import RunDir

    rd = RunDir(tmp_path)
    rd.logs_dir.mkdir()

    def node(name: str, rank: int, code: int, after_s: float) -> Proc:
        script = f"import sys, time; time.sleep({after_s}); print({_torchrun_summary(rank, code)!r}); sys.exit(1)"
        proc = Proc(rd, LOCAL, Step(name, "train", [sys.executable, "-c", script]))
        proc.start()
        return proc

    echo, killed = node("n1", 0, 1, 0.0), node("n2", 1, -9, 1.5)
    echo.popen.wait()
    supervisor = Supervisor.__new__(Supervisor)  # first_failure needs only the run directory
    supervisor.rd = rd
    assert supervisor.first_failure([echo, killed]) == "node n2, rank 1 (local rank 0) was killed by SIGKILL"


def test_readers_print_the_target_s_own_line_for_its_record():
    """The manifest's target record: its fields, and what the target kept of the run under "run"."""
    hpc = load_file(write(GOOD))["hpc"]
    record = {**hpc.to_dict(), "run": {"job_id": "12", "state": "COMPLETED"}}
    assert describe(record) == "hpc (slurm job 12, COMPLETED)"
    assert describe({**hpc.to_dict(), "run": {"job_id": "12"}}) == "hpc (slurm job 12)"   # not ended yet
    assert describe(hpc.to_dict()) == "hpc (slurm)"                                       # not submitted yet
    assert from_record(record) == hpc, "the run's record is not a field of the target"
    assert describe(LOCAL.to_dict()) == "local (local)" and runs_here(LOCAL.to_dict())
    assert not runs_here(hpc.to_dict()) and not runs_here({"kind": ["x"]})
    # a kind this version lacks, or a damaged record, is shown as recorded
    assert describe({"name": "k", "kind": "kubernetes"}) == "k (kubernetes)"
    assert describe({"name": 3, "kind": ["x"], "run": "y"}) == "- (-)"
    assert describe({"name": "c", "kind": "slurm", "run": {"job_id": 5}}) == "c (slurm)"


def test_runs_show_prints_an_old_manifest_s_slurm_job(charllm_dirs, capsys):
    """A run recorded before the target kept its job (top-level slurm_job_id and slurm_state)."""
    from charllm.probes.store.rundir import RunDir
    from infra_cli import run

    rd = RunDir.create(charllm_dirs["runs"] / "20250101-000000-old", "launch")
    rd.write_manifest({"id": rd.id, "kind": "train", "status": "completed", "created_ns": 1,
                       "target": {"name": "hpc", "kind": "slurm", "partition": "gpu"},
                       "slurm_job_id": "4711", "slurm_state": "COMPLETED"})
    code, out, err = run(capsys, "runs", "show", rd.id)
    assert code == 0, err
    assert "target    hpc (slurm job 4711, COMPLETED)\n" in out
