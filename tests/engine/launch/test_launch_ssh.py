"""Launching over SSH onto two real sshd nodes (network namespaces joined by a bridge)."""

# Tests run in file order; the dead-node test kills node 2 for good and so comes last.

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from charllm.engine.launch.launcher import cancel, launch
from charllm.engine.launch.targets import parse_target
from charllm.engine.model.experiment import Experiment
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir
from infra_runs import iterations_logged, logs, run_processes, wait_final, wait_for
from infra_ssh import ssh_nodes  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.train]   # they launch training (torchrun)


def two_nodes(iters: int):
    exp = Experiment.load("tiny-local")
    exp.cluster.nodes, exp.cluster.gpus_per_node = 2, 1
    exp.training.train_iters = iters
    return exp


def remote_leftovers(nodes, run_id: str) -> list:
    """Processes of the run still alive inside the nodes (the remote side of the run)."""
    inside = set(nodes.pids())
    return [p for p in run_processes(run_id) if p.pid in inside]


@pytest.mark.timeout(400)
def test_two_node_job_streams_logs_iterations_and_telemetry_home(ssh_nodes, tmp_path, monkeypatch):
    """With an env line as users write them (a comment at its end: it once commented out torchrun
    and faked a completed run) and a name full of shell, which never runs as a command; with a
    profiler window on every rank, whose traces (one per node) come home after the run."""
    table = ssh_nodes.target_table()
    table["env_setup"] += "  # the nodes' interface for gloo"
    target = parse_target("nodes", table)
    monkeypatch.chdir(tmp_path)
    exp = two_nodes(4)
    exp.name = "x'; touch PWNED; echo \"$(touch PWNED)\" #"
    exp.telemetry.profile_steps, exp.telemetry.profile_scope = [3], "all"
    rd = RunDir(launch(exp, target).run_dir)
    manifest = wait_final(rd, 300)
    assert manifest["status"] == "completed", (manifest.get("failure"), logs(rd))
    steps = rd.read_iterations()
    steps = steps.filter(steps["event"] == "iteration")
    assert set(steps["rank"].to_list()) == {0, 1}, "rank 0's node and the last rank's node both streamed"
    assert sorted(set(steps["iteration"].to_list())) == [1, 2, 3, 4]
    telemetry = rd.scan_telemetry().collect()
    assert set(telemetry["node"].to_list()) == set(ssh_nodes.hosts)
    for host in ssh_nodes.hosts:
        assert [f for f in rd.telemetry_files() if f.parent.name == host], f"no local telemetry from {host}"
        assert (rd.logs_dir / f"train-{host}.log").is_file() and (rd.logs_dir / f"sampler-{host}.log").is_file()
    assert "iter 4/4" in (rd.logs_dir / f"train-{ssh_nodes.hosts[0]}.log").read_text()  # rank 0's stdout
    assert all(p["remote_pgid"] for p in manifest["processes"])
    assert not list(tmp_path.rglob("PWNED")) and not list(ssh_nodes.root.rglob("PWNED")), "the name ran as a command"
    assert "telemetry_lost" not in manifest, "samplers stopped at the end are no loss"
    traces = sorted(p.name for p in rd.traces_dir.iterdir())
    assert traces == ["rank00000-step000003.pt.trace.json", "rank00001-step000003.pt.trace.json"], traces
    assert manifest["profile"]["traces"] == 2   # each node's "profile" line came home through its tail
    assert manifest["profile"]["bytes"] == sum(p.stat().st_size for p in rd.traces_dir.iterdir())
    # the supervisor writes the final status just before it exits itself
    wait_for(lambda: remote_leftovers(ssh_nodes, rd.id) == [] and run_processes(rd.id) == [], 15,
             "every process of the run to exit, here and on both nodes")


# A user's own command: five steps logged its own way (a regular expression reads them), then the
# rendezvous it was given.
STEPS = ("for i in 1 2 3 4 5; do echo \"step $i loss 2.$i took 50 ms\"; sleep 0.1; done; "
         "echo \"node rank $NODE_RANK of $NNODES, master $MASTER_ADDR:$MASTER_PORT\"")
STEPS_FORMAT = r"step (?P<iteration>\d+) loss (?P<loss>[\d.]+) took (?P<step_ms>\d+) ms"


@pytest.mark.timeout(200)
def test_launch_command_runs_once_on_each_node_its_steps_parsed_and_completes(ssh_nodes):
    from charllm.engine.launch.command import plan_command

    target = parse_target("nodes", ssh_nodes.target_table())
    exp, command, notes = plan_command(STEPS, log_format=STEPS_FORMAT, hardware="cpu", nodes=2, name="steps",
                                       on_this_machine=target.on_this_machine)
    exp.telemetry.backend = "host"
    rd = RunDir(launch(exp, target, command=command, notes=notes).run_dir)
    manifest = wait_final(rd, 150)
    assert manifest["status"] == "completed", (manifest.get("failure"), logs(rd))
    steps = [r for r in rd.iteration_records() if r.get("event") == "iteration"]
    for host in ssh_nodes.hosts:
        mine = [s for s in steps if s["node"] == host]
        assert [s["iteration"] for s in mine] == [1, 2, 3, 4, 5], (host, mine)
        assert all(s["loss"] == float(f"2.{s['iteration']}") and s["end_ns"] - s["start_ns"] == 50_000_000
                   for s in mine)
    ends = sorted((e["node"], e["status"], e["records"]) for e in rd.end_events())
    assert ends == [(host, "completed", 5) for host in sorted(ssh_nodes.hosts)], ends
    masters = set()
    for rank, host in enumerate(ssh_nodes.hosts):   # each node its own rank, one master for both
        said = (rd.logs_dir / f"train-{host}.log").read_text()
        assert f"node rank {rank} of 2, master " in said, said
        masters.add(said.split(", master ")[1].split()[0])
    assert len(masters) == 1, masters
    assert set(rd.scan_telemetry().collect()["node"].to_list()) == set(ssh_nodes.hosts), "a probe on every node"
    wait_for(lambda: remote_leftovers(ssh_nodes, rd.id) == [] and run_processes(rd.id) == [], 15,
             "every process of the run to exit, here and on both nodes")


@pytest.mark.timeout(200)
def test_a_node_whose_log_tail_was_lost_still_brings_every_step_home(ssh_nodes):
    """The connection tailing the first node's iteration log dies mid-run (a slow or lost link; a
    node that ran for less than the tail's first look is the same case): the run completes, and
    the lines that tail never carried are read once training ended."""
    from charllm.engine.launch.command import plan_command

    target = parse_target("nodes", ssh_nodes.target_table())
    slow = STEPS.replace("sleep 0.1", "sleep 1")
    exp, command, notes = plan_command(slow, log_format=STEPS_FORMAT, hardware="cpu", nodes=2, name="steps",
                                       on_this_machine=target.on_this_machine)
    exp.telemetry.backend = "host"
    rd = RunDir(launch(exp, target, command=command, notes=notes).run_dir)
    first = ssh_nodes.hosts[0]
    tail = wait_for(lambda: [p for p in rd.read_manifest().get("processes") or ()
                             if p["role"] == "tail" and p["node"] == first], 60, "the tail to start")[0]
    os.kill(tail["pid"], signal.SIGKILL)   # its local ssh client: the remote tail goes with it
    manifest = wait_final(rd, 150)
    assert manifest["status"] == "completed", (manifest.get("failure"), logs(rd))
    steps = [r for r in rd.iteration_records() if r.get("event") == "iteration"]
    for host in ssh_nodes.hosts:
        assert sorted(s["iteration"] for s in steps if s["node"] == host) == [1, 2, 3, 4, 5], host
    assert sorted(e["node"] for e in rd.end_events()) == sorted(ssh_nodes.hosts)


@pytest.mark.timeout(200)
def test_a_node_step_that_never_ran_the_workload_is_no_completed_run(ssh_nodes):
    """An env line that ends the node's shell (`exit 0`) before torchrun: every step exits 0 and
    nothing trained; the run is failed, saying so, not completed."""
    table = ssh_nodes.target_table()
    table["env_setup"] += "; exit 0"
    rd = RunDir(launch(two_nodes(4), parse_target("nodes", table)).run_dir)
    manifest = wait_final(rd, 150)
    assert manifest["status"] == "failed" and "never logged its end" in manifest["failure"], manifest
    wait_for(lambda: remote_leftovers(ssh_nodes, rd.id) == [] and run_processes(rd.id) == [], 15,
             "every process of the run to exit, here and on both nodes")


def test_wrong_host_key_is_refused_showing_the_offered_fingerprint(ssh_nodes, tmp_path, charllm_dirs):
    wrong = tmp_path / "known_hosts"  # node 2's key recorded for node 1: a changed key
    lines = {h: f"{h} ssh-ed25519 {k}" for h, k in ssh_nodes.host_keys.items()}
    lines[ssh_nodes.hosts[0]] = f"{ssh_nodes.hosts[0]} ssh-ed25519 {ssh_nodes.host_keys[ssh_nodes.hosts[1]]}"
    wrong.write_text("\n".join(lines.values()) + "\n")
    unknown = tmp_path / "empty_known_hosts"
    unknown.write_text("")
    for known in (wrong, unknown):
        target = parse_target("nodes", ssh_nodes.target_table(known_hosts=str(known)))
        with pytest.raises(UserError) as err:
            launch(two_nodes(2), target)
        message = str(err.value)
        offered = subprocess.run(["ssh-keygen", "-l", "-f", str(ssh_nodes.root / "host_key_0.pub")],
                                 capture_output=True, text=True).stdout.split()[1]
        assert "host key" in message and f"it offers {offered} (ED25519)" in message, message
        assert "compare with the fingerprint" in message and f"add that key to {known}" in message
        assert ">>" not in message and "\n" not in message, "no command that trusts a key blindly"
    assert not charllm_dirs["runs"].exists() or not any(charllm_dirs["runs"].iterdir())


@pytest.mark.timeout(400)
def test_cancel_leaves_nothing_on_either_node(ssh_nodes):
    target = parse_target("nodes", ssh_nodes.target_table())
    rd = RunDir(launch(two_nodes(100_000), target).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 2, 300, f"the first iterations\n{logs(rd)}")
    assert len(remote_leftovers(ssh_nodes, rd.id)) >= 6  # 2 x (sampler, tail, torchrun, rank)
    assert cancel(rd) == "cancelled"
    wait_for(lambda: remote_leftovers(ssh_nodes, rd.id) == [] and run_processes(rd.id) == [], 20,
             "every process on both nodes and every ssh client to exit")
    assert rd.read_manifest()["status"] == "cancelled"


@pytest.mark.timeout(400)
def test_killed_supervisor_leaves_nothing_on_either_node(ssh_nodes, capsys):
    """The ssh clients die with the supervisor; each closed connection stops its remote group."""
    from infra_cli import run
    from infra_runs import supervisor_process

    target = parse_target("nodes", ssh_nodes.target_table())
    rd = RunDir(launch(two_nodes(100_000), target).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 2, 300, f"the first iterations\n{logs(rd)}")
    assert len(remote_leftovers(ssh_nodes, rd.id)) >= 6
    supervisor_process(rd).kill()
    wait_for(lambda: remote_leftovers(ssh_nodes, rd.id) == [] and run_processes(rd.id) == [], 15,
             "every process on both nodes and every ssh client to exit")
    code, out, err = run(capsys, "runs", "show", rd.id)
    assert code == 0 and "status    failed" in out and "the supervisor died" in out, out + err


@pytest.mark.timeout(400)
def test_killed_remote_torchrun_takes_its_ranks_along(ssh_nodes):
    target = parse_target("nodes", ssh_nodes.target_table())
    rd = RunDir(launch(two_nodes(100_000), target).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 2, 300, f"the first iterations\n{logs(rd)}")
    torchrun = [p for p in remote_leftovers(ssh_nodes, rd.id) if "torch.distributed.run" in p.cmdline()]
    assert len(torchrun) == 2
    torchrun[1].kill()
    manifest = wait_final(rd, 120)
    assert manifest["status"] == "failed"
    wait_for(lambda: remote_leftovers(ssh_nodes, rd.id) == [] and run_processes(rd.id) == [], 15,
             "every process on both nodes and every ssh client to exit")


@pytest.mark.timeout(400)
def test_killed_remote_rank_fails_the_run_naming_it_and_leaves_nothing(ssh_nodes):
    from infra_runs import rank_process

    target = parse_target("nodes", ssh_nodes.target_table())
    rd = RunDir(launch(two_nodes(100_000), target).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 2, 300, f"the first iterations\n{logs(rd)}")
    rank_process(rd.id, 1).kill()
    manifest = wait_final(rd, 120)
    assert manifest["status"] == "failed" and "rank 1" in manifest["failure"], manifest.get("failure")
    wait_for(lambda: remote_leftovers(ssh_nodes, rd.id) == [] and run_processes(rd.id) == [], 15,
             "every process on both nodes and every ssh client to exit")


@pytest.mark.timeout(400)
def test_a_dead_remote_sampler_is_told_in_the_status(ssh_nodes):
    from infra_runs import a_dead_sampler_is_told

    target = parse_target("nodes", ssh_nodes.target_table())
    rd = RunDir(launch(two_nodes(60), target).run_dir)
    a_dead_sampler_is_told(rd, ssh_nodes.hosts[1])
    assert rd.scan_telemetry().collect().height > 0, "what came home before stays readable"
    wait_for(lambda: remote_leftovers(ssh_nodes, rd.id) == [] and run_processes(rd.id) == [], 15,
             "every process on both nodes and every ssh client to exit")


# A probe-only run started over ssh on a node (`ssh NODE python -m charllm.probes --out DIR`), its
# directory on a filesystem this machine reads. Its pids are the node's (each node has its own PID
# namespace): a reader here leaves it alone and says where it runs; a reader on that node finishes
# it, and `runs cancel` there stops it.
def probe_on_node(ssh_nodes, out_dir):
    """The probe on node 2, a way to run charllm-tui there, and a check that the probe and its
    ssh client are gone."""
    import os
    import sys

    from infra_runs import recording_probe

    target, host = parse_target("nodes", ssh_nodes.target_table()), ssh_nodes.hosts[1]
    proc, rd = recording_probe(out_dir, host, lambda argv: target.ssh_argv(host) + [target.shell_line(argv)])

    def on_node(*argv: str) -> subprocess.CompletedProcess:
        where = [
            f"{name}={os.environ[name]}" for name in ("CHARLLM_CONFIG_DIR", "CHARLLM_DATA_DIR", "CHARLLM_RUNS_DIR")
        ]
        line = target.shell_line(["env", *where, sys.executable, "-m", "charllm.tui", *argv])
        return subprocess.run(target.ssh_argv(host) + [line], capture_output=True, text=True, timeout=120)

    gone = lambda: remote_leftovers(ssh_nodes, str(rd.path)) == [] and run_processes(str(rd.path)) == []  # noqa: E731
    return proc, rd, on_node, gone


def seen_from_here_as_running_elsewhere(rd, capsys) -> None:
    from infra_cli import run

    code, out, err = run(capsys, "runs", "show", str(rd.path))
    assert code == 0 and "in another PID namespace (not visible from here)" in out, out + err
    assert rd.status == "running"


@pytest.mark.timeout(200)
def test_a_killed_remote_probe_only_run_is_finished_by_a_reader_on_its_node(ssh_nodes, tmp_path, capsys):
    from infra_runs import finish

    proc, rd, on_node, gone = probe_on_node(ssh_nodes, tmp_path / "probe-run")
    seen_from_here_as_running_elsewhere(rd, capsys)
    killed = subprocess.run(
        parse_target("nodes", ssh_nodes.target_table()).ssh_argv(ssh_nodes.hosts[1])
        + [f"kill -KILL {rd.manifest().sampler['pid']}"], capture_output=True, text=True)
    assert killed.returncode == 0, killed.stderr
    wait_for(gone, 15, "the probe and its ssh client to exit")
    finish(proc, 30)
    seen_from_here_as_running_elsewhere(rd, capsys)   # its pid means nothing here: only the node can tell
    shown = on_node("runs", "show", str(rd.path))
    assert shown.returncode == 0 and "status    failed" in shown.stdout, shown.stdout + shown.stderr
    assert "the sampler died" in shown.stdout
    assert rd.scan_telemetry().collect().height > 0, "what was recorded stays readable"


@pytest.mark.timeout(200)
def test_runs_cancel_stops_a_remote_probe_only_run_from_its_node(ssh_nodes, tmp_path, capsys):
    from infra_cli import one_error_line, run
    from infra_runs import finish

    proc, rd, on_node, gone = probe_on_node(ssh_nodes, tmp_path / "probe-run")
    code, out, err = run(capsys, "runs", "cancel", str(rd.path))
    assert code == 2 and "not visible from here; stop it there" in one_error_line(err)
    cancelled = on_node("runs", "cancel", str(rd.path))
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr
    wait_for(gone, 15, "the probe and its ssh client to exit")
    finish(proc, 30)
    assert rd.read_manifest()["status"] == "cancelled"
    assert rd.scan_telemetry().collect().height > 0, "the sampler closed its last chunk"


@pytest.mark.timeout(400)
def test_dead_node_fails_the_run_naming_it_and_stops_the_other(ssh_nodes):
    """Runs last: it kills the second node outright (every process in its namespace, sshd too)."""
    import os
    import signal
    import subprocess

    if not ssh_nodes.netns:
        pytest.skip("needs network-namespace nodes (loopback nodes share this machine's processes)")
    target = parse_target("nodes", ssh_nodes.target_table())
    rd = RunDir(launch(two_nodes(100_000), target).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 2, 300, f"the first iterations\n{logs(rd)}")
    dead = ssh_nodes.hosts[1]
    pids = subprocess.run(["ip", "netns", "pids", ssh_nodes.netns[1]], capture_output=True, text=True).stdout
    for pid in map(int, pids.split()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it already died with its parent (ranks follow torchrun)
            pass
    manifest = wait_final(rd, 120)
    assert manifest["status"] == "failed"
    assert f"node {dead}" in manifest["failure"], manifest["failure"]
    wait_for(lambda: remote_leftovers(ssh_nodes, rd.id) == [] and run_processes(rd.id) == [], 30,
             "the surviving node's processes and every ssh client to exit")
    assert rd.experiment_path.is_file() and rd.iterations_path.is_file()
