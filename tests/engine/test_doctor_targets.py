"""`charllm-tui doctor --target`: every node of a real ssh target (sshd nodes in network namespaces)
and of a real Slurm (slurmctld + two slurmd on loopback); calibrations are saved on this side."""

from __future__ import annotations

import json
import sys

import pytest
import tomli_w

from infra_cli import run
from infra_runs import run_processes, wait_for
from infra_slurm import slurm_cluster  # noqa: F401 - fixture
from infra_ssh import ssh_nodes  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.train, pytest.mark.timeout(400)]   # doctor reads torch on each node

FAST = ("--sample-seconds", "0.5")


def write_targets(charllm_dirs, **tables) -> None:
    config = charllm_dirs["config"]
    config.mkdir(parents=True, exist_ok=True)
    (config / "targets.toml").write_text(tomli_w.dumps(tables))


def test_every_ssh_node_reports_and_an_unreachable_one_is_one_line(ssh_nodes, charllm_dirs, capsys):
    # 127.0.0.1 on the nodes' port has no sshd of theirs: refused, or an unknown host key.
    table = ssh_nodes.target_table(hosts=[*ssh_nodes.hosts, "127.0.0.1"], connect_timeout=5)
    write_targets(charllm_dirs, nodes=table)
    code, out, err = run(capsys, "doctor", "--target", "nodes", "--json", *FAST)
    assert code == 1, err
    result = json.loads(out)
    assert result["target"] == "nodes"
    by_node = {n["node"]: n for n in result["nodes"]}
    assert list(by_node) == [*ssh_nodes.hosts, "127.0.0.1"]
    for host in ssh_nodes.hosts:
        report = by_node[host]["report"]
        assert by_node[host]["error"] is None and report["node"] == host and report["hardware"] == "cpu"
        assert report["stack"]["cuda"] is False and [s["hz"] for s in report["sampling"]] == [20.0, 100.0]
    bad = by_node["127.0.0.1"]
    assert bad["report"] is None and "127.0.0.1" in bad["error"] and "\n" not in bad["error"]
    assert f"{ssh_nodes.hosts[0]}: sampling at 100 Hz" in err          # the nodes' progress, forwarded
    # One calibration for the hardware both nodes are, from the first, saved here.
    saved = json.loads((charllm_dirs["data"] / "calibrations" / "cpu.json").read_text())
    assert saved["node"] == ssh_nodes.hosts[0]
    assert by_node[ssh_nodes.hosts[0]]["report"]["saved_calibration"].endswith("cpu.json")
    assert by_node[ssh_nodes.hosts[1]]["report"]["saved_calibration"] is None

    code, out, _ = run(capsys, "doctor", "--target", "nodes", "--no-save", *FAST)
    assert code == 1
    assert f"node {ssh_nodes.hosts[1]}" in out and "✗ node 127.0.0.1:" in out
    assert "2 of 3 nodes passed; failed: 127.0.0.1" in out
    wait_for(lambda: not [p for p in run_processes("charllm.engine.doctor report") if p.pid in set(ssh_nodes.pids())],
             15, "no doctor left on the nodes")


def slurm_target(**extra) -> dict:
    return {"kind": "slurm", "partition": "debug", "time": "00:10:00", "python": sys.executable, **extra}


def test_doctor_on_two_slurm_nodes_in_one_srun_step(slurm_cluster, charllm_dirs, capsys):
    write_targets(charllm_dirs, testcluster=slurm_target())
    code, out, err = run(capsys, "doctor", "--target", "testcluster", "--nodes", "2", "--json", *FAST)
    assert code == 0, err
    nodes = json.loads(out)["nodes"]
    assert sorted(n["node"] for n in nodes) == ["n1", "n2"] and all(n["error"] is None for n in nodes)
    assert all(n["report"]["hardware"] == "cpu" and n["report"]["sampling"] for n in nodes)
    assert "n1: sampling at 20 Hz" in err or "n2: sampling at 20 Hz" in err
    saved = json.loads((charllm_dirs["data"] / "calibrations" / "cpu.json").read_text())
    assert saved["node"] in ("n1", "n2")


def test_a_failing_slurm_node_is_named_in_one_line(slurm_cluster, charllm_dirs, capsys):
    """Every node refuses a GPU preset (they have no GPU); each is reported, by name, as one line."""
    write_targets(charllm_dirs, testcluster=slurm_target())
    code, out, _ = run(capsys, "doctor", "--target", "testcluster", "--nodes", "2", "--hardware", "h100-sxm-80gb",
                       *FAST)
    assert code == 1
    failed = [line for line in out.splitlines() if line.startswith("✗ ")]
    assert len(failed) == 2 and {line.split(":")[0] for line in failed} == {"✗ node n1", "✗ node n2"}, out
    assert all("--hardware 'h100-sxm-80gb': a nvidia preset, and this node has no GPU" in line for line in failed)
    assert not (charllm_dirs["data"] / "calibrations").exists()


def test_more_slurm_nodes_than_the_partition_has_is_one_line_not_a_wait(slurm_cluster, charllm_dirs, capsys):
    """Before: `doctor --nodes 3` on the 2-node partition waited for resources for 600 s and more."""
    import time

    write_targets(charllm_dirs, testcluster=slurm_target())
    started = time.monotonic()
    code, out, err = run(capsys, "doctor", "--target", "testcluster", "--nodes", "3", *FAST)
    assert code == 2 and err.strip() == "charllm-tui: error: --nodes = 3: partition 'debug' has 2 nodes (sinfo)", err
    assert time.monotonic() - started < 60
