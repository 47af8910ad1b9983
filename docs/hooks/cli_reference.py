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
    sections += _commands(parser, "fxreplace", "##")
    return markdown.replace(MARKER, "\n\n".join(sections))


def _commands(parser, prefix: str, level: str) -> list[str]:
    """A section per subcommand, and one per step of a command that has steps (``repro write``)."""
    sections = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                sections.append(f"{level} `{prefix} {name}`\n\n```text\n{sub.format_help()}```")
                sections += _commands(sub, f"{prefix} {name}", level + "#")
    return sections
