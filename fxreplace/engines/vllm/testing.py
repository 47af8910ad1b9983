"""Helpers for tests, demos and benchmarks of the vLLM plugin: tiny checkpoints
vLLM loads offline (a family's tiny HF model plus a local word-level tokenizer,
token ``i`` is the word ``w<i>``), router-logit captures from the HF model, a
forced routing, and HF log-probabilities with forced router logits."""

from __future__ import annotations

import os
from pathlib import Path


def save_tiny_checkpoint(architecture: str, directory: str | os.PathLike, *, seed: int = 0,
                         init_std: float | None = 0.2, **config_overrides) -> Path:
    """Write ``fxreplace.models.tiny_model(architecture)`` (float32) and a
    WordLevel tokenizer to ``directory``; returns it."""
    # test helpers, imported in vLLM's processes: each loads what it uses
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fxreplace.models import tiny_model

    directory = Path(directory)
    model = tiny_model(architecture, seed=seed, init_std=init_std, **config_overrides)
    config = model.config
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    model.save_pretrained(directory)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), config.vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
    ).save_pretrained(directory)
    return directory


def capture_router_logits(model, names, token_ids) -> dict:
    """``{name: Tensor[S, E]}``: what each target of an instrumented HF model
    computes at its injection point over one sequence (the router logits, for the
    families' targets), observed as reference capture does; ``names`` picks the
    capture names to return."""
    import torch  # test helpers, imported in vLLM's processes: each loads what it uses

    from fxreplace.instrument import observe

    captured = {}

    def record(name, computed):
        captured[name] = computed.detach().reshape(-1, computed.shape[-1]).clone()

    with torch.no_grad(), observe(model, record):
        model(torch.tensor([list(token_ids)]))
    return {name: captured[name] for name in names}


def force_routing(logits: dict, bias: float = 15.0) -> dict:
    """Add ``bias`` to each row's least likely expert: a routing the model would never pick."""
    import torch  # test helpers, imported in vLLM's processes: each loads what it uses

    out = {}
    for name, value in logits.items():
        forced = value.clone()
        forced[torch.arange(value.shape[0]), value.argmin(-1)] += bias
        out[name] = forced
    return out


def hf_logprobs(model, token_ids, replacements: dict | None = None):
    """``[S, V]`` float32 log-softmax of an instrumented HF model over one sequence;
    ``replacements`` ``{name: Tensor[>=S, E]}`` forces every position's row."""
    import torch  # test helpers, imported in vLLM's processes: each loads what it uses

    seq = list(token_ids)
    with torch.no_grad():
        if replacements is None:
            logits = model(torch.tensor([seq])).logits[0]
        else:
            logits = model(torch.tensor([seq]), replacements={k: v[: len(seq)] for k, v in replacements.items()}).logits[0]
    return torch.log_softmax(logits.float(), -1)
