"""``fxreplace demo``: the whole workflow on a built-in tiny MoE model.

Reference: the fp32 model, eager. Target: the same weights in bf16, instrumented
and compiled, run by the embedded runner. Both are validated with teacher forcing,
without and with router-logit replacement, and a report is written. Then
:func:`fxreplace.blame` searches the bf16 target for the component that explains
what router replacement leaves (bf16 rounding: it reports diffuse drift).
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .blame import blame
from .capture import capture_reference
from .instrument import instrument
from .replacer import TensorReplacer
from .report import print_summary
from .runner import Runner, RunnerConfig
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


def run_demo(cfg: DemoConfig = DemoConfig(), progress: bool = True) -> ValidationResult:
    with warnings.catch_warnings():
        # transformers' MoE dispatch calls lru_cache'd version checks that Dynamo warns about, harmlessly
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
        return _run_demo(cfg, progress)


def _run_demo(cfg: DemoConfig, progress: bool) -> ValidationResult:
    from fxreplace.models import get_family, tiny_model

    started = time.perf_counter()
    family = get_family(cfg.architecture)
    reference_model = tiny_model(cfg.architecture, seed=cfg.seed, init_std=cfg.init_std, num_hidden_layers=cfg.layers,
                                 num_experts=cfg.experts)
    config = reference_model.config
    generator = torch.Generator().manual_seed(cfg.seed)
    prompts = [
        torch.randint(0, config.vocab_size, (int(torch.randint(8, 25, (1,), generator=generator)),), generator=generator).tolist()
        for _ in range(cfg.prompts)
    ]
    targets = list(family.targets)
    print(f"reference: {cfg.architecture} ({cfg.layers} layers, {_experts(config)} experts, fp32, eager); "
          f"{cfg.prompts} prompts x {cfg.new_tokens} new tokens; router logits and the blame components captured")
    reference = capture_reference(reference_model, prompts, targets, cfg.new_tokens, components=family.components,
                                  progress=progress)

    target_model = instrument(copy.deepcopy(reference_model).to(torch.bfloat16), targets)
    runner = Runner(
        target_model,
        config,
        replacer=TensorReplacer(reference.store),
        runner_config=RunnerConfig(prefill_buckets=(64,), batch_buckets=(cfg.prompts,), max_len=128),
        dtype=torch.bfloat16,
        observed=target_model,
        compile="inductor" if cfg.compile else None,
    )
    print(f"target: the same weights in bf16, instrumented at {len(target_model.targets)} routers, "
          f"{'compiled (inductor)' if cfg.compile else 'eager'}, embedded runner")
    result = logit_validation(runner, reference, router_topk=getattr(config, "num_experts_per_tok", None), progress=progress)
    result.replaced = "the router logits"
    report = result.write_report(cfg.report_dir)
    print_summary(result)
    if cfg.compile:
        print(f"graphs compiled: {runner.graphs_compiled} (one per bucket; replacement on and off share them)")
    print()
    print(f"blame: which component makes the bf16 target drift? (prompts 0-{cfg.blame_prompts - 1}; bisection over "
          "layers, then each kind alone)")
    blamed = blame(reference_model, reference, dtype=torch.bfloat16, prompts=range(min(cfg.blame_prompts, cfg.prompts)),
                   progress=progress)
    blamed.write_report(cfg.report_dir)
    print(blamed.table(limit=6))
    print(f"blame verdict: {blamed.verdict}")
    print(f"report: {Path(report).resolve()}, {Path(cfg.report_dir).resolve() / 'blame.html'}   "
          f"({time.perf_counter() - started:.0f} s)")
    return result


def _experts(config) -> int:
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", 0)
