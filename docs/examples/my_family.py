"""Registering a model family with fxreplace: the example of docs/extending.md, run by tests/test_docs.py.

A real family names its own config class and architecture; this one reuses Qwen3-MoE's
config under a new architecture name so that it runs anywhere transformers 5 does.
"""

from transformers import Qwen3MoeConfig

from fxreplace.models import Family, decoder_components, register_family, register_sites
from fxreplace.targets import Target

ROUTER = Target("model.layers.*.mlp.gate")  # router logits: the gate's first linear (point "auto")
ROUTING = Target("model.layers.*.mlp.experts", point="routing")  # the top-k weights and ids the experts are called with


def tiny_config():
    # few layers; head_dim in {32, 64, ...} (vLLM's CPU attention); >= 8 experts
    return Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                          num_experts=8, num_experts_per_tok=2, architectures=["MyMoeForCausalLM"])


FAMILY = register_family(Family(
    architecture="MyMoeForCausalLM",
    targets=(ROUTER,),
    tiny_config=tiny_config,
    components=decoder_components(router=ROUTER, routing=ROUTING),  # what `fxreplace blame` replaces, in forward order
))
# the same router in vLLM's model code, whose gate returns (logits, bias): what `--engine vllm` replaces
register_sites("vllm", "MyMoeForCausalLM", targets=(Target("model.layers.*.mlp.gate", point="output[0]"),))
