"""Reference capture vs plain greedy generation of the same model and prompts, interleaved.

Prints a table and a final JSON line {"capture_overhead": median capture / median generate}.
Goal (issue 4): <= 1.10.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fxreplace.capture import capture_reference
from fxreplace.models import get_family, tiny_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    arch = "Qwen3MoeForCausalLM"
    model = tiny_model(arch, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                       num_experts=16, vocab_size=1024)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (64,), generator=g).tolist() for _ in range(4)]
    new_tokens = 16 if args.quick else 32
    reps = 3 if args.quick else 7
    targets = list(get_family(arch).targets)

    def generate():
        with torch.no_grad():
            for p in prompts:
                model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def capture():
        capture_reference(model, prompts, targets, new_tokens, progress=False)

    generate(), capture()  # warm up
    times = {"generate": [], "capture": []}
    for _ in range(reps):
        for name, fn in (("generate", generate), ("capture", capture)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{len(prompts)} prompts x {new_tokens} tokens, {len(targets)} target pattern(s), {reps} interleaved repetitions")
    print(f"{'':<22}{'median s':>10}")
    for k, v in med.items():
        print(f"{k:<22}{v:>10.3f}")
    print(json.dumps({"capture_overhead": round(med["capture"] / med["generate"], 3)}))


if __name__ == "__main__":
    main()
