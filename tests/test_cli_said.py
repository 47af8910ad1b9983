"""What the commands say and leave, run as a user runs them (``python -m fxreplace`` in a
subprocess, on real tiny checkpoints): blame's terminal and blame.html say the same (the ranking,
a part below 0 explained, the repro command, no table when nothing was ranked); the noise floor
blame reads; a prompt capture cannot take leaves no folder behind; what the vLLM engine refuses
is refused before it starts."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from fxreplace.metrics import BELOW_ZERO, BELOW_ZERO_NOTE, NOTHING_RANKED
from fxreplace.models import tiny_model

ROOT = Path(__file__).resolve().parent.parent
ARCH = "Qwen3MoeForCausalLM"
PROMPTS = [[5, 17, 33, 9, 40, 8], [40, 8, 99, 12]]
#: sizes vLLM's KV cache, so the engine's memory check passes on a busy machine (the refusals under test come after it)
ENGINE_ARGS = ["--engine-args", json.dumps({"kv_cache_memory_bytes": 100_000_000})]


def fxreplace(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The command as a user runs it, this checkout's fxreplace imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fxreplace", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def refused(done: subprocess.CompletedProcess) -> str:
    """The one line a mistake is, exit 2; nothing else on stderr (a vLLM engine that started logs)."""
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A clean 4-layer Qwen3-MoE checkpoint, the same with two faults planted (layer 0's attention
    output scaled, the last router's logits negated), and the clean one's reference with every component."""
    work = tmp_path_factory.mktemp("cli")
    clean = tiny_model(ARCH, num_hidden_layers=4)
    clean.save_pretrained(work / "clean")
    faulty = copy.deepcopy(clean)
    with torch.no_grad():
        faulty.model.layers[0].self_attn.o_proj.weight.mul_(1.5)
        faulty.model.layers[-1].mlp.gate.weight.mul_(-1.0)
    faulty.save_pretrained(work / "faulty")
    (work / "p.json").write_text(json.dumps(PROMPTS))
    ok(fxreplace(["capture", "clean", "--prompts", "p.json", "--components", "--max-new-tokens", "6", "--out", "ref"],
                 work))
    return work


class Page(HTMLParser):
    """blame.html's text, the text of each paragraph with an id, the rows of its tables by id, and its images."""

    def __init__(self, path: Path):
        super().__init__()
        self.table, self.tables, self.images, self.words = None, {}, [], []
        self.paragraph, self.paragraphs = None, {}
        self.feed(path.read_text())

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "p" and attrs.get("id"):
            self.paragraph = attrs["id"]
            self.paragraphs[self.paragraph] = ""
        if tag == "table":
            self.table = self.tables.setdefault(attrs.get("id"), [])
        elif tag == "tr" and self.table is not None:
            self.table.append([])
        elif tag == "td" and self.table is not None:
            self.table[-1].append("")
        elif tag == "img":
            self.images.append(attrs["src"])

    def handle_endtag(self, tag):
        if tag == "table":
            self.table = None
        if tag == "p":
            self.paragraph = None

    def handle_data(self, data):
        self.words.append(data)
        if self.paragraph:
            self.paragraphs[self.paragraph] += data
        if self.table and self.table[-1] and self.lasttag == "td":
            self.table[-1][-1] += data

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.words).split())


def ranked_in_terminal(out: str) -> list[tuple[str, str, str]]:
    """(component, explained, share) per row of the printed ranking."""
    rows = re.findall(r"^\s*\d+ (\S+)\s+\S+\s+\S+(?:\s+\S+){4}\s+(\S+%\S?)\s+(\S+%\S?)", out, re.M)
    return [tuple(row) for row in rows]


def test_blame_says_in_the_terminal_what_its_page_says(work):
    """The planted faults are both origins: the ranking, the parts below 0 (marked and explained where
    shown) and the next step (the repro command) are the same on the terminal and on blame.html."""
    out = ok(fxreplace(["blame", "faulty", "--reference", "ref", "--dtype", "float32", "--report-dir", "found"], work))
    page = Page(work / "found" / "blame.html")
    terminal = ranked_in_terminal(out)
    on_page = [(row[1], row[10], row[11]) for row in page.tables["ranking"] if row]
    assert terminal and terminal == on_page[:len(terminal)], (terminal, on_page)
    blamed = json.loads((work / "found" / "blame.json").read_text())
    assert [o["component"] for o in blamed["origins"]] == ["model.layers.3.mlp.gate", "model.layers.0.self_attn"]
    next_step = re.search(r"^next: (.*)$", out, re.M).group(1)
    assert next_step.startswith(f"the first origin alone, for the compiler team: fxreplace repro write faulty "
                                f"--reference ref --blame {work / 'found' / 'blame.json'} --out repro/")
    assert page.paragraphs["next"] == f"Next: {next_step}"
    # a part below 0 never shows bare: marked, with the note under what shows it
    for text in (out, page.text):
        parts = re.findall(r"-\d+%\S?", text)
        assert all(p.endswith(BELOW_ZERO) for p in parts), parts
        assert (BELOW_ZERO_NOTE in text) == bool(parts)
    assert "blame_heatmap.png" in page.images and (work / "found" / "blame_heatmap.png").is_file()


def test_blame_with_nothing_to_rank_prints_no_table(work):
    """The clean model in float32 is its own reference: nothing diverges, no component is ranked; the
    terminal and the page say so in one line, with no empty table and no next step (the layers'
    streams were measured: both show the same per-layer parts)."""
    out = ok(fxreplace(["blame", "clean", "--reference", "ref", "--dtype", "float32", "--report-dir", "none"], work))
    assert "nothing to blame" in out, out
    assert NOTHING_RANKED in out and not re.search(r"^\s*# component", out, re.M) and "next:" not in out
    page = Page(work / "none" / "blame.html")
    assert page.paragraphs["ranking"] == NOTHING_RANKED[0].upper() + NOTHING_RANKED[1:] + "."
    assert "ranking" not in page.tables and "next" not in page.paragraphs
    layers = re.search(r"^arising per layer \(the residual stream after the layer replaced\): (.*)$", out, re.M).group(1)
    assert layers == ", ".join(f"{row[0]}: {row[2].strip()}" for row in page.tables["layers"] if row)
    parts = re.findall(r"-\d+%\S?", layers)
    assert all(p.endswith(BELOW_ZERO) for p in parts) and (BELOW_ZERO_NOTE in out) == bool(parts)


def test_the_noise_floor_blame_reads(work):
    """A target in bf16 is read against the floor stored with the reference when it covers the
    reference's prompts; a stored floor of other prompts is measured again from --clean, and refused
    without it; an unreadable one is refused. Each refusal comes before the target loads."""
    (work / "p1.json").write_text(json.dumps(PROMPTS[:1]))
    ok(fxreplace(["capture", "clean", "--prompts", "p1.json", "--max-new-tokens", "6", "--out", "ref1",
                  "--noise-floor", "bfloat16"], work))
    shutil.copytree(work / "ref", work / "mixed")
    shutil.copy(work / "ref1" / "noise_floors.json", work / "mixed")  # measured on prompt 0 alone
    stored = json.loads((work / "mixed" / "noise_floors.json").read_text())["bfloat16"]
    assert sorted(stored["prompts"]) == ["0"]

    out = ok(fxreplace(["blame", "clean", "--reference", "mixed", "--clean", "clean", "--report-dir", "measured"], work))
    assert "noise floor: clean in bfloat16 against the reference" in out
    floor = json.loads((work / "measured" / "blame.json").read_text())["noise_floor"]
    assert floor["dtype"] == "bfloat16" and floor["floor"]["mean_kl"] != stored["prompts"]["0"]["mean_kl"]
    assert "noise floor: the reference in bfloat16" in Page(work / "measured" / "blame.html").text

    line = refused(fxreplace(["blame", "clean", "--reference", "mixed", "--report-dir", "unmeasured"], work))
    assert line == ("error: the noise floor stored with mixed (noise_floors.json) covers prompts [0] but the reference "
                    "holds 2: it was measured on another capture; hint: give the clean model as --clean MODEL to "
                    "measure it on these prompts, or capture the reference again with `--noise-floor bfloat16`")
    assert not (work / "unmeasured" / "blame.html").exists()

    (work / "mixed" / "noise_floors.json").write_text('{"bfloat16": ')
    line = refused(fxreplace(["blame", "clean", "--reference", "mixed", "--clean", "clean", "--report-dir", "bad"], work))
    assert line.startswith("error: cannot read the noise floor mixed/noise_floors.json: ") and line.endswith(
        "hint: capture the reference again with `--noise-floor bfloat16`"), line


@pytest.mark.parametrize("prompts,problem,hint", [
    ([[5, 6, 700]], "prompt 0 has token ids outside [0, 128): [700]",
     "this model's token ids are below its vocab_size (128): give ids of its tokenizer, or the prompt as text"),
    ([[5, 6, 7], [8, 9], [5, 6, 7]], "prompt 2 has the same token ids as prompt 0", "give each prompt once")])
def test_a_prompt_the_model_cannot_take_is_refused_and_leaves_no_out_folder(work, prompts, problem, hint):
    (work / "bad.json").write_text(json.dumps(prompts))
    done = fxreplace(["capture", "clean", "--prompts", "bad.json", "--out", "new-ref"], work)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: bad.json: {problem}") and line.endswith(f"; hint: {hint}"), line
    assert not (work / "new-ref").exists()


def test_what_the_vllm_engine_cannot_take_is_refused_before_it_starts(work):
    """A builtin: model (the hint saves it as a checkpoint: its command works as printed) and --device
    (vLLM places the model itself), for capture and validate; one line, no engine log."""
    line = refused(fxreplace(["capture", f"builtin:{ARCH}", "--engine", "vllm", "--prompts", "p.json",
                              "--out", "vllm-ref", *ENGINE_ARGS], work))
    assert line.startswith(f"error: --engine vllm loads the checkpoint itself and needs a local directory, got "
                           f"'builtin:{ARCH}'; hint: save the tiny model with its tokenizer as one: "), line
    command = re.search(r"as one: (python -c .*), then give (\S+)$", line)
    python, *rest = shlex.split(command.group(1))  # python: the user's, where fxreplace is installed
    assert python == "python"
    subprocess.run([sys.executable, *rest], cwd=work, check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    saved = work / command.group(2)
    assert (saved / "config.json").is_file() and (saved / "tokenizer.json").is_file()
    assert not (work / "vllm-ref").exists()

    line = refused(fxreplace(["capture", "clean", "--engine", "vllm", "--device", "cpu", "--prompts", "p.json",
                              "--out", "vllm-ref", *ENGINE_ARGS], work))
    assert line == ("error: --device is not a capture option of --engine vllm; hint: engines that capture with it: "
                    "--engine embedded")
    line = refused(fxreplace(["validate", "clean", "--engine", "vllm", "--device", "cpu", "--reference", "ref",
                              *ENGINE_ARGS], work))
    assert line == "error: --device is not an option of --engine vllm; hint: engines that take it: --engine embedded"
