"""The validation page: verdict first, tolerances as a table, the long table folded, plots readable."""

import json
import re
from html.parser import HTMLParser

import matplotlib.pyplot as plt

from fxreplace.metrics import DIVERGED, MATCHED, Verdict
from fxreplace.report import router_figure, write_blame_report
from fxreplace.validation import StepRecord, ValidationResult


def step(mode, prompt, s, agree=True, kl=1e-3):
    return StepRecord(agree, 5, 5 if agree else 7, kl, 2 * kl, kl, False, MATCHED if agree else DIVERGED,
                      mode=mode, prompt=prompt, step=s, round=0, req_id="r", phase="prefill" if s == 0 else "decode")


def result() -> ValidationResult:
    steps = [step("off", 0, 0), step("off", 0, 1, agree=False, kl=0.5), step("off", 1, 0),
             step("on", 0, 0), step("on", 0, 1), step("on", 1, 0)]
    return ValidationResult(steps=steps, router={"off": {"model.layers.0.mlp.gate": [3, 4]},
                                                 "on": {"model.layers.0.mlp.gate": [4, 4]}},
                            num_prompts=2, num_steps=6, prompt_texts={0: "the <router>", 1: None},
                            token_texts={5: " red", 7: " blue"}, replaced="the router logits")


class Outline(HTMLParser):
    """The page's elements in order, with ids and classes."""

    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_verdict_tolerances_details_and_texts(tmp_path):
    r = result()
    assert isinstance(r.verdict, Verdict) and r.verdict.outcome == "explained"
    assert r.verdict.sentence.startswith("replacing the router logits removes 99% of the mean KL")
    page = (r.write_report(tmp_path) and (tmp_path / "report.html").read_text())
    outline = Outline()
    outline.feed(page)
    order = [attrs.get("id") or tag for tag, attrs in outline.tags]
    assert order.index("verdict") < order.index("h2"), "the verdict comes before every section"
    assert "tolerances" in order and "per-token" in order
    assert re.search(r"<details id='per-token'><summary>Per-token table \(6 rows\)</summary><table>", page)
    assert "<td class='text'>diverged: KL above</td><td>0.05</td>" in page and "{'match_atol'" not in page
    assert "the &lt;router&gt;" in page and "<i>token ids</i>" in page
    assert "1 (5 <code>&#x27; red&#x27;</code> &rarr; 7 <code>&#x27; blue&#x27;</code>)" in page
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["verdict"] == r.verdict.to_dict() and saved["summary"]["off"]["prompts"]["0"]["tokens_at_divergence"] == [5, 7]
    assert "<nav id='fxreplace-pages'><b>validation report</b></nav>" in page


def test_router_legend_sits_beside_the_bars():
    fig = router_figure(result())
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    assert not ax.get_legend().get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    plt.close(fig)


def blamed():
    """A blame result with nothing measured: the pages' links need no search."""
    from fxreplace.blame import BlameResult

    return BlameResult(ranking=[], layer_shares=[], origins=[], passes=[], rounds=0,
                       verdict="1 source: layer 1 router model.layers.1.mlp.gate (100%)", confident=True, diffuse=False,
                       nonfinite=None, kinds=["router"], layers=[0, 1], seconds=1.0, budget=8, budget_spent=False)


def test_the_two_pages_link_to_each_other_whichever_is_written_first(tmp_path):
    write_blame_report(blamed(), tmp_path)
    assert "<a href='report.html'>" not in (tmp_path / "blame.html").read_text()
    result().write_report(tmp_path)
    assert "<a href='blame.html'>blame report</a>" in (tmp_path / "report.html").read_text()
    assert "<a href='report.html'>validation report</a>" in (tmp_path / "blame.html").read_text()


def test_the_blame_page_reads_cleanly(tmp_path):
    """One round is "1 round"; a share that rounds to zero from below is "0%", never "-0%"
    (table, verdict, heat map); the heat map's title fits its figure, however few the layers."""
    from dataclasses import replace

    from fxreplace.blame.result import LayerShare, Origin
    from fxreplace.report import blame_figure

    blame = replace(blamed(), rounds=1, layer_shares=[LayerShare(0, "model.layers.0", 1.0, 1.0),
                                                      LayerShare(1, "model.layers.1", 0.998, -0.002)])
    page = write_blame_report(blame, tmp_path).read_text()
    assert "0 validation passes in 1 round (" in page and "-0%" not in page
    assert "1 round (budget 8)" in blame.table() and "-0%" not in blame.table()
    assert Origin(layer=1, share=-0.002, component=None, kind=None).describe().startswith("layer 1 (0%)")
    fig = blame_figure(blame)
    assert {t.get_text() for t in fig.axes[0].texts} == {"100%", "0%"}
    renderer = fig.canvas.get_renderer()
    title, figure = fig.axes[0].title.get_window_extent(renderer), fig.bbox
    assert figure.x0 <= title.x0 and title.x1 <= figure.x1 and title.y1 <= figure.y1, (title, figure)
    plt.close(fig)
