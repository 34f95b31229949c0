"""Where charllm keeps things: platformdirs locations, overridable by CHARLLM_* variables.

| what | default | override |
|---|---|---|
| config (experiments, targets.toml, tui.toml) | platformdirs user_config_dir("charllm") | CHARLLM_CONFIG_DIR |
| data (baselines) | platformdirs user_data_dir("charllm") | CHARLLM_DATA_DIR |
| runs (one directory per run) | <data>/runs | CHARLLM_RUNS_DIR |
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from charllm.probes.core.errors import UserError
from charllm.probes.core.files import read_bounded

APP = "charllm"
MAX_TOML_BYTES = 4 * 2**20


def _dir(env: str, default) -> Path:
    value = os.environ.get(env)
    return Path(value).expanduser() if value else Path(default())


def read_toml(path: Path, what: str = "file") -> dict:
    """A TOML file as a dict; a missing file or bad syntax is one UserError line naming the file."""
    try:  # a preset is a few KiB: a pipe, a device or something huge is refused before it is read
        text = read_bounded(Path(path).expanduser(), MAX_TOML_BYTES, what)
    except FileNotFoundError:
        raise UserError(f"{what} {str(path)!r}: no such file") from None
    except OSError as exc:
        raise UserError(f"{what} {str(path)!r}: cannot read ({exc.strerror})") from None
    try:
        return tomllib.loads(text.decode())
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {str(path)!r}: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{what} {str(path)!r}: invalid TOML ({exc})") from None
    except RecursionError:
        raise UserError(f"{what} {str(path)!r}: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise UserError(f"{what} {str(path)!r}: invalid TOML ({exc})") from None


def config_dir() -> Path:
    from platformdirs import user_config_dir

    return _dir("CHARLLM_CONFIG_DIR", lambda: user_config_dir(APP))


def data_dir() -> Path:
    from platformdirs import user_data_dir

    return _dir("CHARLLM_DATA_DIR", lambda: user_data_dir(APP))


def runs_dir() -> Path:
    return _dir("CHARLLM_RUNS_DIR", lambda: data_dir() / "runs")


def baselines_dir() -> Path:
    return data_dir() / "baselines"


def targets_file() -> Path:
    return config_dir() / "targets.toml"


def output_file(value, option: str) -> Path:
    """A file a command is asked to write: an empty name, a directory, or a directory that does
    not exist (never created silently: a typo would scatter files) is one UserError line."""
    text = "" if value is None else str(value)
    if not text.strip():
        raise UserError(f"{option} {text!r}: give a file name")
    path = Path(text).expanduser()
    if path.is_dir():
        raise UserError(f"{option} {text!r}: is a directory; give a file name")
    if path.exists() and not path.is_file():  # the atomic rename would replace a device or a pipe
        raise UserError(f"{option} {text!r}: not a regular file (a device or a pipe); give a file name")
    _check_parent(path, text, option)
    return path


def output_dir(value, option: str) -> Path:
    """A directory a command will create or add to: its parent must exist."""
    text = "" if value is None else str(value)
    if not text.strip():
        raise UserError(f"{option} {text!r}: give a directory")
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{option} {text!r}: exists and is not a directory")
    _check_parent(path, text, option)
    return path


def _check_parent(path: Path, text: str, option: str) -> None:
    if any(ord(c) < 32 or c == "\x7f" for c in text):
        raise UserError(f"{option} {text!r}: a name with control characters (a newline?)")
    if any(len(part.encode()) > 255 for part in path.parts):
        raise UserError(f"{option} {text[:60]!r}...: a name longer than 255 bytes")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise UserError(f"{option} {text!r}: directory {str(parent)!r} does not exist (create it first)")

