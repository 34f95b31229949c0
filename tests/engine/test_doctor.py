"""`charllm-tui doctor` on this CPU machine, end to end: the real stack, the real sampler, a real
torchrun training job, the saved calibration and `plan` using it. GPU-side paths run against the
fake NVML behind the real pynvml module (no GPU is claimed to have run)."""

from __future__ import annotations

import json
import os
import re
import shlex
import tempfile

import pytest

from charllm.engine import doctor
from charllm.engine.model import calibration, speed
from charllm.engine.model.experiment import Hardware
from charllm.engine.model.memory import estimate
from charllm.tui.cli import build_parser, main
from charllm.tui.commands.doctor import EPILOG
from fakes_nvml import FakeGpu, FakeNvml
from infra_cli import one_error_line, run
from infra_runs import run_processes, wait_for

pytestmark = pytest.mark.timeout(300)

FAST = ("--sample-seconds", "0.5")


# -- this node -----------------------------------------------------------------------------------
@pytest.mark.train
def test_doctor_on_this_cpu_node_says_no_gpu_and_measures_host_sampling(capsys, charllm_dirs):
    code, out, err = run(capsys, "doctor", "--no-save", "--sample-seconds", "1")
    assert code == 0, err
    assert "hardware cpu" in out and "no GPU" in out
    assert re.search(r"torch 2\.\d+", out) and "megatron-core" in out and "runs as" in out
    assert "on CPU" in out and "host" in out and "cpu_util_pct" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*(20|100) Hz\s+host", line)]
    assert [r[0] for r in rows] == ["20", "100"], out
    for row in rows:   # asked, device, target, achieved: the host is asked at most 20 times a second
        assert row[3:5] == ["20", "Hz"] and 10 <= float(row[5]) <= 21, row
    assert "no calibration saved (--no-save)" in out
    assert "sampling at 20 Hz" in err and "sampling at 100 Hz" in err   # progress, a line per phase
    assert not (charllm_dirs["data"] / "calibrations").exists()


@pytest.mark.train
def test_doctor_json_is_the_whole_report(capsys):
    code, out, _ = run(capsys, "doctor", "--json", "--no-save", *FAST)
    assert code == 0
    report = json.loads(out)
    assert report["hardware"] == "cpu" and report["devices"] == [] and report["errors"] == []
    assert report["stack"]["cuda"] is False and report["versions"]["torch"]
    assert report["implementation"]["device"] == "cpu" and report["implementation"]["transformer_impl"] == "local"
    assert report["telemetry"]["backend"] == "host"
    assert "cpu_util_pct" in report["telemetry"]["devices"][0]["metrics"]
    assert [s["hz"] for s in report["sampling"]] == [20.0, 100.0]
    for run_ in report["sampling"]:
        host = run_["devices"][0]
        assert host["target_hz"] == 20.0 and host["rows"] >= 3
        assert 25 <= host["interval_ms"]["median"] <= 200 and run_["ticks"] >= 0.5 * run_["hz"] * 0.5
    assert report["saved_calibration"] is None and "train" not in report


@pytest.mark.train
@pytest.mark.integration
def test_train_check_saves_a_calibration_that_plan_then_uses(capsys, charllm_dirs):
    code, out, err = run(capsys, "doctor", "--train", "--iters", "3", *FAST)
    assert code == 0, err
    assert "train check" in out and "peak RSS" in out and "TFLOP/s per device" in out and "MFU" in out
    assert "iteration 3/3" in err
    saved = charllm_dirs["data"] / "calibrations" / "cpu.json"
    assert f"calibration saved: {saved}" in out
    record = json.loads(saved.read_text())
    node, date = record["node"], record["date"]
    assert record["hardware"] == "cpu" and record["stack"]["cuda"] is False
    assert record["memory"] == {"usable_bytes": None, "outside_allocator_bytes": None, "devices": 2,
                                "reserve_fraction": None, "expandable_segments": None}
    train = record["train"]
    assert train["device"] == "cpu" and train["world_size"] == 2 and train["iterations"] == 3
    assert train["implementation"]["transformer_impl"] == "local" and train["tflops_per_gpu"] > 0
    assert train["rss_bytes"] > train["planned_bytes"] > 0 and record["sampling"] and record["versions"]

    code, out, _ = run(capsys, "plan", "tiny-local")
    assert f"(calibrated on {node}, {date})" in out
    code, out, _ = run(capsys, "doctor", "--show", "cpu")
    assert code == 0 and f"calibration for cpu: node {node}, {date}" in out and "train check" in out

    # A check without --train refreshes the stack and keeps what --train measured on it.
    assert main(["doctor", *FAST]) == 0
    again = json.loads(saved.read_text())
    assert again["train"] == train and again["memory"]["devices"] == 2


@pytest.mark.train
@pytest.mark.integration
def test_a_failing_train_job_is_one_line_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    exp, plan = doctor.train_experiment(Hardware.load("cpu"), 0, iters=3)
    exp.training.data_path = str(tmp_path / "no-such-dataset")   # the workload refuses it on every rank
    with pytest.raises(doctor.CheckFailed) as failed:
        doctor.run_train(exp, plan, node="n0", progress=lambda line: None)
    message = str(failed.value)
    assert "\n" not in message and message.startswith("train check failed: rank ")
    assert "training.data_path" in message and "no-such-dataset.bin" in message
    assert list(tmp_path.glob("charllm-doctor-*")) == []
    wait_for(lambda: run_processes(str(tmp_path)) == [], 10, "no process of the job left")


def test_bad_input_is_one_line_and_exit_2(capsys, charllm_dirs):
    for argv, says in ((["--hardware", "h10"], "hardware 'h10': no such preset; did you mean 'h100'?"),
                       (["--target", "nowhere"], "--target 'nowhere': no such target"),
                       (["--iters", "0"], "--iters = 0"),
                       (["--nodes", "2"], "--nodes = 2: only for a target whose scheduler allocates its nodes"),
                       (["--show", "h100-sxm-80gb"], "no calibration for this hardware"),
                       (["--show", "h100"], "--show 'h100-sxm-80gb': no calibration for this hardware")):
        code, _, err = run(capsys, "doctor", *argv)
        assert code == 2 and says in one_error_line(err), (argv, err)


@pytest.mark.train
def test_a_gpu_preset_on_this_cpu_node_is_refused(capsys):
    code, _, err = run(capsys, "doctor", "--hardware", "h100-sxm-80gb", *FAST)
    assert code == 2
    assert err.strip().splitlines()[-1] == ("charllm-tui: error: --hardware 'h100-sxm-80gb': a nvidia preset, "
                                            "and this node has no GPU")


@pytest.mark.train
def test_every_epilog_example_runs_as_written(capsys):
    commands = [shlex.split(re.split(r"\s{2,}", line.strip())[0])[1:] for line in EPILOG.splitlines()
                if line.strip().startswith("charllm-tui doctor")]
    assert ["doctor", "--train"] in commands and ["doctor", "--show"] in commands
    for argv in commands:
        build_parser(argv).parse_args(argv)
        if "--train" not in argv:   # the train check runs in its own test, with fewer iterations
            code, _, err = run(capsys, *argv, *([] if "--show" in argv else FAST))
            assert code == 0, (argv, err)


# -- hardware presets from the device -------------------------------------------------------------
def gpus(name: str, gib: float, n: int = 8, capability: str = "9.0") -> list[dict]:
    return [{"index": i, "name": name, "total_bytes": int(gib * 2**30), "capability": capability}
            for i in range(n)]


@pytest.mark.parametrize("devices, preset", [
    (gpus("NVIDIA H100 80GB HBM3", 79.11), "h100-sxm-80gb"),
    (gpus("NVIDIA H200", 139.81), "h200-141gb"),
    (gpus("NVIDIA A100-SXM4-80GB", 79.15, capability="8.0"), "a100-80gb"),
    (gpus("NVIDIA B200", 178.35, capability="10.0"), "b200"),
    (gpus("AMD Instinct MI250X", 63.98), "mi250x"),
    (gpus("AMD Instinct MI250X/MI250", 63.98), "mi250x"),       # as some ROCm releases name it
    (gpus("AMD Instinct MI300X", 191.98), "mi300x"),
    ([], "cpu"),
    # the PCIe and NVL boards, each its own preset (power, clocks, memory), as torch names them
    (gpus("NVIDIA H100 PCIe", 79.11), "h100-pcie-80gb"),
    (gpus("NVIDIA H100 NVL", 93.1), "h100-nvl-94gb"),
    (gpus("NVIDIA H200 NVL", 139.81), "h200-nvl-141gb"),
    (gpus("NVIDIA A100 80GB PCIe", 79.15, capability="8.0"), "a100-pcie-80gb"),
    (gpus("NVIDIA GH200 144G HBM3e", 139.8), None),   # not an H200: names match whole
    (gpus("NVIDIA H100 80GB HBM3", 79.11, capability="8.0"), None),   # the compute capability tells
    (gpus("NVIDIA A100-SXM4-40GB", 39.39, capability="8.0"), None),  # the memory tells
    (gpus("NVIDIA GeForce RTX 4090", 23.6, capability="8.9"), None),
    (gpus("NVIDIA H100 80GB HBM3", 79.11, 1) + gpus("NVIDIA H200", 139.81, 1), None),
])
def test_devices_map_to_hardware_presets(devices, preset):
    found, why = doctor.match_hardware(devices)
    assert found == preset, why
    if preset is None:
        assert "--hardware" in why and "\n" not in why


def test_the_pcie_and_nvl_boards_have_their_own_limits():
    sxm, pcie, nvl = (Hardware.load(n) for n in ("h100-sxm-80gb", "h100-pcie-80gb", "h100-nvl-94gb"))
    assert (sxm.tdp_w, pcie.tdp_w, nvl.tdp_w) == (700.0, 350.0, 400.0)
    assert nvl.usable_bytes > sxm.usable_bytes == pcie.usable_bytes and pcie.bf16_tflops < sxm.bf16_tflops
    assert (Hardware.load("h200-nvl-141gb").tdp_w, Hardware.load("a100-pcie-80gb").tdp_w) == (600.0, 300.0)


def test_a_users_own_hardware_preset_matches_its_devices(charllm_dirs):
    """Hardware identity lives in the presets: a user's preset with the device's name is found."""
    name = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    devices = gpus(name, 94.97, capability="12.0")
    assert doctor.match_hardware(devices)[0] is None
    (charllm_dirs["config"] / "hardware").mkdir(parents=True)
    (charllm_dirs["config"] / "hardware" / "rtx-pro-6000.toml").write_text(
        'description = "RTX PRO 6000"\nvendor = "nvidia"\ncompute_capability = "12.0"\n'
        'device_names = ["NVIDIA RTX PRO 6000 Blackwell*"]\nmemory_bytes = 102005473280\n'
        'usable_bytes = 101974016000\nbf16_tflops = 503.8\n')
    assert doctor.match_hardware(devices) == ("rtx-pro-6000", f"8 x {name}, 94.97 GiB")
    # a preset that claims the same devices as a shipped one makes the match ambiguous, not arbitrary
    (charllm_dirs["config"] / "hardware" / "my-h100.toml").write_text(
        'vendor = "nvidia"\ndevice_names = ["NVIDIA H100 80GB HBM3"]\nusable_bytes = 84943715697\n')
    found, why = doctor.match_hardware(gpus("NVIDIA H100 80GB HBM3", 79.11))
    assert found is None and "h100-sxm-80gb" in why and "my-h100" in why


def test_a_node_s_unknown_gpu_is_matched_with_the_user_s_presets_here(charllm_dirs):
    """A target's node matches against its own presets; the user's live on this side, so the report
    a node prints (as `python -m charllm.engine.doctor report` does) is matched again here."""
    from charllm.engine.launch.nodes import NodeOutput

    name = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    devices = gpus(name, 94.97, capability="12.0")
    why = doctor.match_hardware(devices)[1]
    node = {"node": "n1", "date": "2026-01-01", "hardware": None, "hardware_reason": why, "devices": devices,
            "errors": [why]}
    printed = NodeOutput("n1", json.dumps(node), ["n1: sampling at 20 Hz"], 0)
    assert doctor.NodeResult.from_output(printed).error == why          # no preset here either
    (charllm_dirs["config"] / "hardware").mkdir(parents=True)
    (charllm_dirs["config"] / "hardware" / "rtx-pro-6000.toml").write_text(
        'vendor = "nvidia"\ncompute_capability = "12.0"\ndevice_names = ["NVIDIA RTX PRO 6000 Blackwell*"]\n'
        'usable_bytes = 101974016000\nbf16_tflops = 503.8\n')
    result = doctor.NodeResult.from_output(printed)
    assert result.error is None and result.report["errors"] == []
    assert result.report["hardware"] == "rtx-pro-6000" and "preset of this machine" in result.report["hardware_reason"]
    # a node that printed no report: the target's reason, else the node's own error line
    failed = NodeOutput("n2", "", ["Traceback", "OSError: boom"], 1)
    assert doctor.NodeResult.from_output(failed).error == "OSError: boom"
    assert doctor.NodeResult.from_output(NodeOutput("n3", "", [], 255, "lost the ssh connection (x)")).error \
        == "lost the ssh connection (x)"


def test_a_mig_instance_finds_its_nvml_handle(monkeypatch):
    """torch gives a device's UUID without NVML's prefix: GPU- for a whole GPU, MIG- for an instance."""
    from charllm.engine.workload.train import nvml_handle

    nvml = FakeNvml([FakeGpu(0, uuid="GPU-8c1f2a6e-0000-1111-2222-333344445555"),
                     FakeGpu(1, uuid="MIG-5d1e9c0b-6666-7777-8888-9999aaaabbbb")]).install(monkeypatch)
    assert nvml_handle("8c1f2a6e-0000-1111-2222-333344445555") is nvml.gpus[0]
    assert nvml_handle("5d1e9c0b-6666-7777-8888-9999aaaabbbb") is nvml.gpus[1]
    assert nvml_handle("MIG-5d1e9c0b-6666-7777-8888-9999aaaabbbb") is nvml.gpus[1]
    assert nvml_handle("00000000-0000-0000-0000-000000000000") is None


# -- GPU-side paths against the fake NVML ---------------------------------------------------------
def test_telemetry_and_sampling_on_nvml_gpus(monkeypatch):
    FakeNvml([FakeGpu(0), FakeGpu(1, name="NVIDIA H100 80GB HBM3")]).install(monkeypatch)
    from charllm.probes.backends import open_backends

    backends, reason = open_backends("auto")
    try:
        telemetry = doctor.telemetry_check(backends, reason)
        sampled = doctor.sampling_check(backends, 100.0, 0.5, "n0")
    finally:
        for backend in backends:
            backend.close()
    assert telemetry["backend"] == "nvml, host" and "2 devices found" in telemetry["reason"]
    gpu0 = telemetry["devices"][0]
    assert gpu0["device"] == "gpu0" and "power_w" in gpu0["metrics"] and "throttle_reasons" in gpu0["metrics"]
    by_device = {d["device"]: d for d in sampled["devices"]}
    assert by_device["gpu0"]["target_hz"] == 100.0 and by_device["host"]["target_hz"] == 20.0
    assert by_device["gpu0"]["rows"] > by_device["host"]["rows"] >= 3
    assert by_device["gpu1"]["interval_ms"]["median"] < 50


def test_gpu_train_figures_from_an_iteration_log():
    """The figures a CUDA job's iteration log gives (the workload's own event shapes)."""
    hw = Hardware.load("h100-sxm-80gb")
    exp, plan = doctor.train_experiment(hw, gpus=8, iters=4)
    assert exp.world_size == 8 and exp.model.num_layers == 16 and plan.fits
    planned = plan.stages[-1].total_bytes
    implementation = {"transformer_impl": "local", "attention": "sdpa", "fusions": [], "device": "cuda"}
    events = [{"event": "start", "world_size": 8, "layout": {"device": "cuda"},
               "runtime": {"implementation": implementation}}]
    events += [{"event": "iteration", "iteration": i, "start_ns": 0, "end_ns": 500_000_000, "warmup": i <= 2,
                "tflops_per_gpu": 400.0 + i} for i in range(1, 5)]
    events.append({"event": "end", "memory": [{"pp_rank": 0, "allocated_bytes": int(planned * 1.1),
                                               "reserved_bytes": int(planned * 1.2),
                                               "outside_allocator_bytes": 3 * 2**30}]})
    figures = doctor.measurements(exp, plan, events, "n0")
    assert figures["plan_error_pct"] == pytest.approx(10.0, abs=0.01)
    assert figures["reserved_over_allocated"] == pytest.approx(1.2 / 1.1, rel=1e-6)
    assert figures["outside_allocator_bytes"] == 3 * 2**30
    assert figures["tflops_per_gpu"] == 403.5 and figures["mfu_pct"] == pytest.approx(100 * 403.5 / 989.4)
    assert figures["peak_precision"] == "bf16"
    assert figures["planned_implementation"]["transformer_impl"] == plan.implementation.transformer
    report = {"hardware": "h100-sxm-80gb", "node": "n0", "date": "2026-01-02", "errors": [],
              "stack": {"cuda": True, "capability": [9, 0], "extensions": []},
              "devices": gpus("NVIDIA H100 80GB HBM3", 79.11), "train": figures}
    record = doctor.calibration_record(report)
    churn = int(planned * 1.1) - plan.stages[-1].steady_bytes
    assert figures["reserve_fraction"] == pytest.approx((int(planned * 1.2) - int(planned * 1.1)) / churn)
    assert record["memory"] == {"usable_bytes": int(79.11 * 2**30), "outside_allocator_bytes": 3 * 2**30, "devices": 8,
                                "reserve_fraction": figures["reserve_fraction"], "expandable_segments": True}
    # the speed model: the GEMM efficiency at which it gives the measured 0.5 s step is what plans then use
    found = figures["speed"]["matmul_efficiency"]
    assert figures["speed"]["measured_step_s"] == 0.5 and 0 < found < 1
    assert figures["speed"]["assumed_step_s"] != pytest.approx(0.5, rel=1e-2)
    assert record["speed"] == {"matmul_efficiency": found}
    calibration.save({**record, "train": None})
    assert speed.estimate(exp).step_s == pytest.approx(0.5, rel=1e-2)
    assert speed.estimate(exp).rates_source == "calibrated on n0, 2026-01-02"


def figures_of(exp, plan, *, tf32: bool | None, tflops: float = 40.0) -> dict:
    implementation = {"transformer_impl": "local", "attention": "sdpa", "fusions": [], "device": "cuda"}
    events = [{"event": "start", "world_size": 1, "layout": {"device": "cuda"},
               "runtime": {"implementation": implementation, **({} if tf32 is None else {"tf32": tf32})}}]
    events += [{"event": "iteration", "iteration": i, "start_ns": 0, "end_ns": 10**9, "warmup": False,
                "tflops_per_gpu": tflops} for i in (1, 2)]
    events.append({"event": "end", "memory": [{"pp_rank": 0, "allocated_bytes": 2**30, "reserved_bytes": 2**31,
                                               "outside_allocator_bytes": None}]})
    return doctor.measurements(exp, plan, events, "n0")


def test_mfu_is_against_the_peak_of_the_precision_that_ran():
    """An fp32 job's matmuls run at the FP32 rate, or the TF32 rate where the run allowed TF32 (the
    workload records torch's setting): against the BF16 peak its MFU would read about 15x too low."""
    import dataclasses

    h100 = Hardware.load("h100-sxm-80gb")
    exp, plan = doctor.train_experiment(h100, gpus=1, iters=2)
    exp.training.bf16 = False
    fp32 = figures_of(exp, plan, tf32=False)
    assert (fp32["peak_precision"], fp32["peak_tflops"]) == ("fp32", 66.9)
    assert fp32["mfu_pct"] == pytest.approx(100 * 40.0 / 66.9)
    tf32 = figures_of(exp, plan, tf32=True)
    assert (tf32["peak_precision"], tf32["peak_tflops"]) == ("tf32", 494.7)
    assert figures_of(exp, plan, tf32=None)["peak_precision"] == "fp32"     # a record without it: torch's default
    exp.hardware = dataclasses.replace(h100, fp32_tflops=None)
    unknown = figures_of(exp, plan, tf32=False)
    assert unknown["peak_tflops"] is None and unknown["mfu_pct"] is None
    exp.training.bf16 = True
    assert figures_of(exp, plan, tf32=True)["peak_precision"] == "bf16"


def test_the_train_check_plans_the_stack_the_node_has(monkeypatch):
    """A GPU node without Transformer Engine: the job it trains runs local layers, and its plan is of
    the same (not of NVIDIA's container, which planning assumes until a node is calibrated)."""
    from charllm.engine.model import runtime

    facts = {"versions": {"torch": "2.13.0"}, "driver": "580.159", "devices": gpus("NVIDIA H100 80GB HBM3", 79.11, 1),
             "stack": {"cuda": True, "capability": [9, 0], "extensions": [], "compiler": "/usr/bin/gcc"}}
    monkeypatch.setattr(doctor.report, "software", lambda timeout=None: facts)   # gather's own names
    planned = []

    def run_train(exp, plan, **kwargs):
        planned.append((exp, plan))
        return {"planned": True}

    monkeypatch.setattr(doctor.report, "run_train", run_train)
    said: list[str] = []
    report = doctor.gather(train=True, rates=(20.0,), sample_seconds=0.2, progress=said.append)
    assert report["hardware"] == "h100-sxm-80gb" and report["train"] == {"planned": True}
    (exp, plan), = planned
    found = runtime.Stack.from_dict(facts["stack"], source="found")
    assert plan.implementation == runtime.resolve(exp, found) and plan.implementation.transformer == "local"
    assert report["implementation"]["transformer_impl"] == plan.implementation.transformer
    assert any(f"planned as {plan.implementation.describe()}" in line for line in said)


def test_small_gpus_get_a_smaller_job():
    import dataclasses

    h100 = Hardware.load("h100-sxm-80gb")
    for gib in (24, 12, 8):
        small = dataclasses.replace(h100, name=f"gpu-{gib}", usable_bytes=gib * 2**30, memory_bytes=gib * 2**30)
        exp, plan = doctor.train_experiment(small, gpus=1)
        m = exp.model
        chosen = doctor.TRAIN_SHAPES.index((m.num_layers, exp.training.micro_batch_size, exp.seq_length,
                                            m.vocab_size))
        assert chosen > 0 and plan.fits                       # smaller than the H100's job, and it fits
        larger = doctor.llama_experiment(small, 1, *doctor.TRAIN_SHAPES[chosen - 1], doctor.TRAIN_ITERS)
        assert not estimate(larger).fits                      # the largest shape that fits
    tiny = dataclasses.replace(h100, name="tiny-gpu", usable_bytes=2**30, memory_bytes=2**30)
    with pytest.raises(doctor.CheckFailed, match="does not fit tiny-gpu"):
        doctor.train_experiment(tiny, gpus=1)


@pytest.mark.train
def test_the_doctor_module_keeps_torch_out_of_this_process():
    import subprocess
    import sys

    code = ("import sys\nfrom charllm.engine import doctor\nr = doctor.gather(rates=(20.0,), sample_seconds=0.2)\n"
            "print(r['hardware'], 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ})
    assert done.stdout.split() == ["cpu", "False"], done.stderr
    assert calibration.directory().exists() is False


@pytest.mark.parametrize("argv, says", [(["report", "--iters", "0"], "--iters = 0: must be at least 1"),
                                        (["report", "--hardware", "nope"], "hardware 'nope'"),
                                        (["report", "--train=x"], "--train"), (["fix"], "invalid choice: 'fix'")])
def test_the_node_entry_point_says_bad_input_in_one_line(argv, says):
    """What a target's nodes run (`python -m charllm.engine.doctor`): its own argv, not the CLI's."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "charllm.engine.doctor", *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("charllm-tui: error: ") and says in done.stderr
    assert doctor.error_line(done.stderr, 2) == done.stderr.removeprefix("charllm-tui: error: ").strip()


@pytest.mark.train   # the node report reads the software stack, torch included: without it that is its error
def test_the_local_target_runs_the_engine_entry_point_in_a_child():
    """`doctor --target local`: Target.run_on_nodes runs `python -m charllm.engine.doctor report` here."""
    from charllm.engine.launch.targets import LOCAL

    argv = doctor.node_argv("python3", train=False, hardware=None, node=None, sample_seconds=0.2, iters=3, timeout=60)
    assert argv[:4] == ["python3", "-m", "charllm.engine.doctor", "report"]
    said: list[str] = []
    (result,) = doctor.on_target(LOCAL, sample_seconds=0.2, progress=said.append)
    assert result.error is None and result.report["hardware"] == "cpu" and result.node == doctor.node_name()
    assert any(line.endswith("sampling at 20 Hz for 0.2 s") for line in said), said   # its stderr, forwarded
