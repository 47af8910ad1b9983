"""Validation report: PNG plots and one self-contained HTML page."""

from __future__ import annotations

import html
import re
from pathlib import Path

import numpy as np

from .metrics import BELOW_ZERO, BELOW_ZERO_NOTE, ENGINE_CODE_REPRO, LAYERS_HEAD, NOTHING_RANKED, part
from .words import fmt, pct, plural, times

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODE_LABELS = {"off": "without replacement", "on": "with replacement"}
MODE_COLORS = {"off": "tab:red", "on": "tab:blue"}


def write_report(result, directory: str | Path) -> Path:
    """Write ``report.html``, ``error_per_step.png``, ``router_agreement.png`` and ``result.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "result.json").write_text(result.to_json())
    _save(errors_figure(result), directory / "error_per_step.png")
    has_router = any(result.router.get(m) for m in result.modes)
    if has_router:
        _save(router_figure(result), directory / "router_agreement.png")
    (directory / "report.html").write_text(_html(result, has_router))
    _link_pages(directory)
    return directory / "report.html"


#: The pages one investigation writes into one folder, each linking to the others present. In their
#: style numbers never break across lines, and a table wider than the window scrolls in its .wide box.
PAGES = {"report.html": "validation report", "blame.html": "blame report"}
_NAV = re.compile(r"<nav id='fxreplace-pages'>.*?</nav>", re.S)
STYLE = ("<style>body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}"
         "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}td{white-space:nowrap}"
         "td.text{text-align:left;white-space:normal}"
         ".verdict{font-size:1.15em;padding:.8em 1em;border-left:6px solid #555;background:#f4f4f4}"
         ".diverged{background:#fdd}.within_tolerance{background:#ffd}.matched{background:#dfd}"
         "nav{margin-bottom:1em}.wide{overflow-x:auto}</style>")


def _link_pages(directory: Path) -> None:
    """Rewrite each page's navigation to link to the other pages now in ``directory``
    (validate and blame write theirs at different times, in either order)."""
    present = [name for name in PAGES if (directory / name).is_file()]
    for name in present:
        links = " | ".join(f"<b>{PAGES[n]}</b>" if n == name else f"<a href='{n}'>{PAGES[n]}</a>" for n in present)
        page = directory / name
        page.write_text(_NAV.sub(lambda _: f"<nav id='fxreplace-pages'>{links}</nav>", page.read_text(), count=1))


#: The resolution of every PNG: a figure's inches times this are its pixels on the page.
DPI = 110


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def errors_figure(result):
    """Top-5 error per generated step, one panel per prompt, without and with replacement (and the
    noise floor). Two panels a row, so the text stays legible on a narrow window; the legend sits
    below the panels, outside them (constrained layout keeps every label inside the figure)."""
    prompts = sorted({s.prompt for s in result.steps})
    cols = min(2, len(prompts)) or 1
    rows = (len(prompts) + cols - 1) // cols or 1
    fig, axes = plt.subplots(rows, cols, figsize=(max(6.5, 4 * cols), 2.4 * rows + 1.4), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, p in zip(axes.flat, prompts):
        for mode in result.modes:
            steps = [s for s in result.steps if s.mode == mode and s.prompt == p]
            ax.plot([s.step for s in steps], [max(s.top5_error, 1e-7) for s in steps], ".-", color=MODE_COLORS[mode],
                    label=MODE_LABELS[mode], lw=1, ms=3)
            div = [s for s in steps if not s.top1_agree]
            ax.scatter([s.step for s in div], [max(s.top5_error, 1e-7) for s in div], marker="x", s=40,
                       color=MODE_COLORS[mode], zorder=3, label=f"top-1 differs ({MODE_LABELS[mode]})")
        floor = result.floor.top5_per_step.get(p) if result.floor else None
        if floor:
            ax.plot(range(len(floor)), [max(v, 1e-7) for v in floor], "-", color="tab:gray", lw=1,
                    label=f"noise floor (the reference in {result.floor.dtype})")
        ax.set_yscale("log")
        ax.set_title(f"prompt {p}", fontsize=9)
        ax.set_xlabel("generated step", fontsize=8)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(prompts):]:
        ax.axis("off")
    fig.supylabel("max |Δ log p| over the reference's top-5", fontsize=9)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=8)
    fig.suptitle("Top-5 log-probability error per step\n(x: the top-1 token differs; teacher forcing continues)",
                 fontsize=10)
    return fig


def router_figure(result):
    """Bars per target and mode: the fraction of tokens whose top-k routing matches the reference,
    each bar labelled with its value (a router at 0 draws no bar, its label still says 0%); the
    legend beside the bars, never on them."""
    modules = sorted({m for mode in result.modes for m in result.router.get(mode, {})}, key=_natural)
    bars = len(modules) * len(result.modes)
    fig, ax = plt.subplots(figsize=(max(6.5, 0.3 * bars + 3.5), 3.8), layout="constrained")
    width = 0.8 / max(1, len(result.modes))
    for i, mode in enumerate(result.modes):
        values = [_agreement(result.router.get(mode, {}).get(m)) for m in modules]
        drawn = ax.bar([j + i * width for j in range(len(modules))], [v or 0 for v in values], width,
                       color=MODE_COLORS[mode], label=MODE_LABELS[mode])
        ax.bar_label(drawn, [pct(v) if v is not None else "n/a" for v in values], rotation=90, padding=2, fontsize=7)
    ax.set_xticks([j + width * (len(result.modes) - 1) / 2 for j in range(len(modules))])
    ax.set_xticklabels([_short(m) for m in modules], rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1.25)  # room for the labels above a full bar
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1])
    ax.set_ylabel("fraction of tokens")
    ax.set_title("Tokens whose top-k experts equal the reference's\n(the target's own routing)", fontsize=10)
    fig.legend(fontsize=8, loc="outside right upper")
    return fig


def _agreement(counts) -> float | None:
    """A router's agreement from its (agreeing, total) tokens; None where it routed none."""
    agree, total = counts or (0, 0)
    return agree / total if total else None


def _html(result, has_router: bool) -> str:
    summary = result.summary()
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>fxreplace validation report</title>{STYLE}</head><body>",
        "<nav id='fxreplace-pages'></nav>",
        "<h1>fxreplace logit validation</h1>",
        f"<p class='verdict' id='verdict'><b>Verdict:</b> {html.escape(result.verdict.sentence)}</p>",
        f"<p>{result.num_prompts} prompts, {result.num_steps} validated steps (teacher forcing: after a divergence the "
        "target continues from the reference's tokens).</p>",
        "<h2>Summary</h2><div class='wide'><table><tr><th>mode</th><th>top-1 agreement</th><th>prompts diverged</th>"
        "<th>mean top-5 error</th><th>mean KL</th><th>router agreement</th><th>matched / within / diverged</th></tr>",
    ]
    for mode, s in summary.items():
        counts = s["status_counts"]
        parts.append(
            f"<tr><td>{MODE_LABELS[mode]}</td><td>{fmt(s['top1_agreement'])}</td><td>{s['prompts_diverged']}</td>"
            f"<td>{fmt(s['mean_top5_error'])}</td><td>{fmt(s['mean_kl'])}</td><td>{fmt(s['router_agreement_mean'])}</td>"
            f"<td>{counts['matched']} / {counts['within_tolerance']} / {counts['diverged']}</td></tr>"
        )
    if result.floor and "off" in summary:
        parts += _floor_rows(result.floor, summary["off"])
    parts.append("</table></div>")
    if result.program:
        parts.append(f"<p id='program'>Program validated: {html.escape(describe_program(result.program))}.</p>")
    if result.gate is not None:
        why = "; ".join([*result.gate["overall"], *(f"prompt {p}: {', '.join(r)}" for p, r in result.gate["prompts"].items())])
        parts.append(f"<p id='gate' class='{'passed' if result.gate['passed'] else 'failed'}'>CI gate (--fail-on "
                     f"{html.escape(' '.join(result.gate['conditions']))}): "
                     f"{'passed' if result.gate['passed'] else 'failed: ' + html.escape(why)}.</p>")
    parts.append(_tolerances_table(result.tolerances.to_dict()))
    parts.append("<h2>Per step</h2>" + _image("error_per_step.png", "top-5 error per step"))
    if has_router:
        parts.append("<h2>Router agreement per target</h2>" + _image("router_agreement.png", "router agreement per target"))
    parts.append("<h2>First divergence per prompt</h2><div class='wide'><table id='prompts'><tr><th>prompt</th><th>text</th>")
    parts += [f"<th>{MODE_LABELS[m]}: step (reference &rarr; target token)</th>" for m in summary]
    parts.append("</tr>")
    for p in sorted({s.prompt for s in result.steps}):
        text = result.prompt_texts.get(p)
        cells = "".join(f"<td>{_divergence(result, summary[m]['prompts'].get(p, {}))}</td>" for m in summary)
        parts.append(f"<tr><td>{p}</td><td class='text'>{_snippet(text)}</td>{cells}</tr>")
    parts.append(f"</table></div><details id='per-token'><summary>Per-token table ({len(result.steps)} rows)</summary>"
                 "<div class='wide'><table><tr><th>mode</th><th>prompt</th><th>step</th><th>computed by</th><th>retry</th>"
                 "<th>ref token</th><th>target token</th>"
                 "<th>top-5 err</th><th>top-50 err</th><th>KL</th><th>status</th></tr>")
    for s in result.steps:
        parts.append(
            f"<tr class='{s.status}'><td>{s.mode}</td><td>{s.prompt}</td><td>{s.step}</td><td>{s.phase}</td>"
            f"<td>{s.round}</td>"
            f"<td>{s.reference_token}</td><td>{s.target_token}</td><td>{fmt(s.top5_error)}</td><td>{fmt(s.top50_error)}</td>"
            f"<td>{fmt(s.kl)}</td><td>{s.status}{' (NaN)' if s.nan else ''}</td></tr>"
        )
    parts.append("</table></div></details></body></html>")
    return "\n".join(parts)


def _floor_rows(floor, off: dict) -> list[str]:
    """The summary's rows for the noise floor: the reference in the target's precision, and the target over it."""
    measured = floor.aggregate([int(p) for p in off["prompts"]])
    m = floor.multiples(off)
    return [f"<tr id='noise-floor'><td>noise floor: the reference in {floor.dtype}</td><td>-</td>"
            f"<td>{measured['prompts_diverged']}</td><td>{fmt(measured['mean_top5_error'])}</td>"
            f"<td>{fmt(measured['mean_kl'])}</td><td>-</td><td>-</td></tr>",
            f"<tr><td>without replacement / floor</td><td>-</td><td>-</td><td>{times(m['top5'])}</td>"
            f"<td>{times(m['kl'])}</td><td>-</td><td>first divergence {times(m['first_divergence'])} sooner</td></tr>"]


def _tolerances_table(tol: dict) -> str:
    """The tolerances the statuses were judged by, and what the errors measure."""
    return ("<h3>Tolerances</h3><table id='tolerances'><tr><th>rule</th><th>value</th></tr>"
            f"<tr><td class='text'>matched: top-5 error at most</td><td>{tol['match_atol']:g}</td></tr>"
            f"<tr><td class='text'>diverged: top-5 error above</td><td>{tol['top5_atol']:g}</td></tr>"
            f"<tr><td class='text'>diverged: top-50 error above</td><td>{tol['top50_atol']:g}</td></tr>"
            f"<tr><td class='text'>diverged: KL above</td><td>{tol['kl_max']:g}</td></tr></table>"
            "<p>Errors are the largest |&Delta; log p| over the reference's top-k tokens; a step whose top-1 token "
            "differs is diverged too.</p>")


def _divergence(result, prompt: dict) -> str:
    """A prompt's first divergence as "step (ref -> target)", tokens decoded where a tokenizer gave their text."""
    step, tokens = prompt.get("first_divergence"), prompt.get("tokens_at_divergence")
    if step is None or tokens is None:
        return "-"
    ref, tgt = (_token(result, t) for t in tokens)
    return f"{step} ({ref} &rarr; {tgt})"


def _token(result, token: int) -> str:
    text = result.token_texts.get(token)
    return f"{token}" if text is None else f"{token} <code>{html.escape(repr(text))}</code>"


def _snippet(text: str | None, limit: int = 160) -> str:
    if text is None:
        return "<i>token ids</i>"
    short = text if len(text) <= limit else text[:limit] + "..."
    return f"<span title='{html.escape(text, quote=True)}'>{html.escape(short)}</span>"


def print_summary(result) -> None:
    """The terminal summary of a validation: per prompt and overall, without vs with
    replacement of ``result.replaced``, and the verdict (:attr:`ValidationResult.verdict`)."""
    summary = result.summary()
    what = result.replaced
    off, on = summary["off"], summary["on"]
    print()
    print(f"{'prompt':>6} | {'first divergence':^21} | {'mean top-5 error':^21}")
    print(f"{'':>6} | {'without':>10} {'with':>10} | {'without':>10} {'with':>10}")
    for p in off["prompts"]:
        a, b = off["prompts"][p], on["prompts"][p]
        print(f"{p:>6} | {fmt(a['first_divergence']):>10} {fmt(b['first_divergence']):>10} | "
              f"{fmt(a['mean_top5_error']):>10} {fmt(b['mean_top5_error']):>10}")
    print()
    print(f"{'':28}{'without':>10}{'with':>10}   (replacement of {what})")
    floor = result.floor.aggregate([int(p) for p in off["prompts"]]) if result.floor else {}
    if floor:
        print(f"{'':28}{'':>10}{'':>10}{'floor':>10}   (the reference in {result.floor.dtype})")
    for label, key in [("top-1 agreement", "top1_agreement"), ("prompts diverged", "prompts_diverged"),
                       ("mean top-5 error", "mean_top5_error"), ("mean KL", "mean_kl"),
                       ("router agreement (top-k)", "router_agreement_mean")]:
        print(f"{label:<28}{fmt(off[key]):>10}{fmt(on[key]):>10}" + (f"{fmt(floor.get(key)):>10}" if floor else ""))
    print()
    print("verdict: " + result.verdict.sentence)


def describe_program(program: dict) -> str:
    """The program a validation or blame examined, in words: engine, compile mode, dtype."""
    mode = "compiled (inductor)" if program.get("compile") else "eager"
    return f"engine {program.get('engine', 'embedded')}, {mode}, {program.get('dtype', '?')}"


def _short(module: str) -> str:
    return module.replace("model.layers.", "L").replace(".mlp.", ".")


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def write_blame_report(result, directory: str | Path, next_step: str = "") -> Path:
    """``blame.json``, ``blame_heatmap.png`` (share per layer x kind; none when nothing was
    measured) and ``blame.html``; ``next_step``: what to run next (:func:`repro_step`), the line the
    CLI prints too."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    result.write_json(directory / "blame.json")
    heatmap = directory / "blame_heatmap.png"
    if result.ranking or result.layer_shares:
        _save(blame_figure(result), heatmap)
    else:
        heatmap.unlink(missing_ok=True)  # an earlier run's: not this one's
    page = [f"<!doctype html><html><head><meta charset='utf-8'><title>fxreplace blame</title>{STYLE}</head><body>",
            "<nav id='fxreplace-pages'></nav>", blame_section(result, next_step), "</body></html>"]
    (directory / "blame.html").write_text("\n".join(page))
    _link_pages(directory)
    return directory / "blame.html"


def repro_step(model: str, reference: str, blame_json: str | Path, repro: bool = True) -> str:
    """The next step after a blame that named a component, as a command line. ``repro``: whether the repro runs
    the code blamed (``BlameResult.repro``); where the engine ran its own code (vLLM's), the repro runs
    transformers' code with the target's weights, which tells the weights from the engine's code."""
    write = f"fxreplace repro write {model} --reference {reference} --blame {blame_json} --out repro/"
    if not repro:
        return (f"the first origin in transformers' code with the target's weights: {write} (then fxreplace repro run "
                f"repro/): {ENGINE_CODE_REPRO}")
    return f"the first origin alone, for the compiler team: {write} (then fxreplace repro run repro/ --backend inductor)"


def blame_section(result, next_step: str = "") -> str:
    """The blame report's HTML section: verdict, next step, heat map (``blame_heatmap.png`` beside
    it), components table, per-layer shares; what :meth:`BlameResult.table` prints, as a page."""

    t = result.thresholds
    parts = [
        "<h2>Blame: which components explain the divergence</h2>",
        f"<p class='verdict' id='verdict'><b>Verdict:</b> {html.escape(result.verdict)}</p>",
    ]
    if next_step:
        parts.append(f"<p id='next'><b>Next:</b> {_commands(next_step)}</p>")
    parts += [
        f"<p>{plural(len(result.passes), 'validation pass')} in {plural(result.rounds, 'round')} (passes of one round run "
        f"side by side as copies of the prompts; budget {result.budget}), {len(result.captured)} components captured "
        f"on demand, {result.seconds:.1f} s.</p>",
        _blame_scale(result),
    ]
    if result.ranking or result.layer_shares:
        parts.append(_image("blame_heatmap.png", "share of the divergence per component and per layer"))
    if result.ranking:
        parts.append(
            "<div class='wide'><table id='ranking'><tr><th>#</th><th>component</th><th>kind</th><th>layer</th><th>KL off</th>"
            "<th>KL on</th><th>top-5 error off</th><th>top-5 error on</th><th>top-1 off</th><th>top-1 on</th>"
            "<th>explained</th><th>share</th><th>origin</th><th>replaced beside it</th></tr>")
        for i, b in enumerate(result.ranking, 1):
            parts.append(f"<tr><td>{i}</td><td class='text'>{html.escape(b.component)}</td><td>{b.kind}</td>"
                         f"<td>{fmt(b.layer)}</td><td>{fmt(b.kl_off)}</td><td>{fmt(b.kl_on)}</td><td>{fmt(b.top5_off)}</td>"
                         f"<td>{fmt(b.top5_on)}</td><td>{fmt(b.top1_off)}</td><td>{fmt(b.top1_on)}</td>"
                         f"<td>{part(b.explained)}</td><td>{part(b.share)}</td><td>{'yes' if b.origin else ''}</td>"
                         f"<td class='text'>{html.escape(', '.join(b.with_replaced))}</td></tr>")
        parts.append("</table></div>")
        parts.append(
            f"<p><i>explained</i>: the part of the divergence gone with the component replaced (the smaller of the mean "
            f"KL and the mean top-5 log-prob error removed; the origins found before it stay replaced beside it); it "
            f"explains the divergence from {t['explains']:.0%}. <i>share</i>: the part the component accounts for itself "
            f"(explained minus what the components beside it explain). Order: the origins first, then the rest, each by "
            f"share. An origin needs {t['significant']:.0%} of the divergence; the drift is diffuse when the layers holding "
            f"no origin hold {t['significant']:.0%} of it together (a fault leaves them at ~0) or more than "
            f"{t['max_origins']} origins are needed.</p>")
    else:
        parts.append(f"<p id='ranking'>{html.escape(NOTHING_RANKED[0].upper() + NOTHING_RANKED[1:])}.</p>")
    if result.layer_shares:
        parts.append(f"<h3>{html.escape(LAYERS_HEAD[0].upper() + LAYERS_HEAD[1:])}</h3>"
                     "<table id='layers'><tr><th>layer</th><th>explained with its stream</th><th>arising there</th></tr>")
        parts += [f"<tr><td>{s.layer}</td><td>{part(s.explained)}</td><td>{part(s.share)}</td></tr>"
                  for s in result.layer_shares]
        parts.append("</table>")
    if result.below_zero():
        parts.append(f"<p id='below-zero'>{html.escape(BELOW_ZERO_NOTE)}.</p>")
    return "\n".join(parts)


def _commands(text: str) -> str:
    """``text`` as HTML, each ``fxreplace ...`` command in it (up to a parenthesis) as code."""
    return re.sub(r"(fxreplace [^()]*?)(?=\s*(?:\(|\)|$))", r"<code>\1</code>", html.escape(text, quote=False))


def _image(name: str, alt: str) -> str:
    """A figure scaled to the page's width, linking to itself at full size."""
    return f"<a href='{name}'><img src='{name}' style='max-width:100%' alt='{alt}'></a>"


def _blame_scale(result) -> str:
    """The blame report's scale: the target without replacement beside its noise floor, and the program examined."""
    program = (f"<p id='program'>Program examined: {html.escape(describe_program(result.program))}.</p>"
               if result.program else "")
    if not result.floor:
        return program + "<p id='noise-floor'>No noise floor: the divergence has no scale (capture the reference with " \
                         "<code>--noise-floor DTYPE</code>, or give <code>--clean</code>).</p>"
    f, m = result.floor["floor"], result.floor["multiples"]
    off = result.ranking[0] if result.ranking else None
    return program + (
        "<table id='noise-floor'><tr><th></th><th>mean KL</th><th>mean top-5 error</th></tr>"
        + (f"<tr><td class='text'>target without replacement</td><td>{fmt(off.kl_off)}</td><td>{fmt(off.top5_off)}</td></tr>"
           if off else "")
        + f"<tr><td class='text'>noise floor: the reference in {result.floor['dtype']}</td><td>{fmt(f['mean_kl'])}</td>"
        f"<td>{fmt(f['mean_top5_error'])}</td></tr><tr><td class='text'>target / floor</td><td>{times(m['kl'])}</td>"
        f"<td>{times(m['top5'])}</td></tr></table><p>{'Within' if result.floor['within'] else 'Beyond'} precision noise; "
        f"the floor's part of the divergence: {pct(result.floor['noise_share'])}.</p>")


def blame_figure(result):
    """The heat map of a blame result: share per kind x layer, and per layer."""
    layers, rows = result.layers or [0], result.kinds + ["arises here"]
    grid = np.full((len(rows), len(layers)), np.nan)
    for b in result.ranking:
        if b.layer in layers and b.share is not None:
            grid[rows.index(b.kind), layers.index(b.layer)] = b.share
    for s in result.layer_shares:
        if s.layer in layers and s.share is not None:
            grid[-1, layers.index(s.layer)] = s.share
    fig, ax = plt.subplots(figsize=(max(4.5, 0.6 * len(layers) + 2.5), 0.55 * len(rows) + 1.9), layout="constrained")
    cmap = plt.get_cmap("Reds").with_extremes(bad="#eeeeee")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(j, i, part(v), ha="center", va="center", fontsize=7, color="white" if v > 0.6 else "black")
    ax.axhline(len(rows) - 1.5, color="black", linewidth=0.8)
    ax.set_xticks(range(len(layers)), [str(k) for k in layers], fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xlabel("layer")
    fig.colorbar(image, ax=ax, label="share of the divergence")
    # lines, not one: one is wider than the figure of a few layers, and a title is not shrunk to fit
    below = f"\n{BELOW_ZERO} below 0: replacing it made the target worse" if result.below_zero() else ""
    ax.set_title(f"Share per component (kind x layer)\nand arising per layer (grey: not measured){below}", fontsize=9)
    return fig
