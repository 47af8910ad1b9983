"""``fxreplace demo``: the whole workflow on a built-in tiny MoE model.

Reference: the fp32 model, eager. Target: the same weights in bf16, instrumented
and compiled, run by the embedded runner. Both are validated with teacher forcing,
without and with router-logit replacement, and a report is written; every verdict
has a scale: the noise floor (the reference model itself in bf16, measured once and
stored beside the reference). Then :func:`fxreplace.blame` searches the bf16 target
(within precision noise: nothing to blame beyond the precision) and the bf16 target with
two planted faults (it names both, each as a multiple of the floor, and reports the rest
as precision noise). The reference holds the router logits only: blame captures the
components it needs from the clean model on demand, stores them beside the reference and
the second search reuses them. The demo ends
with :mod:`fxreplace.repro`: the planted fault's first origin alone, run in eager ("the port").
"""

from __future__ import annotations

import copy
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import repro_run
from .blame import blame
from .capture import capture_reference
from .floor import measure_floor, save_floor
from .instrument import instrument
from .models import get_family, tiny_model
from .replacer import TensorReplacer
from .report import print_summary, write_blame_report
from .repro import write_repro
from .engines.embedded import Runner, RunnerConfig
from .validation import ValidationResult, logit_validation


@dataclass
class DemoConfig:
    architecture: str = "Qwen3MoeForCausalLM"
    prompts: int = 8
    new_tokens: int = 32
    layers: int = 4
    experts: int = 16
    init_std: float = 0.3  # peaked logits, so ties don't decide divergence
    seed: int = 1
    compile: bool = True
    report_dir: str = "fxreplace-report"
    blame_prompts: int = 2  # the blame search's prompts (each of its passes validates them all)
    device: str = "cpu"  # where the reference and the target run (e.g. "cuda")


def run_demo(cfg: DemoConfig = DemoConfig(), progress: bool = True) -> ValidationResult:
    started = time.perf_counter()
    family = get_family(cfg.architecture)
    reference_model = tiny_model(cfg.architecture, seed=cfg.seed, init_std=cfg.init_std, num_hidden_layers=cfg.layers,
                                 num_experts=cfg.experts).to(cfg.device)
    config = reference_model.config
    generator = torch.Generator().manual_seed(cfg.seed)
    prompts = [
        torch.randint(0, config.vocab_size, (int(torch.randint(8, 25, (1,), generator=generator)),), generator=generator).tolist()
        for _ in range(cfg.prompts)
    ]
    targets = list(family.targets)
    print(f"reference: {cfg.architecture} ({cfg.layers} layers, {_experts(config)} experts, fp32, eager); "
          f"{cfg.prompts} prompts x {cfg.new_tokens} new tokens; router logits captured")
    reference = capture_reference(reference_model, prompts, targets, cfg.new_tokens, progress=progress)
    reference_dir = Path(cfg.report_dir) / "reference"
    if reference_dir.exists():  # a previous demo's reference and the components blame stored beside it
        shutil.rmtree(reference_dir)
    reference.save(reference_dir)
    floor = measure_floor(reference_model, reference, torch.bfloat16)  # what bf16 rounding alone causes
    save_floor(floor, reference_dir)
    whole = floor.aggregate(range(reference.num_prompts))
    print(f"noise floor: the reference model in bf16 diverges by mean KL {whole['mean_kl']:.3g}, mean top-5 error "
          f"{whole['mean_top5_error']:.3g} ({floor.seconds:.1f} s, stored beside the reference)")

    target_model = instrument(copy.deepcopy(reference_model).to(torch.bfloat16), targets)
    runner = Runner(
        target_model,
        config,
        replacer=TensorReplacer(reference.store),
        runner_config=RunnerConfig(prefill_buckets=(64,), batch_buckets=(cfg.prompts,), max_len=128, teacher_forcing=True),
        dtype=torch.bfloat16,
        observed=target_model,
        compile="inductor" if cfg.compile else None,
    )
    print(f"target: the same weights in bf16, instrumented at {len(target_model.targets)} routers, "
          f"{'compiled (inductor)' if cfg.compile else 'eager'}, embedded runner")
    result = logit_validation(runner, reference, router_topk=getattr(config, "num_experts_per_tok", None), progress=progress)
    result.replaced = "the router logits"
    result.floor = floor
    result.program = {"engine": "embedded", "compile": cfg.compile, "dtype": "bfloat16"}
    report = result.write_report(cfg.report_dir)
    print_summary(result)
    if cfg.compile:
        print(f"graphs compiled: {runner.graphs_compiled} (one per bucket; replacement on and off share them)")
    print()
    _blame_and_repro(cfg, reference_model, reference_dir, progress)
    if cfg.compile:  # inductor's compile workers stop at exit, its longest part: stopped now, the exit follows the line
        from torch._inductor.async_compile import shutdown_compile_workers  # no public API stops them

        shutdown_compile_workers()
    print(f"report: {Path(report).resolve()}, {Path(cfg.report_dir).resolve() / 'blame.html'}, "
          f"{Path(cfg.report_dir).resolve() / 'blame-planted' / 'blame.html'}   ({time.perf_counter() - started:.0f} s)")
    return result


def _blame_and_repro(cfg: DemoConfig, reference_model, reference_dir: Path, progress: bool) -> None:
    """The demo's blame of the bf16 target, of one with two planted faults, and the repro of its first origin."""
    blame_prompts = list(range(min(cfg.blame_prompts, cfg.prompts)))
    print(f"blame: which components make the bf16 target drift? (prompts 0-{blame_prompts[-1]}; the layers' streams "
          "split side by side, then each kind of the origin layer; components captured from the clean model on demand)")
    if cfg.compile:
        print("blame examines the eager program, not the compiled one validated above: its passes run side by side in "
              "batches of other shapes, each a graph to compile (`fxreplace blame --from-validation DIR` examines the "
              "program a validation ran)")
    blamed = blame(reference_model, reference_dir, clean=reference_model, dtype=torch.bfloat16, prompts=blame_prompts,
                   progress=progress)
    blamed.write_report(cfg.report_dir)
    print(blamed.table(limit=6))
    print(f"blame verdict: {blamed.verdict}")
    planted = copy.deepcopy(reference_model)
    with torch.no_grad():  # two independent faults: layer 0's attention output and the last layer's router
        planted.model.layers[0].self_attn.o_proj.weight.mul_(1.5)
        planted.model.layers[cfg.layers - 1].mlp.gate.weight.mul_(-1.0)
    print()
    print("blame: the bf16 target with two planted faults (layer 0 attention, last layer's router) on its drift")
    found = blame(planted, reference_dir, clean=reference_model, dtype=torch.bfloat16, prompts=blame_prompts,
                  progress=progress)
    folder = (Path(cfg.report_dir) / "repro").resolve()
    repro = f"the first origin alone, as a ticket for the compiler team: {folder} (run it: fxreplace repro run {folder} " \
            "--backend inductor)"
    write_blame_report(found, Path(cfg.report_dir) / "blame-planted", repro)  # the page names the repro written below
    print(found.table(limit=6))
    print(f"blame verdict (planted): {found.verdict}")
    print()
    write_repro(planted, reference_model, reference_dir, found, folder, inputs=2, prompts=blame_prompts)
    print(f"repro: {repro}; in eager:")
    repro_run.run(folder)


def _experts(config) -> int:
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", 0)
