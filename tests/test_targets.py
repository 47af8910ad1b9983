"""Target resolution: globs, capture-name templates, and the promised errors."""

import pytest
import torch
from torch import nn

from fxreplace.instrument import instrument
from fxreplace.points import locate_injection_point
from fxreplace.targets import Target, TargetError, resolve_targets


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 8)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) + 0 * self.router(x).sum()


class Pair(nn.Module):
    def forward(self, x):
        return x * 2, x * 3


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.pair = Pair()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        doubled, tripled = self.pair(x)  # both read: either element is a live point
        return doubled + tripled


def test_glob_star_matches_one_component_in_model_order():
    names = [r.module_name for r in resolve_targets(Toy(), ["layers.*.router"])]
    assert names == ["layers.0.router", "layers.1.router", "layers.2.router"]
    assert [r.module_name for r in resolve_targets(Toy(), ["layers.*"])] == ["layers.0", "layers.1", "layers.2"]
    assert len(resolve_targets(Toy(), ["layers.**"])) == 3 * 3


def test_capture_name_template():
    resolved = resolve_targets(Toy(), [Target("layers.*.router", name="model.layers.{}.mlp.gate")])
    assert [r.capture_name for r in resolved] == [f"model.layers.{i}.mlp.gate" for i in range(3)]


def test_unknown_pattern_lists_closest_names():
    with pytest.raises(TargetError, match=r"matches no module.*layers\.0\.router"):
        resolve_targets(Toy(), ["layers.*.routr"])


def test_double_match_is_an_error():
    with pytest.raises(TargetError, match="more than one target"):
        resolve_targets(Toy(), ["layers.*.router", "layers.0.router"])


def test_module_without_the_point_lists_close_names():
    with pytest.raises(TargetError, match=r"'pair'.*no single node.*closest qualified names"):
        instrument(Toy(), [Target("pair", point="auto")])
    with pytest.raises(TargetError, match="unknown point"):
        instrument(Toy(), [Target("layers.0", point="logits")])
    with pytest.raises(TargetError, match="not one of its nodes"):
        instrument(Toy(), [Target("layers.0", point=lambda nodes: None)])


def test_auto_point_picks_output_or_first_linear():
    toy = Toy()
    assert locate_injection_point(toy.layers[0].router, "r", "auto").graph_module is None  # one tensor out
    point = locate_injection_point(toy.pair, "pair", lambda nodes: nodes[1])
    assert point.graph_module is not None
    picked = locate_injection_point(toy.layers[0], "layers.0", lambda nodes: nodes[0])
    assert picked.graph_module is not None


def test_output_point_on_a_tuple_needs_an_index():
    toy = instrument(Toy(), [Target("pair", point="output")])
    with pytest.raises(TargetError, match=r"adapter for pair returns 1 tensor.*computes 2.*output\[i\]"):
        toy(torch.zeros(2, 4), replacements={"pair": torch.zeros(2, 4)})
    fixed = instrument(Toy(), [Target("pair", point="output[1]")])
    out = fixed.pair(torch.ones(2, 4))  # outside an instrumented forward: untouched
    assert torch.equal(out[1], torch.full((2, 4), 3.0))
