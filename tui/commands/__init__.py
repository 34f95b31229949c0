"""One module per headless subcommand; each exposes `register(subparsers)`."""
