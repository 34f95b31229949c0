"""The Textual workbench and the `charllm-tui` command line.

Importing this package does not import textual: the headless subcommands stay fast and light.
"""
