"""Compiler faults planted for the repro tests: a torch.compile backend that perturbs one op of
the graph it is given, and an inductor lowering that computes a matrix product wrong. Importable
by the repro runner's fresh process (``--backend repro_faults:perturb_last_linear``)."""

from __future__ import annotations

import contextlib

import torch

SCALE = 1.1  # a wrong op: 10% off, far outside any dtype's tolerance


def perturb_last_linear(gm: torch.fx.GraphModule, example_inputs):
    """A backend running the graph eagerly with its last linear's output scaled by SCALE (an
    attention's output projection: Qwen3's q/k norms would undo a scaled q or k)."""
    for node in reversed(gm.graph.nodes):
        if node.op == "call_function" and "linear" in str(node.target):
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(torch.mul, (node, SCALE))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
            gm.recompile()
            return gm.forward
    raise AssertionError(f"no linear in the graph: {[str(n.target) for n in gm.graph.nodes]}")


@contextlib.contextmanager
def wrong_mm_lowering():
    """Inductor lowers aten.mm to a product scaled by SCALE (what the compiler bisector must find
    in its lowerings: the node whose ATen fallback fixes it). Compiled graphs are not read from
    inductor's cache meanwhile: a graph compiled before would skip the lowering."""
    from torch._inductor import config, lowering

    mm = torch.ops.aten.mm.default
    right = lowering.lowerings[mm]

    def wrong(*args, **kwargs):
        return lowering.lowerings[torch.ops.aten.mul.Tensor](right(*args, **kwargs), SCALE)

    lowering.lowerings[mm] = wrong
    try:
        with config.patch(fx_graph_cache=False):
            yield
    finally:
        lowering.lowerings[mm] = right
