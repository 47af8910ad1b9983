"""The family sites in this engine's model code. It runs the Hugging Face implementation, so they
are the HF modules (an engine with model code of its own names its modules here, each with the
HF capture it reads: ``Target(pattern, point=..., name="model.layers.{}.mlp.gate")``). Registered
for the one family this example serves; ``fxreplace.models.register_sites`` adds any other."""

from fxreplace.models import decoder_components, register_sites
from fxreplace.targets import Target

MODEL_CODE = "batch"

ROUTER = Target("model.layers.*.mlp.gate")  # the router's logits: the gate's first linear (point "auto")
ROUTING = Target("model.layers.*.mlp.experts", point="routing")  # the top-k weights and ids the experts get

register_sites(MODEL_CODE, "Qwen3MoeForCausalLM", targets=(ROUTER,),
               components=decoder_components(router=ROUTER, routing=ROUTING))
