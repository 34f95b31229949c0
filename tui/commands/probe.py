"""`charllm-tui probe`: list devices, or sample and record telemetry (see charllm.probes.cli)."""

from __future__ import annotations

from charllm.probes.cli import add_arguments, run


def register(subparsers, name: str, help: str) -> None:
    parser = subparsers.add_parser(
        name, help=help,
        description="Sample GPU and host telemetry on this node (NVML, AMD SMI, host, sim, replay) "
                    "into a run directory, a live table or an Arrow stream on stdout.")
    add_arguments(parser)
    parser.set_defaults(func=_handle)


def _handle(args) -> int:
    return run(args)
