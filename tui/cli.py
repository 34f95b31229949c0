"""`charllm-tui`: with no arguments the workbench (TUI); with a subcommand, the headless tool.

Every subcommand lives in `charllm.tui.commands.<module>` and exposes `register(subparsers)`,
which adds its parser and sets `func`. Command modules import heavy libraries (polars, torch)
lazily, inside their handlers, so `--help` and the TUI start fast.
"""

from __future__ import annotations

import argparse
import sys

from charllm.probes.core.errors import UserError, one_line, os_error_line
from charllm.tui.commands import (
    baseline,
    campaign,
    compare,
    doctor,
    export,
    fields,
    import_results,
    launch,
    plan,
    presets,
    probe,
    runs,
    summarize,
    sweep,
)

# In the order `--help` lists them.
COMMANDS = (plan, sweep, presets, fields, export, probe, summarize, compare, baseline, import_results, launch, runs,
            campaign, doctor)

DESCRIPTION = """\
A terminal workbench for the power, performance and thermal characterization of distributed
LLM training. Run without a command to open the workbench (TUI); the commands below are the
same features, headless, for scripts."""

# The one exit-status convention of every command (plan's and doctor's --help repeat their part).
EXIT_STATUS = """\
exit status:
  0    done
  1    done, and the answer is a failure: plan: a stage does not fit; doctor: a check failed;
       import: a folder was not imported; launch --follow: the run failed; runs cancel: the run
       ended otherwise first
  2    not done: bad input, or a file or directory it cannot read or write (permission denied,
       read-only, disk full, missing); one line on stderr says which and why
  3    plan: tight
  130  interrupted (launch --follow: cancelled)"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line and exit code 2 (no usage dump)."""

    def error(self, message: str):  # argparse API
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="charllm-tui", description=DESCRIPTION, epilog=EXIT_STATUS,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # deferred: ~17 ms at start-up (--help)

    try:
        return f"charllm-tui {version('charllm-tui')}"
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "charllm-tui (source)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command is None:
            return run_tui()
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"charllm-tui: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("charllm-tui: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `charllm-tui sweep ... | head`
        return 0
    except OSError as exc:  # a full disk, a read-only place, a directory where a file should be...
        print(f"charllm-tui: error: {one_line(os_error_line(exc))}", file=sys.stderr)
        return 2


def run_tui() -> int:
    from charllm.tui.app import main as app_main  # deferred: textual is not loaded for headless commands

    return int(app_main() or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
