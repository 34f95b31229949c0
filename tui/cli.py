"""`charllm-tui`: with no arguments the workbench (TUI); with a subcommand, the headless tool.

Every subcommand lives in `charllm.tui.commands.<module>` (COMMANDS) and exposes
`register(subparsers, name, help)`, which adds its parser and sets `func`. Only the module of the
command being run is imported, and command modules import heavy libraries (polars, torch) inside
their handlers, so `--help`, quick commands and the TUI start fast.
"""

from __future__ import annotations

import argparse
import sys

from charllm.probes.core.errors import UserError, one_line, os_error_line

# Every subcommand, in the order `--help` lists it: its module in charllm.tui.commands and its one-line
# help. A command's module (and what it imports: the engine, numpy, polars) is loaded only when that
# command runs, so `--help` and quick commands start in a fraction of a second.
COMMANDS = {
    "plan": ("plan", "per-stage peak memory, fit verdict and step time of an experiment"),
    "sweep": ("sweep", "every valid parallel layout with its peak memory, ranked"),
    "presets": ("presets", "list and show model, hardware and experiment presets"),
    "fields": ("fields", "every experiment field --set takes, with what it means"),
    "export": ("export", "write an experiment as Megatron-LM flags or as resolved TOML"),
    "probe": ("probe", "list GPUs/host sensors, or sample and record telemetry"),
    "summarize": ("summarize", "summarize a run: power, energy, thermals, throttling, MFU, ranks, kernels"),
    "compare": ("compare", "compare runs and baselines side by side"),
    "baseline": ("baseline", "save, list, show and delete baselines"),
    "import": ("import_results", "import other tools' results as runs (CharLLM-PPT / Zeus CSVs)"),
    "launch": ("launch", "launch an experiment (or your own command) on a target with a telemetry probe on every node"),
    "attach": ("attach", "record a Slurm job or a process that already runs, with a probe on every node"),
    "runs": ("runs", "list, inspect, follow, cancel and delete runs"),
    "campaign": ("campaign", "many experiments as one job: plan, run, follow, summarize and draw them"),
    "doctor": ("doctor", "check this node (or a target's nodes) and save its calibration"),
}

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


def build_parser(argv: list[str] | None = None, *, every: bool = False) -> argparse.ArgumentParser:
    """The command line's parser. Only the command `argv` names gets its whole parser (its module is
    imported); the others are listed by name and help. `every`: all of them whole (the tests that
    read every command's options)."""
    parser = _Parser(prog="charllm-tui", description=DESCRIPTION, epilog=EXIT_STATUS,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    chosen = next((word for word in argv or [] if not word.startswith("-")), None)
    for name, (module, help_line) in COMMANDS.items():
        if every or name == chosen:
            command_module(name).register(sub, name, help_line)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def command_module(name: str):
    """The module of command `name` (COMMANDS), imported now."""
    import importlib  # deferred: only a command that runs needs it

    return importlib.import_module(f"charllm.tui.commands.{COMMANDS[name][0]}")


class _Version(argparse.Action):
    """--version, whose text is looked up only when asked for (the package metadata costs start-up time)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(message=_version() + "\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # deferred: ~17 ms at start-up

    try:
        return f"charllm-tui {version('charllm-tui')}"
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "charllm-tui (source)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
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
