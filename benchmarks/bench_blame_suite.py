"""Localisation benchmark: how often blame names the planted faults, over families, kinds and mixes.

Fixtures are drawn from ``--seed``: tiny models built from configs (4 layers, float32, random
weights) of six families, three fxreplace registers (Qwen3-MoE, Mixtral, Llama) and three it
does not (OLMoE, Qwen2-MoE, Qwen2: blame gets their components as ``{kind: Target}``). Faults
are planted in a copy of the clean model's weights, one of each kind blame names: an attention
projection (q/k/v/o), router rows, one expert's projection (dense: the MLP's), the input and
post-attention norms, the final norm, an embedding row; singly, paired in different layers and
in the same layer, three at once, on top of bf16 drift (the fault dominating it, and a smaller one
beside a substantial drift: blamed without and with a noise floor); plus a clean fp32 copy and pure
bf16 drift.

Ground truth comes from an oracle that does not use blame's search: the target is run
teacher-forced on the reference's sequences with each planted module's output replaced by the
clean model's (forward hooks), and a fixture is kept only when replacing every planted module
removes >= 90% of the divergence (blame's EXPLAINS; a fault on substantial drift: 50-90%, the rest
being the drift) and each one adds >= 10% (SIGNIFICANT) beside the others; the rest are re-drawn (up
to ``--redraws`` times) and reported. Expected
origins: an attention projection or the input norm -> the layer's ``attention``; router rows
-> ``router``; an expert, the MLP or the post-attention norm -> the layer's ``experts``/``mlp``;
an embedding row -> the ``embedding`` (declared by every family: layer 0's input); the final norm ->
after the layers.

Scores per fault fixture: top-1 (the first origin named is planted), recall (planted faults
named), precision (named origins that are planted); per drift fixture: the verdict (pure bf16:
diffuse or within the noise floor; the clean copy: no divergence); cost: validation passes and
rounds against one by one (1 + every component, the streams included), wall time. Prints tables
per family and per fault kind and a final JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from fxreplace.blame import SIGNIFICANT, blame, family_components, resolve_components
from fxreplace.capture import capture_reference
from fxreplace.metrics import DIVERGED, EXPLAINS, compare_steps
from fxreplace.models import decoder_components, get_family, tiny_model
from fxreplace.targets import Target

MOE_KINDS = ["attention_proj", "input_norm", "router_rows", "expert", "post_norm", "final_norm", "embedding"]
DENSE_KINDS = ["attention_proj", "input_norm", "mlp_proj", "post_norm", "final_norm", "embedding"]
FINAL = ("final", None)  # what blame names for a fault after the decoder layers
#: a smaller fault beside a substantial bf16 drift: the fault removes 50-90% of the divergence (the oracle), the
#: drift the rest; blamed without a floor and with one, it must be named alone
FAULT_ON_DRIFT = "fault on drift"


@dataclass(frozen=True)
class FamilySpec:
    arch: str
    registered: bool
    moe: bool


FAMILIES = [FamilySpec("Qwen3MoeForCausalLM", True, True), FamilySpec("MixtralForCausalLM", True, True),
            FamilySpec("LlamaForCausalLM", True, False), FamilySpec("OlmoeForCausalLM", False, True),
            FamilySpec("Qwen2MoeForCausalLM", False, True), FamilySpec("Qwen2ForCausalLM", False, False)]


def unregistered_config(arch: str, layers: int):
    import transformers

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False)
    if arch == "OlmoeForCausalLM":
        return transformers.OlmoeConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2, **common)
    if arch == "Qwen2MoeForCausalLM":
        return transformers.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                           num_experts_per_tok=2, shared_expert_intermediate_size=32, head_dim=32, **common)
    return transformers.Qwen2Config(intermediate_size=128, head_dim=32, **common)


def build(spec: FamilySpec, seed: int, layers: int):
    """The clean model and the components blame is given (None: the family's own)."""
    if spec.registered:
        return tiny_model(spec.arch, seed=seed, num_hidden_layers=layers), None
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(unregistered_config(spec.arch, layers), dtype=torch.float32).eval()
    components = (decoder_components(router=Target("model.layers.*.mlp.gate")) if spec.moe
                  else decoder_components(block_kind="mlp"))
    return model, components


# ---------------------------------------------------------------------------------------------- faults

@dataclass
class Fault:
    kind: str
    layer: int | None
    module: str  # the module holding the planted weights (the oracle replaces its output)
    expected: tuple  # (kind, layer) blame should name
    detail: str = ""


def plant(model, kind: str, layer: int, rng: random.Random, block: str, tokens: list[int],
          size: float | None = None) -> Fault:
    """Perturb ``model`` in place; the fault it now holds (``size``: relative to the weights' spread,
    default 0.5-1)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    size = rng.uniform(0.5, 1.0) if size is None else size

    def noise(w):
        w.add_(size * w.std() * torch.randn(w.shape, generator=g))

    def scale(w):  # norms: weights ~1 with no spread
        w.mul_(1 + size * torch.randn(w.shape, generator=g))

    layers = model.model.layers
    with torch.no_grad():
        if kind == "attention_proj":
            proj = rng.choice(["q_proj", "k_proj", "v_proj", "o_proj"])
            noise(getattr(layers[layer].self_attn, proj).weight)
            return Fault(kind, layer, f"model.layers.{layer}.self_attn.{proj}", ("attention", layer), proj)
        if kind == "input_norm":
            scale(layers[layer].input_layernorm.weight)
            return Fault(kind, layer, f"model.layers.{layer}.input_layernorm", ("attention", layer))
        if kind == "post_norm":
            scale(layers[layer].post_attention_layernorm.weight)
            return Fault(kind, layer, f"model.layers.{layer}.post_attention_layernorm", (block, layer))
        if kind == "router_rows":
            gate = layers[layer].mlp.gate.weight
            rows = rng.sample(range(gate.shape[0]), 2)
            gate[rows] = -gate[rows] * (1 + size)
            return Fault(kind, layer, f"model.layers.{layer}.mlp.gate", ("router", layer), f"rows {rows}")
        if kind == "expert":
            experts = layers[layer].mlp.experts
            e = rng.randrange(experts.gate_up_proj.shape[0])
            noise(experts.gate_up_proj[e])
            return Fault(kind, layer, f"model.layers.{layer}.mlp.experts", ("experts", layer), f"expert {e}")
        if kind == "mlp_proj":
            proj = rng.choice(["gate_proj", "up_proj", "down_proj"])
            noise(getattr(layers[layer].mlp, proj).weight)
            return Fault(kind, layer, f"model.layers.{layer}.mlp.{proj}", ("mlp", layer), proj)
        if kind == "final_norm":
            scale(model.model.norm.weight)
            return Fault(kind, None, "model.norm", FINAL)
        if kind == "embedding":
            token = rng.choice(tokens)
            noise(model.model.embed_tokens.weight[token])
            return Fault(kind, None, "model.embed_tokens", ("embedding", 0), f"token {token}")
    raise ValueError(f"unknown fault kind {kind}")


# ---------------------------------------------------------------------------------------------- oracle

def sequences(reference) -> list[tuple[list[int], int]]:
    """Each prompt and the reference's generated tokens, teacher-forced (and the prompt's length)."""
    return [(reference.prompt_tokens(p) + reference.tokens(p)[:-1], len(reference.prompt_tokens(p)))
            for p in range(reference.num_prompts)]


@torch.no_grad()
def oracle(clean, target, reference, replaced_sets: list[list[str]]) -> list[dict]:
    """Per set of module names: the target's divergence from the reference (mean KL, mean top-5
    error, whether a step diverged) with those modules' outputs replaced by the clean model's."""
    dtype = next(target.parameters()).dtype
    wanted = sorted({m for s in replaced_sets for m in s})
    clean_out: list[dict] = []
    for ids, _ in sequences(reference):
        seen = {}
        hooks = [clean.get_submodule(m).register_forward_hook(lambda mod, a, out, m=m: seen.__setitem__(m, out))
                 for m in wanted]
        clean(input_ids=torch.tensor([ids]), use_cache=False)
        for h in hooks:
            h.remove()
        clean_out.append(seen)
    results = []
    for names in replaced_sets:
        steps = []
        for p, (ids, plen) in enumerate(sequences(reference)):
            cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
            hooks = [target.get_submodule(m).register_forward_hook(
                lambda mod, a, out, m=m, p=p: torch.utils._pytree.tree_map(cast, clean_out[p][m])) for m in names]
            logits = target(input_ids=torch.tensor([ids]), use_cache=False).logits[0, plen - 1:].float()
            for h in hooks:
                h.remove()
            steps += compare_steps(reference.logits(p), logits)
        results.append({"mean_kl": statistics.fmean(s.kl for s in steps),
                        "mean_top5_error": statistics.fmean(s.top5_error for s in steps),
                        "diverged": any(s.status == DIVERGED for s in steps)})
    return results


def removed(off: dict, on: dict) -> float:
    """The part of ``off``'s divergence gone in ``on``: the smaller of the KL and top-5 error removed."""
    parts = [1 - on[k] / off[k] for k in ("mean_kl", "mean_top5_error") if off[k] > 0]
    return min(parts) if parts else 0.0


def decide(clean, target, reference, faults: list[Fault], explain: tuple[float, float] = (EXPLAINS, 1.0)) -> str | None:
    """None when the oracle confirms the faults as the fixture's ground truth (replaced together, they
    remove a part of the divergence within ``explain``), else why not."""
    modules = [f.module for f in faults]
    sets = [[], modules] + ([[m for m in modules if m != f.module] for f in faults] if len(faults) > 1 else [])
    off, together, *without = oracle(clean, target, reference, sets)
    if not off["diverged"]:
        return "the target does not diverge"
    if not explain[0] <= removed(off, together) <= explain[1]:
        return (f"the planted modules replaced explain {removed(off, together):.0%} (not within "
                f"{explain[0]:.0%}-{explain[1]:.0%})")
    for f, rest in zip(faults, without):
        if removed(off, together) - removed(off, rest) < SIGNIFICANT:
            return f"{f.kind} at layer {f.layer} adds {removed(off, together) - removed(off, rest):.0%} beside the others"
    return None


# ---------------------------------------------------------------------------------------------- scoring

def named(result) -> list[tuple]:
    """What a blame result names, in its ranking's order: (kind, layer) per origin (a layer no kind
    explains as ("layer", L)) or candidate (a target below float32 without a floor: the strongest
    components beside a diffuse drift, which its verdict names), then FINAL when a significant part
    arises after the last layer."""
    off = next((p for p in result.passes if not p.replaced), None)
    if off is not None and off.steps_diverged == 0 and not off.nonfinite:
        return []  # nothing diverges: nothing to name
    out = [(o.kind if o.component else "layer", o.layer) for o in result.origins + getattr(result, "candidates", [])]
    last = result.layer_shares[-1] if result.layer_shares else None
    if last is not None and last.layer == max(result.layers) and last.explained is not None \
            and 1 - last.explained >= SIGNIFICANT and not result.diffuse:
        out.append(FINAL)
    return out


def score(expected: list[tuple], result) -> dict:
    """top-1, recall and precision of one fault fixture's blame result against its planted faults."""
    found = named(result)
    hits = [n for n in found if n in expected]
    return {"top1": float(bool(found) and found[0] in expected),
            "recall": len(set(hits)) / len(set(expected)),
            "precision": len(hits) / len(found) if found else 1.0,
            "named": found}


def drift_right(case: str, result) -> bool:
    """Pure bf16 drift (with a floor or without): diffuse, or within the noise floor, no origin named; the
    clean copy: no divergence at all."""
    floor = getattr(result, "floor", None) or {}
    if case.startswith("clean fp32"):
        return not result.origins and not result.diffuse and not named(result)
    return bool(result.diffuse or floor.get("within")) and not result.origins


# ---------------------------------------------------------------------------------------------- cases

@dataclass
class Case:
    family: str
    name: str  # the fault kind, or the mix
    faults: list[Fault] = field(default_factory=list)
    bf16: bool = False
    drift: bool = False  # scored by its verdict


def case_plan(kinds: list[str], rng: random.Random, singles: int) -> list[tuple[str, list[str], bool]]:
    """(name, fault kinds, bf16) per case of one family."""
    layered = [k for k in kinds if k not in ("final_norm", "embedding")]
    plan = [(k, [k], False) for k in kinds for _ in range(singles)]
    plan.append(("pair, different layers", rng.sample(layered, 2), False))
    plan.append(("pair, same layer", ["attention_proj", rng.choice([k for k in layered if k in ("expert", "mlp_proj")])],
                 False))
    plan.append(("triple", rng.sample(layered, 3), False))
    plan.append(("on bf16 drift", [rng.choice(["attention_proj", "router_rows" if "router_rows" in kinds else "mlp_proj"])],
                 True))
    plan.append((FAULT_ON_DRIFT, [rng.choice(["attention_proj", "mlp_proj" if "mlp_proj" in kinds else "expert"])],
                 True))
    return plan


def run_case(case: Case, target, reference, components, clean=None, name: str | None = None) -> dict:
    """Blame ``target`` (``clean``: the clean model given, as `blame --clean`: the noise floor is measured from
    it; ``name``: the row's case, default the case's)."""
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if case.bf16 else None
    result = blame(target, reference, components=components, dtype=dtype, clean=clean, progress=False)
    row = {"family": case.family, "case": name or case.name, "bf16": case.bf16,
           "planted": [(f.kind, f.layer, f.detail) for f in case.faults], "expected": [f.expected for f in case.faults],
           "passes": len(result.passes), "rounds": result.rounds, "seconds": time.perf_counter() - t0,
           "one_by_one": 1 + len(resolve_components(target, components or family_components(target))),
           "verdict": result.verdict}
    if case.drift:
        row.update(drift=True, right=drift_right(case.name, result), named=named(result))
    else:
        row.update(drift=False, **score([f.expected for f in case.faults], result))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", nargs="+", default=[f.arch for f in FAMILIES])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--singles", type=int, default=1, help="fixtures per fault kind and family")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--redraws", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows, refused = [], []
    for spec in [f for f in FAMILIES if f.arch in args.families]:
        rows_family, why = run_family(spec, args)
        rows += rows_family
        refused += why
    report(rows, refused, args, time.perf_counter() - started)


def draw_reference(clean, components, spec: FamilySpec, g: torch.Generator, prompts: int, new_tokens: int):
    ids = [torch.randint(4, 128, (int(n),), generator=g).tolist() for n in torch.randint(6, 14, (prompts,), generator=g)]
    return capture_reference(clean, ids, [], new_tokens, progress=False,
                             components=components or get_family(spec.arch).components)


def run_family(spec: FamilySpec, args) -> tuple[list[dict], list[str]]:
    rng = random.Random(f"{args.seed}-{spec.arch}")
    g = torch.Generator().manual_seed(args.seed)
    clean, components = build(spec, args.seed, args.layers)
    reference = draw_reference(clean, components, spec, g, args.prompts, args.new_tokens)
    rows, refused = [], []
    for name, kinds, bf16 in case_plan(MOE_KINDS if spec.moe else DENSE_KINDS, rng, args.singles):
        case, why = draw(spec, clean, reference, name, kinds, bf16, rng, args.redraws, args.layers)
        refused += [f"{spec.arch} {name}: {w}" for w in why]
        if case is None:
            refused.append(f"{spec.arch} {name}: undecidable after {args.redraws + 1} draws (not run)")
            continue
        if name == FAULT_ON_DRIFT:  # the same target without a floor, then with the clean model (the floor measured)
            rows.append(run_case(case[0], case[1], reference, components, name=f"{name}, no floor"))
            print(line(rows[-1]), flush=True)
            rows.append(run_case(case[0], case[1], reference, components, clean=clean, name=f"{name}, floor"))
        else:
            rows.append(run_case(case[0], case[1], reference, components))
        print(line(rows[-1]), flush=True)
    rows.append(run_case(Case(spec.arch, "clean fp32", drift=True), clean, reference, components))
    print(line(rows[-1]), flush=True)
    # pure bf16 drift needs prompts on which the bf16 copy diverges at all: re-drawn (longer) until it does
    for _ in range(args.redraws + 1):
        if oracle(clean, copy.deepcopy(clean).to(torch.bfloat16), reference, [[]])[0]["diverged"]:
            pure = Case(spec.arch, "pure bf16", bf16=True, drift=True)
            rows.append(run_case(pure, clean, reference, components))
            print(line(rows[-1]), flush=True)
            rows.append(run_case(pure, clean, reference, components, clean=clean, name="pure bf16, floor"))
            print(line(rows[-1]), flush=True)
            break
        refused.append(f"{spec.arch} pure bf16: the bf16 copy does not diverge on {reference.num_prompts} prompts x "
                       f"{reference.num_generated(0)} tokens; prompts re-drawn, twice as many and long")
        reference = draw_reference(clean, components, spec, g, 2 * reference.num_prompts, 2 * reference.num_generated(0))
    else:
        refused.append(f"{spec.arch} pure bf16: undecidable after {args.redraws + 1} draws (not run)")
    return rows, refused


def draw(spec, clean, reference, name, kinds, bf16, rng, redraws, layers):
    """A fixture of the plan's entry the oracle decides, with its target (re-drawn while the oracle
    cannot decide, up to ``redraws`` times), and why each refused draw was refused."""
    block = "experts" if spec.moe else "mlp"
    tokens = sorted({t for p in range(reference.num_prompts) for t in reference.prompt_tokens(p)})
    refused = []
    on_drift = name == FAULT_ON_DRIFT
    # a fault on substantial drift: small enough for the drift to hold 10-50% of the divergence; its size (relative
    # to the weights' spread) halves after a draw the fault dominates and doubles after one the drift does
    size = 0.15 if on_drift else None
    for _ in range(2 * redraws + 1 if on_drift else redraws + 1):
        target = copy.deepcopy(clean)
        where = [rng.randrange(layers)] * 2 if name == "pair, same layer" else rng.sample(range(layers), len(kinds))
        faults = [plant(target, k, layer, rng, block, tokens, size) for k, layer in zip(kinds, where)]
        if bf16:
            target.to(torch.bfloat16)
        why = decide(clean, target, reference, faults, (0.5, EXPLAINS) if on_drift else (EXPLAINS, 1.0))
        if why is None:
            return (Case(spec.arch, name, faults, bf16), target), refused
        refused.append(f"{', '.join(f'{f.kind}@{f.layer}' for f in faults)}"
                       f"{f' (size {size:.2g})' if on_drift else ''}: {why}")
        if on_drift:
            off, together = oracle(clean, target, reference, [[], [f.module for f in faults]])
            size = size / 2 if removed(off, together) > EXPLAINS else size * 2
    return None, refused


def line(r: dict) -> str:
    what = (f"right={r['right']}" if r["drift"] else
            f"top1={r['top1']:.0f} recall={r['recall']:.2f} precision={r['precision']:.2f}")
    return (f"  {r['family']:<20} {r['case']:<24} {what:<40} named={r['named']} expected={r.get('expected')} "
            f"passes={r['passes']}/{r['one_by_one']} rounds={r['rounds']} {r['seconds']:.1f}s")


def aggregate(rows: list[dict]) -> dict:
    faults = [r for r in rows if not r["drift"]]
    drift = [r for r in rows if r["drift"]]
    mean = lambda key: round(statistics.fmean(r[key] for r in faults), 3) if faults else None  # noqa: E731
    return {"cases": len(rows), "top1": mean("top1"), "recall": mean("recall"), "precision": mean("precision"),
            "drift_right": f"{sum(r['right'] for r in drift)}/{len(drift)}",
            "median_passes": statistics.median(r["passes"] for r in rows) if rows else None,
            "one_by_one": statistics.median(r["one_by_one"] for r in rows) if rows else None,
            "median_rounds": statistics.median(r["rounds"] for r in rows) if rows else None,
            "seconds": round(sum(r["seconds"] for r in rows), 1)}


def report(rows: list[dict], refused: list[str], args, seconds: float) -> None:
    def table(key):
        groups = defaultdict(list)
        for r in rows:
            groups[r[key] if key == "family" else ("drift: " + r["case"] if r["drift"] else r["case"])].append(r)
        head = (f"{key:<26} {'cases':>5} {'top-1':>6} {'recall':>6} {'prec.':>6} {'drift ok':>8} {'passes':>6} "
                f"{'1-by-1':>6} {'rounds':>6} {'s':>7}")
        print(head)
        print("-" * len(head))
        for name, group in groups.items():
            a = aggregate(group)
            f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            print(f"{name:<26} {a['cases']:>5} {f(a['top1']):>6} {f(a['recall']):>6} {f(a['precision']):>6} "
                  f"{a['drift_right']:>8} {a['median_passes']:>6g} {a['one_by_one']:>6g} {a['median_rounds']:>6g} "
                  f"{a['seconds']:>7.1f}")
        return {name: aggregate(group) for name, group in groups.items()}

    print(f"\nseed {args.seed}; {args.prompts} prompts x {args.new_tokens} tokens; {args.layers} layers; "
          f"{args.singles} fixture(s) per kind and family; medians of passes and rounds\n")
    by_family = table("family")
    print()
    by_kind = table("case")
    print(f"\nre-drawn or not run ({len(refused)}):")
    for why in refused:
        print(f"  {why}")
    missed = [r for r in rows if (not r["drift"] and (r["recall"] < 1 or r["precision"] < 1)) or (r["drift"] and not r["right"])]
    for r in missed:
        print(f"  missed: {r['family']} {r['case']} {r['planted']}: named {r['named']}; {r['verdict'][:300]}")
    total = aggregate(rows)
    goal = (total["top1"] is not None and min(total["top1"], total["recall"], total["precision"]) >= 0.95
            and all(r["right"] for r in rows if r["drift"]) and total["median_passes"] < total["one_by_one"] / 2)
    print(json.dumps({"seed": args.seed, "families": args.families, "layers": args.layers, "singles": args.singles,
                      "prompts": args.prompts,
                      "new_tokens": args.new_tokens, **total, "redrawn_or_not_run": len(refused),
                      "wall_seconds": round(seconds, 1), "by_family": by_family, "by_kind": by_kind, "goal_met": goal}))


if __name__ == "__main__":
    main()
