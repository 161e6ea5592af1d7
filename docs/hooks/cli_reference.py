"""MkDocs hook: the CLI reference is generated from kvshare's argparse parsers at build time.

``docs/reference/cli.md`` holds the marker ``<!-- cli-reference -->``; every command and
sub-command's ``--help`` replaces it, so the reference cannot drift from the code.
"""
from __future__ import annotations

import argparse
import os

MARKER = "<!-- cli-reference -->"
WIDTH = "100"


def _commands(parser: argparse.ArgumentParser, name: str):
    """(full command name, parser) for a parser and, depth first, its sub-commands."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


def render() -> str:
    from kvshare.cli import build_parser
    from kvshare.eval.cli import compare_parser

    os.environ["COLUMNS"] = WIDTH  # argparse wraps to the terminal's width
    commands = list(_commands(build_parser(), "kvshare"))
    commands.append(("kvshare eval compare", compare_parser()))
    commands.sort(key=lambda item: item[0])
    parts = []
    for name, parser in commands:
        parts.append(f"## `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
