"""Checking a node: what `charllm-tui doctor` gathers, headless (the CLI and the TUI show it).

`gather()` returns the report, a plain JSON-able dict, so that a remote node's report (`python -m
charllm.engine.doctor report`, run by the target on each node: `on_target()`) reads exactly like
this node's:

    node, date                 the node's name and the UTC date (YYYY-MM-DD)
    hardware, hardware_reason  the hardware preset this node is: matched by device name and memory
                               (`match_hardware`), or --hardware; None for an unknown GPU
    versions, driver, devices, stack
                               `runtime.describe(runtime.detect())`, run in a child interpreter so
                               that importing torch and every extension stays out of this process
                               (the TUI's)
    implementation             what transformer_impl = "auto" becomes here for a Llama-style model
    telemetry                  the backend `auto` picks, why, and each device's supported metrics
    sampling                   the real sampler, ~2 s at 20 Hz and at 100 Hz: rows per device per
                               second, intervals between a device's rows, missed deadlines
    train                      (--train) a short real training job sized to the device: allocator
                               peak against the plan, reserved against allocated, memory outside
                               the allocator, TFLOP/s and MFU, what implementation ran, the step
                               time the speed model assumed for it and the large-GEMM efficiency
                               that gives the measured one (engine.model.speed)
    errors                     one line per failed check (the CLI exits 1 when there is any)

`calibration_record()` turns a report into the node calibration `engine.model.calibration` saves and
planning reads.

One module per concern; this package is their public face (`from charllm.engine import doctor`):

    software.py    the node's name, its software stack (a child interpreter), a failure's line
    hardware.py    which hardware preset the node's GPUs are (the presets' device_names)
    sampling.py    telemetry and the sampling rates achieved
    train.py       the train check job and its measurements
    report.py      every check on this node: gather()
    calibrate.py   a report as a saved node calibration
    fanout.py      every node of a target (the target runs __main__.py there)
"""

from __future__ import annotations

from charllm.engine.doctor.calibrate import RECORD_KEYS, calibration_record, save_calibration, saved_calibrations
from charllm.engine.doctor.fanout import NodeResult, node_argv, on_target, parse_report, remote_wait
from charllm.engine.doctor.hardware import MEMORY_TOLERANCE, check_hardware, hardware_presets, is_device, match_hardware
from charllm.engine.doctor.report import check_options, gather
from charllm.engine.doctor.sampling import SAMPLE_SECONDS, SAMPLING_HZ, sampling_check, telemetry_check
from charllm.engine.doctor.software import (
    SOFTWARE_TIMEOUT_S,
    CheckFailed,
    Progress,
    error_line,
    node_name,
    software,
    today,
)
from charllm.engine.doctor.train import (
    CPU_EXPERIMENT,
    LLAMA_1_5B,
    MICROBATCHES,
    TRAIN_ITERS,
    TRAIN_SHAPES,
    TRAIN_TIMEOUT_S,
    llama_experiment,
    measurements,
    run_train,
    train_experiment,
)

__all__ = [
    "CPU_EXPERIMENT", "LLAMA_1_5B", "MEMORY_TOLERANCE", "MICROBATCHES", "RECORD_KEYS", "SAMPLE_SECONDS", "SAMPLING_HZ",
    "SOFTWARE_TIMEOUT_S", "TRAIN_ITERS", "TRAIN_SHAPES", "TRAIN_TIMEOUT_S", "CheckFailed", "NodeResult", "Progress",
    "calibration_record", "check_hardware", "check_options", "error_line", "gather", "hardware_presets", "is_device",
    "llama_experiment", "match_hardware", "measurements", "node_argv", "node_name", "on_target", "parse_report",
    "remote_wait", "run_train", "sampling_check", "save_calibration", "saved_calibrations", "software",
    "telemetry_check", "today", "train_experiment",
]
