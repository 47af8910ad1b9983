"""The built-in example: captures → store on disk → scheduler batches → replacement contexts."""

from __future__ import annotations

import tempfile

import torch

from .replacer import TensorReplacementConfig
from .store import ReferenceStore


def run_context_demo() -> None:
    torch.manual_seed(0)
    experts, layers = 8, 2
    prompts = [[101, 7, 42, 9], [101, 7, 55]]
    decode_steps = 3
    # Step-wise router logits as a reference model produces them: prefill [1, L, E],
    # then one full recompute [1, L + i, E] per generated token.
    captures = [
        {f"model.layers.{n}.mlp.gate": [torch.randn(1, len(p) + i, experts) for i in range(decode_steps + 1)] for n in range(layers)}
        for p in prompts
    ]
    with tempfile.TemporaryDirectory() as tmp:
        ReferenceStore.from_captures(captures, prompt_token_ids=prompts, metadata={"source_model": "demo"}).save(tmp)
        print(f"saved {len(prompts)} prompts x {layers} modules to {tmp} (safetensors + index.json)")
        replacer = TensorReplacementConfig(tensors_path=tmp).build(on_unknown="passthrough")

        print("register: a prompt, a teacher-forcing retry of it, and an unknown prompt")
        for req, tokens in {"req-a": prompts[0], "req-a-retry": prompts[0] + [5, 6], "req-b": prompts[1], "req-x": [1, 2]}.items():
            print(f"  {req:<12} {tokens} -> prompt {replacer.register_request(req, tokens)}")

        ctx = replacer.build_context(["req-b"], [0, 1, 2, 0, 0, 0, 0, 0], is_prefill=True)
        print(f"prefill bucket of 8 for req-b: mask {ctx.mask.int().tolist()}")
        ctx = replacer.build_context_for_batch(["req-a-retry", "req-b", "req-x"], [2, 1, 1], [4, 5, 3, 9, 0, 0])
        print(f"mixed batch (2 speculative + 1 decode + 1 unknown + 2 padding): mask {ctx.mask.int().tolist()}")
        gate = ctx["model.layers.0.mlp.gate"]
        print(f"layer 0 router logits for those slots: {tuple(gate.shape)}, argmax {gate.argmax(-1).tolist()}")
        for req in list(replacer.requests):
            replacer.release_request(req)
        print(f"released all requests; request map now {replacer.requests}")
