"""JUnit XML for CI: one test case per validated prompt, or per blamed component.

CI servers (GitLab, Jenkins, GitHub test reporters) read this format, so an accuracy
check shows up beside the unit tests of a compiler or kernel change.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from .metrics import CONTRIBUTES
from .words import fmt, pct


def write_validation_junit(result, gate, path: str | Path) -> Path:
    """One case per prompt, failed when :meth:`Gate.failures` names a reason; with ``floor=K`` one
    more for the whole validation, failed when :meth:`Gate.overall` does."""
    failures = gate.failures(result)
    overall = gate.overall(result)
    summary = result.summary()["off"]["prompts"]
    cases = len(failures) + (gate.floor is not None)
    suite = _suite("fxreplace.validate", cases, sum(bool(r) for r in failures.values()) + bool(overall))
    if gate.floor is not None:
        case = ET.SubElement(suite, "testcase", classname="fxreplace.validate", name="all prompts, on the noise floor's scale")
        if overall:
            ET.SubElement(case, "failure", message="; ".join(overall), type="accuracy").text = result.verdict.sentence
    for p, reasons in failures.items():
        s = summary[p]
        case = ET.SubElement(suite, "testcase", classname="fxreplace.validate", name=f"prompt {p}")
        out = (f"first divergence: {s['first_divergence']}; mean KL {fmt(s['mean_kl'])}; "
               f"mean top-5 error {fmt(s['mean_top5_error'])}; text: {result.prompt_texts.get(p)!r}")
        ET.SubElement(case, "system-out").text = out
        if reasons:
            ET.SubElement(case, "failure", message="; ".join(reasons), type="accuracy").text = result.verdict.sentence
    return _write(suite, path)


def write_blame_junit(result, path: str | Path) -> Path:
    """One case per ranked component: failed when it accounts for at least the share that
    counts as contributing (:data:`fxreplace.metrics.CONTRIBUTES`) of the divergence."""
    guilty = [b for b in result.ranking if (b.share or 0) >= CONTRIBUTES]
    suite = _suite("fxreplace.blame", len(result.ranking), len(guilty))
    for b in result.ranking:
        case = ET.SubElement(suite, "testcase", classname=f"fxreplace.blame.{b.kind}", name=b.component)
        if b in guilty:
            ET.SubElement(case, "failure", message=f"accounts for {pct(b.share)} of the divergence "
                          f"(KL {fmt(b.kl_off)} -> {fmt(b.kl_on)} when replaced)", type="accuracy").text = result.verdict
    return _write(suite, path)


def _suite(name: str, tests: int, failures: int) -> ET.Element:
    return ET.Element("testsuite", name=name, tests=str(tests), failures=str(failures), errors="0")


def _write(suite: ET.Element, path: str | Path) -> Path:
    path = Path(path)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    return path
