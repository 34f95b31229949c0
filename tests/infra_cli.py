"""Running `charllm-tui COMMAND ...` in-process for tests: exit code, stdout, stderr."""

from __future__ import annotations

from charllm.tui.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """Bad input is one `charllm-tui: error:` line, no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("charllm-tui: error: ") and "Traceback" not in err, err
    return lines[0]
