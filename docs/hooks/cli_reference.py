"""MkDocs hook: the CLI reference page is the argparse parser's own help, so it cannot drift."""

import argparse
import os

MARKER = "<!-- fxreplace-cli-reference -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; the page needs a fixed width
    from fxreplace.cli import build_parser

    parser = build_parser()
    sections = [f"```text\n{parser.format_help()}```"]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        sections.append(f"## `fxreplace {name}`\n\n```text\n{sub.format_help()}```")
    return markdown.replace(MARKER, "\n\n".join(sections))
