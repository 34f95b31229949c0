"""One module per headless subcommand; each exposes `register(subparsers)`."""

from __future__ import annotations

import argparse


def add_command(sub, name: str, help: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand's parser whose --help shows its description and examples as written (line breaks kept)."""
    return sub.add_parser(name, help=help, description=description, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
