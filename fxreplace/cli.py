"""The ``fxreplace`` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    run_demo(DemoConfig(prompts=args.prompts, new_tokens=args.new_tokens, compile=not args.eager, report_dir=args.report_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxreplace", description="Tensor replacement for accuracy debugging of compiled LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="capture, run compiled bf16 with and without router replacement, validate, report")
    demo.add_argument("--prompts", type=int, default=8)
    demo.add_argument("--new-tokens", type=int, default=32)
    demo.add_argument("--eager", action="store_true", help="do not torch.compile the target")
    demo.add_argument("--report-dir", default="fxreplace-report")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
