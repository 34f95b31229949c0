"""A report as the node calibration `engine.model.calibration` saves and planning reads.

Without a train check the record holds the stack and torch's capacity only; a memory or speed
measurement an earlier `--train` made on the same stack is kept, never replaced by less."""

from __future__ import annotations

from pathlib import Path

from charllm.engine.doctor.software import CheckFailed
from charllm.engine.model import calibration

# What a calibration keeps of a report (besides its memory figures and the train check).
RECORD_KEYS = ("hardware", "hardware_reason", "node", "date", "stack", "versions", "driver", "devices",
               "implementation", "telemetry", "sampling")


def calibration_record(report: dict, previous: dict | None = None) -> dict:
    """The calibration `engine.model.calibration.save` writes for this report's hardware. `previous` is the
    record saved before: its train measurement stays while the stack is the same and this report
    has none of its own."""
    train = report.get("train") if report.get("train") and not report["train"].get("error") else None
    gpus = report.get("devices") or []
    memory = {
        "usable_bytes": min(d["total_bytes"] for d in gpus) if gpus else None,   # torch's total capacity
        "outside_allocator_bytes": train.get("outside_allocator_bytes") if train else None,
        "devices": train["world_size"] if train else max(1, len(gpus)),
        "reserve_fraction": train.get("reserve_fraction") if train else None,
        "expandable_segments": train.get("expandable_segments") if train else None,
    }
    figures = {"matmul_efficiency": (train.get("speed") or {}).get("matmul_efficiency")} if train else {}
    if train is None and previous and previous.get("train") and previous.get("stack") == report.get("stack"):
        train = previous["train"]
        old = previous.get("memory") or {}
        memory["outside_allocator_bytes"] = old.get("outside_allocator_bytes")
        memory["devices"] = old.get("devices", memory["devices"])
        memory["reserve_fraction"] = old.get("reserve_fraction")
        memory["expandable_segments"] = old.get("expandable_segments")
        figures = previous.get("speed") or {}
    record = {key: report[key] for key in RECORD_KEYS if key in report}
    record.update(memory=memory, train=train, speed=figures)
    return record


def save_calibration(report: dict) -> Path:
    if report.get("hardware") is None or report.get("stack") is None:
        raise CheckFailed("no calibration saved: " + (report["errors"][0] if report.get("errors") else
                                                      "the node's hardware or software is not known"))
    previous = calibration.load(report["hardware"])
    return calibration.save(calibration_record(report, previous.data if previous else None))


def saved_calibrations() -> list[dict]:
    """Every saved calibration record, newest first (damaged files are skipped, with a warning)."""
    found = [calibration.load(p.stem) for p in sorted(calibration.directory().glob("*.json"))
             if not p.name.endswith(".power.json")]          # (power fits: calibration.saved_power)
    return sorted((c.data for c in found if c is not None), key=lambda r: (r.get("date", ""), r["hardware"]),
                  reverse=True)
