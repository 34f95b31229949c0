"""`python -m charllm.engine.doctor`: the node's side of doctor on a target (fanout.py), and the
child interpreter that reads the software stack (software.py). Its own small argv, so that the
engine never depends on the command line's flags:

    python -m charllm.engine.doctor software
        this node's stack as one JSON line (imports torch and every extension)
    python -m charllm.engine.doctor report [--train] [--hardware NAME] [--node NAME]
                                           [--sample-seconds S] [--iters N] [--timeout S]
        every check (report.gather): the report as JSON on stdout, progress on stderr; saves nothing

Bad input is one line on stderr, "charllm-tui: error: ..." (what software.error_line picks out), exit 2.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import NoReturn

from charllm.engine.doctor.report import gather
from charllm.engine.doctor.sampling import SAMPLE_SECONDS
from charllm.engine.doctor.software import describe_here
from charllm.engine.doctor.train import TRAIN_ITERS, TRAIN_TIMEOUT_S
from charllm.probes.core.errors import UserError


def fail(message: str) -> NoReturn:
    print(f"charllm-tui: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:   # one line, not usage and error
        fail(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m charllm.engine.doctor")
    sub = p.add_subparsers(dest="what", required=True, parser_class=_Parser)
    sub.add_parser("software")
    r = sub.add_parser("report")
    r.add_argument("--train", action="store_true")
    r.add_argument("--hardware")
    r.add_argument("--node")
    r.add_argument("--sample-seconds", type=float, default=SAMPLE_SECONDS)
    r.add_argument("--iters", type=int, default=TRAIN_ITERS)
    r.add_argument("--timeout", type=float, default=TRAIN_TIMEOUT_S)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.what == "software":
        print(json.dumps(describe_here()))
        return 0

    def interrupted(signum, frame):
        raise KeyboardInterrupt   # unwinds through the train check, which stops its job

    signal.signal(signal.SIGTERM, interrupted)
    try:
        report = gather(train=args.train, hardware=args.hardware, node=args.node, sample_seconds=args.sample_seconds,
                        iters=args.iters, timeout=args.timeout,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    except UserError as exc:
        fail(str(exc))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
