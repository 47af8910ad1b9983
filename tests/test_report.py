"""The validation page: verdict first, tolerances as a table, the long table folded, plots readable."""

import copy
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.text import Text

import fxreplace
from fxreplace.blame import blame
from fxreplace.capture import capture_reference
from fxreplace.engines.embedded import Runner, RunnerConfig
from fxreplace.floor import measure_floor
from fxreplace.metrics import BELOW_ZERO_NOTE, DIVERGED, ENGINE_CODE_REPRO, MATCHED, Verdict
from fxreplace.models import get_family, tiny_model
from fxreplace.report import DPI, blame_figure, errors_figure, repro_step, router_figure, write_blame_report
from fxreplace.validation import StepRecord, ValidationResult, logit_validation


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
    assert re.search(r"<details id='per-token'><summary>Per-token table \(6 rows\)</summary><div class='wide'><table>", page)
    assert "<td class='text'>diverged: KL above</td><td>0.05</td>" in page and "{'match_atol'" not in page
    assert "the &lt;router&gt;" in page and "<i>token ids</i>" in page
    assert "1 (5 <code>&#x27; red&#x27;</code> &rarr; 7 <code>&#x27; blue&#x27;</code>)" in page
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["verdict"] == r.verdict.to_dict() and saved["summary"]["off"]["prompts"]["0"]["tokens_at_divergence"] == [5, 7]
    assert "<nav id='fxreplace-pages'><b>validation report</b></nav>" in page


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
    assert layout_faults(fig) == []
    plt.close(fig)


# The reports as a reader sees them, in a window 1300 and 800 px wide: the pages' own CSS gives each figure
# the width of the page's column (body margin 2em, at most 1200 px), scaled down to fit, never up.
WIDTHS = (1300, 800)
MARGIN, SMALLEST_TEXT_PX = 32, 8
ARCH = "Qwen3MoeForCausalLM"


def planted(model):
    """``model`` with two faults: layer 0's attention output scaled, the last router's logits negated
    (its top-k then agrees with the reference's on no token: a router at 0)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.mul_(1.5)
        model.model.layers[-1].mlp.gate.weight.mul_(-1.0)
    return model


@pytest.fixture(scope="module")
def investigations(tmp_path_factory):
    """Real reports of a tiny Qwen3-MoE with two planted faults (validation of its routers, then blame):
    for one prompt (one row of panels) in float32, and for five in bfloat16 against its noise floor:
    ``{prompts: (directory, validation, blame)}``."""
    clean = tiny_model(ARCH, num_hidden_layers=4)
    target, routers = planted(clean), ["model.layers.*.mlp.gate"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 128, (n,), generator=g).tolist() for n in (6, 9, 5, 7, 8)]
    out = {}
    for n, dtype in ((1, torch.float32), (5, torch.bfloat16)):
        directory = tmp_path_factory.mktemp(f"prompts{n}")
        reference = capture_reference(clean, prompts[:n], routers, 6, components=get_family(ARCH).components,
                                      progress=False)
        reference.save(directory / "ref")
        floor = measure_floor(clean, reference, dtype) if dtype != torch.float32 else None
        model = fxreplace.instrument(copy.deepcopy(target).to(dtype), routers)
        runner = Runner(model, clean.config, fxreplace.ReplacementConfig(tensors_path=str(directory / "ref")),
                        RunnerConfig(prefill_buckets=(16,), batch_buckets=(8,), max_len=32), dtype=dtype,
                        observed=model, compile=None)
        validated = logit_validation(runner, reference, router_topk=2, progress=False)
        validated.floor = floor
        validated.write_report(directory)
        blamed = blame(target, reference, dtype=dtype, floor=floor, progress=False)
        write_blame_report(blamed, directory, repro_step("ckpt", "ref", directory / "blame.json"))
        out[n] = directory, validated, blamed
    return out


def drawn_texts(fig) -> list:
    """Every text a figure draws: its own (title, shared label), each shown axes' title, labels, tick
    labels within the view and annotations, the legends' entries."""
    texts = list(fig.texts)
    for ax in fig.axes:
        if not ax.axison:
            continue
        texts += [t for t in ax.get_children() if isinstance(t, Text)] + [ax.xaxis.label, ax.yaxis.label]
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            texts += [t.label1 for t in axis.get_major_ticks() + axis.get_minor_ticks() if lo <= t.get_loc() <= hi]
    for legend in legends(fig):
        texts += legend.get_texts()
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def legends(fig) -> list:
    return fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]


def layout_faults(fig) -> list[str]:
    """What a reader would see cut off or covered: a text not wholly inside the figure, two texts
    overlapping, a legend over an axes (its data, ticks or labels)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in drawn_texts(fig)]
    faults = [f"{text!r} is cut off" for text, box in boxes
              if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > fig.bbox.x1 + 0.5 or box.y1 > fig.bbox.y1 + 0.5]
    faults += [f"{a!r} overlaps {b!r}" for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
               if box_a.overlaps(box_b)]
    faults += [f"a legend covers the axes {ax.get_title()!r}" for legend in legends(fig) for ax in fig.axes
               if ax.axison and legend.get_window_extent(renderer).overlaps(ax.get_tightbbox(renderer))]
    return faults


def test_layout_faults_finds_a_clipped_title_and_a_legend_on_a_label():
    """The check below fails on what the issue saw: a title wider than its figure, a legend drawn over an axis label."""
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.bar([0, 1], [0.5, 1.0], label="bars")
    ax.set_title("Target's own top-k routing equals the reference's, cut off on both sides")
    ax.set_xlabel("generated step")
    fig.legend(loc="lower center")
    faults = layout_faults(fig)
    assert any("is cut off" in f and "Target's own" in f for f in faults), faults
    assert any(f.startswith("a legend covers the axes") for f in faults), faults
    plt.close(fig)


@pytest.mark.parametrize("prompts", [1, 5])
def test_figures_cut_off_nothing_and_no_legend_covers_an_axis(investigations, prompts):
    _, validated, blamed = investigations[prompts]
    for figure in (errors_figure(validated), router_figure(validated), blame_figure(blamed)):
        assert layout_faults(figure) == [], figure.texts[0].get_text() if figure.texts else figure.axes[0].get_title()
        plt.close(figure)


def test_every_router_has_a_bar_or_a_label_zero_included(investigations):
    """The flipped router agrees on no token: no bar to see, so its label says 0%."""
    _, validated, _ = investigations[5]
    last = "model.layers.3.mlp.gate"
    assert validated.router["off"][last][0] == 0, "the planted router flip routes every token elsewhere"
    fig = router_figure(validated)
    ax = fig.axes[0]
    bars = [bar for container in ax.containers for bar in container]
    labels = [t.get_text() for t in ax.texts]
    assert len(bars) == len(labels) == 2 * 4  # two modes x four routers, each bar labelled
    expected = [f"{a / n:.0%}" for mode in ("off", "on") for a, n in
                (validated.router[mode][f"model.layers.{k}.mlp.gate"] for k in range(4))]
    assert labels == expected and labels[3] == "0%" and bars[3].get_height() == 0
    plt.close(fig)


BROWSER_SCRIPT = Path(__file__).parents[1] / "scripts" / "check_report_in_browser.py"
_spec = importlib.util.spec_from_file_location("check_report_in_browser", BROWSER_SCRIPT)
in_browser = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(in_browser)


@pytest.fixture(scope="module")
def chromium():
    """Debian's Chromium (``apt-get install chromium``; .ci/run installs it): missing, the browser checks
    skip on a developer's machine and fail in CI, where they must run."""
    browser = in_browser.find_browser()
    if browser is None:
        message = "the report pages are checked in headless Chromium: apt-get install chromium"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    return browser


def laid_out(browser: str, directory: Path, window: int) -> dict:
    """Both pages of ``directory`` as Chromium lays them out in a window ``window`` px wide, each with
    its screenshot (``shot``: RGB in [0, 1]) taken by scripts/check_report_in_browser.py as a user runs it."""
    shots = directory / "shots"
    done = subprocess.run([sys.executable, str(BROWSER_SCRIPT), str(directory), "--out", str(shots), "--width",
                           str(window)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    pages = {}
    for name in ("report.html", "blame.html"):
        pages[name] = in_browser.layout(browser, directory / name, window)
        pages[name]["shot"] = plt.imread(shots / f"{Path(name).stem}.{window}px.png")[..., :3]
    return pages


@pytest.mark.parametrize("window", WIDTHS)
@pytest.mark.parametrize("prompts", [1, 5])
def test_both_pages_read_at_both_widths_in_a_browser(investigations, chromium, prompts, window):
    """Both pages in headless Chromium at the window's width: every figure loaded, within the column
    and its smallest text at least 8 px high as drawn; nothing pushed past the window's edge (a table
    wider than the window scrolls in its own box; the screenshot's right margin is blank); no empty
    table; the page's verdict the terminal's; the repro command shown where an origin is; a share
    below 0 shown only with the note that explains it."""
    directory, validated, blamed = investigations[prompts]
    figures = {"error_per_step.png": errors_figure(validated), "router_agreement.png": router_figure(validated),
               "blame_heatmap.png": blame_figure(blamed)}
    verdicts = {"report.html": validated.verdict.sentence, "blame.html": blamed.verdict}
    layouts = laid_out(chromium, directory, window)
    for name, layout in layouts.items():
        where = f"{name} at {window} px"
        assert layout["page"] <= layout["view"] and layout["beyond"] == [], (where, layout["beyond"])
        assert layout["images"], where
        for image in layout["images"]:
            fig = figures[image["src"]]
            assert image["loaded"] and image["alt"], (where, image)
            assert image["natural"] == round(fig.get_figwidth() * DPI) and image["right"] <= layout["view"] - MARGIN + 0.5
            smallest = min(t.get_fontsize() for t in drawn_texts(fig)) * DPI / 72 * image["width"] / image["natural"]
            assert smallest >= SMALLEST_TEXT_PX, (where, image["src"], smallest)
        for table in layout["tables"]:
            assert table["cells"], (where, "an empty table", table)
            assert table["right"] <= layout["view"] or table["box"] is not None, (where, table)
        shot = layout["shot"]
        assert shot.shape[1] == window and shot[:, -MARGIN // 2:].min() == 1.0, (where, "drawn into the right margin")
        texts = [t["text"] for t in layout["texts"]]
        assert " ".join(verdicts[name].split()) in texts, (where, verdicts[name])
        if any(re.fullmatch(r"-\d+%\*", t) for t in texts):
            assert any(t.startswith(BELOW_ZERO_NOTE[:20]) for t in texts), where
    shown = {t["text"]: t for t in layouts["blame.html"]["texts"]}
    assert blamed.origins, "the planted faults are found"
    command = f"fxreplace repro write ckpt --reference ref --blame {directory / 'blame.json'} --out repro/"
    assert command in shown and 0 < shown[command]["width"] and shown[command]["right"] <= window, shown.get(command)
    for fig in figures.values():
        plt.close(fig)


def test_next_step_says_what_a_repro_tells_where_the_engine_ran_its_own_code():
    """The CLI's ``next:`` line: the repro runs the code blamed (the compiler team's case), or, through an engine that
    runs its own code (vLLM's), transformers' code with the target's weights, with what agreeing or not then tells."""
    own = repro_step("ckpt", "ref", "out/blame.json")
    engines = repro_step("ckpt", "ref", "out/blame.json", repro=False)
    write = "fxreplace repro write ckpt --reference ref --blame out/blame.json --out repro/"
    assert write in own and write in engines
    assert "--backend inductor" in own and ENGINE_CODE_REPRO not in own
    assert engines.startswith("the first origin in transformers' code with the target's weights") and engines.endswith(
        ENGINE_CODE_REPRO) and "--backend inductor" not in engines
