"""`python -m charllm.probes ...`: the probe command without the TUI (for compute nodes)."""

from __future__ import annotations

import argparse
import sys

from charllm.probes.cli import add_arguments, run
from charllm.probes.core.errors import UserError, one_line, os_error_line


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="python -m charllm.probes",
                                                   description="Sample GPU and host telemetry on this node."))
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as exc:
        print(f"charllm-probes: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of --stream went away
        return 0
    except OSError as exc:  # the exit status convention of charllm-tui (tui/cli.py)
        print(f"charllm-probes: error: {one_line(os_error_line(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
