"""``fxreplace demo``: the whole workflow on the built-in tiny model."""

from __future__ import annotations

from ..demo import DemoConfig, run_demo
from .common import check_writable_dir, folder_state


def run(args) -> int:
    check_writable_dir(args.report_dir, "--report-dir")
    args.produced.describe = lambda: f"{folder_state(args.report_dir, '--report-dir')}; rerun `fxreplace demo`"
    run_demo(DemoConfig(prompts=args.prompts, new_tokens=args.new_tokens, compile=args.compile is not False,
                        report_dir=args.report_dir, device=args.device or "cpu"))
    return 0
