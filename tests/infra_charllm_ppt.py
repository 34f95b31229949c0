"""Results in the CharLLM-PPT artifact's own layout (one `{metric}_{rank}.csv` per metric and rank, and
the host files of rank 0), for the importer's tests and the README's import example."""

from __future__ import annotations

import numpy as np

T0 = 1_730_000_000.0
T = T0 + np.round(np.arange(0, 41) * 0.05, 10)   # 2 s at 20 Hz


def _write(d, name, t, v):
    (d / name).write_text("".join(f"{float(a)!r},{float(b)!r}\n" for a, b in zip(t, v)))


def make_results(d, ranks=2, gpus_per_node=1):
    """2 s at 20 Hz of every metric the importer reads, for `ranks` ranks, in folder `d`."""
    d.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        power = np.where(np.arange(T.size) < 20, 300.0, 500.0) + r
        _write(d, f"gpu_power_{r}.csv", T, power)
        _write(d, f"mem_power_{r}.csv", T, np.full(T.size, 40.0))
        _write(d, f"gpu_thermal_{r}.csv", T, np.full(T.size, 60.0 + r))
        _write(d, f"mem_thermal_{r}.csv", T, np.full(T.size, 70.0))
        _write(d, f"sm_clock_{r}.csv", T, np.full(T.size, 1980.0))
        _write(d, f"mem_clock_{r}.csv", T, np.full(T.size, 2619.0))
        util = np.full(T.size, 90.0)
        util[3] = -1                                        # the artifact's failed read
        _write(d, f"gpu_util_{r}.csv", T, util)
        _write(d, f"mem_util_{r}.csv", T, np.full(T.size, 50.0))
        # NVLink: a 32-bit KiB counter that wraps; 1000 KiB per tick
        kib = (np.arange(T.size) * 1000 + 2**32 - 15_000) % 2**32
        _write(d, f"nvlink_tx_throughput_{r}.csv", T, kib)
        _write(d, f"nvlink_rx_throughput_{r}.csv", T, kib)
        # PCIe: byte counters (wrapping) and throughput in KB/s
        _write(d, f"pcie_tx_bytes_{r}.csv", T, (np.arange(T.size) * 5_000_000 + 2**32 - 7_000_000) % 2**32)
        _write(d, f"pcie_rx_bytes_{r}.csv", T, np.arange(T.size) * 1_000_000)
        _write(d, f"pcie_tx_throughput_{r}.csv", T, np.full(T.size, 1.0))
        _write(d, f"pcie_rx_throughput_{r}.csv", T, np.full(T.size, 1.0))
    # host files of rank 0: two CPUs, cumulative seconds; busy 0.03 s and idle 0.02 s per CPU per tick
    for cpu in (0, 1):
        _write(d, f"system_cpu_usage_rank_0_id_{cpu}.csv", T, np.arange(T.size) * 0.03)
        _write(d, f"system_cpu_idle_rank_0_id_{cpu}.csv", T, np.arange(T.size) * 0.02)
    _write(d, "system_cpu_temp_rank_0_id_0.csv", T, np.full(T.size, 55.0))
    _write(d, "system_ib_rx_bytes_rank_0_id_ib0.csv", T, np.arange(T.size) * 100.0)
    _write(d, "system_ib_rx_bytes_rank_0_id_ib1.csv", T, np.arange(T.size) * 50.0)
    _write(d, "system_memory_used_0.csv", T, np.full(T.size, 1000.0))
    _write(d, "system_memory_free_0.csv", T, np.full(T.size, 400.0))
    return d
