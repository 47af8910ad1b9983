"""fxreplace's vllm-neuron runner side, driven by a fake ``NeuronModelRunner`` that prepares
inputs by vllm-neuron's rules (its source, vllm-neuron 0.24.x, read for the rules; no code
copied): one prefill per step, padded to its token bucket by repeating the last position;
decode of 1 or 1 + k tokens per request, padded at the end with position 0 to a batch bucket,
plus data-parallel padding; a step whose speculative tokens the runner drops by editing the
scheduler output; ``execute_dummy_batch``; a graph-capture call through a second compiled
wrapper. The plugin wraps the fake class's ``load_model`` as it wraps vllm-neuron's.

The model it serves is a tiny HF Qwen3-MoE (transformers, built from its config, random
weights) converted into NxD's MoE layout (``fxreplace.models.nxd``, as NxDI and vllm-neuron
load HF checkpoints into their own modules) behind vllm-neuron's model interface: flat
``input_ids``/``positions`` of every request of the step and a KV cache addressed by slot
(:class:`FlatQwen3Moe`). It is compiled per bucket (``aot_eager``, ``fullgraph=True``; on
torch-xla's CPU device ``openxla`` in the compat environment). The reference is the HF
model's own, from :func:`fxreplace.capture.capture_reference`, and the targets are the ones
the Qwen3-MoE family registers for vllm-neuron (nobody names them). Checked: the reference
row of every (request, position), mask False on every padded slot, the HF logits at every
real slot of a known request although the served routers carry a fault, one graph per bucket
across warm-up, off, on, new values and dummy calls; capture through the same protocol stores
the HF capture's rows. No vLLM needed (but for the names check, which reads vLLM's scheduler
output): the compat environment runs them too."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from fxreplace.capture import capture_reference
from fxreplace.context import ReplacementContext
from fxreplace.models import get_family, tiny_model
from fxreplace.models.nxd import NeuronConfig, NxDQwen3MoeModel, _rotate_half
from fxreplace.engines.vllm import plugin
from fxreplace.engines.vllm.neuron import internals as neuron_internals
from fxreplace.engines.vllm.config import ConfigError
from fxreplace.engines.vllm.internals import get_state
from fxreplace.engines.vllm.neuron import NeuronRunner

HF_ARCH = "Qwen3MoeForCausalLM"
PREFILL_BUCKETS, BATCH_BUCKETS, DRAFTS = (8, 16), (2, 4), 2
LINES, MAX_LEN = 3, 32  # KV cache lines (one per request) and positions per line; line LINES takes padding
SCRATCH = LINES * MAX_LEN  # the first slot of the padding line
ROUTER_FAULT = 0.1  # added (times a random matrix) to every served router's weight


def paged_attention(attn, hidden, positions, slot_mapping):
    """Qwen3 attention of flat tokens over the NxD attention module's KV cache, addressed the
    way vLLM's paged caches are: token ``t`` writes its key and value at slot
    ``slot_mapping[t]`` (line ``slot // MAX_LEN``, position ``slot % MAX_LEN``) and attends to
    its line's positions up to its own."""
    tokens = hidden.shape[0]
    q = attn.q_layernorm(attn.q_proj(hidden).view(tokens, attn.heads, attn.head_dim))
    k = attn.k_layernorm(attn.k_proj(hidden).view(tokens, attn.kv_heads, attn.head_dim))
    v = attn.v_proj(hidden).view(tokens, attn.kv_heads, attn.head_dim)
    angles = positions[:, None, None].float() * attn.inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    line, position = slot_mapping // MAX_LEN, slot_mapping % MAX_LEN
    attn.k_cache[line, :, position] = k  # the cache: [lines, kv heads, positions, head dim]
    attn.v_cache[line, :, position] = v
    keys = attn.k_cache.permute(0, 2, 1, 3).reshape(-1, attn.kv_heads, attn.head_dim)  # slot order
    values = attn.v_cache.permute(0, 2, 1, 3).reshape(-1, attn.kv_heads, attn.head_dim)
    groups = attn.heads // attn.kv_heads
    keys, values = keys.repeat_interleave(groups, dim=1).transpose(0, 1), values.repeat_interleave(groups, dim=1).transpose(0, 1)
    slots = torch.arange(keys.shape[1], device=hidden.device)
    visible = (slots // MAX_LEN == line[:, None]) & (slots % MAX_LEN <= position[:, None])
    scores = (q.transpose(0, 1) @ keys.transpose(-1, -2)) * attn.head_dim ** -0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return attn.o_proj((probs @ values).transpose(0, 1).reshape(tokens, -1))


class FlatQwen3Moe(nn.Module):
    """vllm-neuron's model interface (``forward(input_ids, positions, ...)`` over the flat tokens
    of a step) around NxD's Qwen3-MoE modules converted from an HF model: its module names
    are NxD's (``layers.N.mlp.router``), so the family's registered targets resolve."""

    def __init__(self, hf_model):
        super().__init__()
        nxd = NxDQwen3MoeModel.from_hf(hf_model, NeuronConfig(batch_size=LINES + 1, buckets=(MAX_LEN,),
                                                              module_markers=False))
        self.embed_tokens, self.layers, self.norm, self.lm_head = nxd.embed_tokens, nxd.layers, nxd.norm, nxd.lm_head

    def forward(self, input_ids, positions, slot_mapping, sampling_positions=None):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = hidden + paged_attention(layer.self_attn, layer.input_layernorm(hidden), positions, slot_mapping)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden)[None])[0][0]
        return self.lm_head(self.norm(hidden))


def served_model(hf_model, router_fault=0.0):
    model = FlatQwen3Moe(hf_model)
    generator = torch.Generator().manual_seed(1)
    for layer in model.layers:
        weight = layer.mlp.router.linear_router.weight
        weight.data += router_fault * torch.randn(weight.shape, generator=generator)
    return model


@dataclass
class NewRequest:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: object = field(default_factory=lambda: SimpleNamespace(max_tokens=16))


@dataclass
class SchedulerOutput:
    """The fields vLLM's scheduler output and vllm-neuron's scheduler give a step."""

    scheduled_new_reqs: list = field(default_factory=list)
    finished_req_ids: set = field(default_factory=set)
    num_scheduled_tokens: dict = field(default_factory=dict)
    num_scheduled_tokens_padded: dict = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict = field(default_factory=dict)


class InputBatch:
    def __init__(self):
        self.req_ids: list[str] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def smallest(buckets, n):
    return min(b for b in buckets if b >= n)


class FakeNeuronRunner:
    """``NeuronModelRunner``'s structure and input rules, on the model ``build()`` returns.
    ``sequences``: each request's tokens, prompt first (the sampled tokens and drafts the fake
    scheduler feeds back)."""

    def __init__(self, additional_config, build, hf_config, sequences, device="cpu", backend="aot_eager",
                 speculative=True):
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config),
                                           additional_config=additional_config)
        self.build, self.sequences = build, sequences
        self.device = torch.device(device)
        self.backend = backend
        self.max_num_batched_tokens = max(PREFILL_BUCKETS)
        self.max_num_reqs = max(BATCH_BUCKETS)
        self.speculative_config = SimpleNamespace(num_speculative_tokens=DRAFTS) if speculative else None
        self.use_async_scheduling = False
        self._tensor_replacer = None
        self.input_batch = InputBatch()
        self.lines: dict[str, int] = {}  # request -> its KV cache line (kept after it finishes: the test reads them)
        self.computed: dict[str, int] = {}
        self.prompt_len: dict[str, int] = {}
        self.dp_padding = 0  # requests another data-parallel rank has beyond this one's bucket
        self.drop_drafts = False  # the next step drops its speculative tokens (DI mixed-batch guard)
        self.slots: list = []  # per forward: (request, position) of every slot, None for padding

    def load_model(self):
        module = self.build().to(self.device)
        self.counter = CompileCounterWithBackend(self.backend)
        self.capture_counter = CompileCounterWithBackend(self.backend)
        self.model = torch.compile(module, backend=self.counter, fullgraph=True, dynamic=False)
        self.capture_backend_model = torch.compile(module, backend=self.capture_counter, fullgraph=True, dynamic=False)

    # warm-ups, graph capture, dummy batch: compiled calls outside a step, their KV writes on the padding line
    def _call(self, compiled, input_ids, positions):
        with torch.no_grad():  # the keywords of a step's call: one graph per bucket serves both
            return compiled(input_ids=input_ids.to(self.device), positions=positions.to(self.device),
                            slot_mapping=(SCRATCH + positions).to(self.device), sampling_positions=None)

    def warmup_prefill(self, bucket):
        self._call(self.model, torch.arange(1, bucket + 1), torch.arange(bucket))

    def warmup_decode(self, batch, tokens_per_req):
        n = batch * tokens_per_req
        self._call(self.model, torch.ones(n, dtype=torch.long), torch.full((n,), 7))

    def extract_prefill_graphs(self, bucket):
        self._call(self.capture_backend_model, torch.arange(1, bucket + 1), torch.arange(bucket))

    def execute_dummy_batch(self):
        batch = min(BATCH_BUCKETS)
        return self._call(self.model, torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long))

    def execute_model(self, so: SchedulerOutput):
        for new in so.scheduled_new_reqs:
            self.lines[new.req_id], self.computed[new.req_id] = len(self.lines), 0
            self.prompt_len[new.req_id] = len(new.prompt_token_ids)
        self.input_batch.req_ids = list(so.num_scheduled_tokens)
        if self.drop_drafts:  # the runner edits the scheduler output before preparing the inputs
            for req_id, drafts in so.scheduled_spec_decode_tokens.items():
                so.num_scheduled_tokens[req_id] -= len(drafts)
                so.num_scheduled_tokens_padded[req_id] -= len(drafts)
                so.total_num_scheduled_tokens -= len(drafts)
            so.scheduled_spec_decode_tokens.clear()
        input_ids, positions, cache_slots, slots = [], [], [], []
        prefill = any(self.computed[r] < self.prompt_len[r] for r in self.input_batch.req_ids)  # vllm-neuron's test
        for req_id in self.input_batch.req_ids:
            start, count = self.computed[req_id], so.num_scheduled_tokens[req_id]
            pos = list(range(start, start + count))
            input_ids += self.sequences[req_id][start:start + count]
            positions += pos
            cache_slots += [self.lines[req_id] * MAX_LEN + p for p in pos]
            slots += [(req_id, p) for p in pos]
            if prefill:  # prefill padding: the last position repeated up to the request's padded count
                pad = so.num_scheduled_tokens_padded[req_id] - count
                input_ids += [0] * pad
                positions += [pos[-1]] * pad
                cache_slots += [SCRATCH + pos[-1]] * pad
                slots += [None] * pad
        if not prefill:  # decode: trailing position-0 padding to the batch bucket, then data-parallel padding
            tokens_per_req = max(so.num_scheduled_tokens.values())
            batch = smallest(BATCH_BUCKETS, len(self.input_batch.req_ids)) + self.dp_padding
            pad = batch * tokens_per_req - len(positions)
            input_ids += [0] * pad
            positions += [0] * pad
            cache_slots += [SCRATCH] * pad
            slots += [None] * pad
        self.slots.append(slots)
        attn_metadata = {"slot_mapping": torch.tensor(cache_slots)}
        out = self._execute_model_forward(torch.tensor(input_ids), torch.tensor(positions), None, attn_metadata)
        for req_id in self.input_batch.req_ids:
            self.computed[req_id] += so.num_scheduled_tokens[req_id]
        return out

    def _execute_model_forward(self, input_ids, positions, logits_indices, attn_metadata, spec_decode_metadata=None):
        with torch.no_grad():  # inputs moved to the device here, as vllm-neuron does
            return self.model(input_ids=input_ids.to(self.device), positions=positions.to(self.device),
                              slot_mapping=attn_metadata["slot_mapping"].to(self.device),
                              sampling_positions=logits_indices)


# --------------------------------------------------------------------------- the workload

PROMPTS = {"a": [3, 9, 4, 11, 5], "b": [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31], "c": [40, 41, 42]}
KNOWN = ("a", "b")  # "c" is not in the replacement reference: served untouched
NEW_TOKENS = 12  # the HF reference's generation: prompt + 11 positions per prompt, more than the steps reach


@pytest.fixture(scope="module")
def hf():
    model = tiny_model(HF_ARCH)
    model.config.architectures = [HF_ARCH]  # as in a checkpoint's config.json: the family's key
    return model


@pytest.fixture(scope="module")
def hf_reference(hf):
    """The HF model's own capture of every prompt, with the family's HF targets."""
    return capture_reference(hf, list(PROMPTS.values()), get_family(HF_ARCH).targets, max_new_tokens=NEW_TOKENS,
                             progress=False)


def sequences(reference):
    """Each request's tokens: its prompt, then the HF model's greedy tokens (teacher forcing)."""
    return {r: PROMPTS[r] + reference.tokens(i) for i, r in enumerate(PROMPTS)}


def known_captures(reference):
    """The replacement reference: the HF rows of the known prompts only (flat, per prompt)."""
    store = reference.store
    return {KNOWN.index(r): {n: store.rows(list(PROMPTS).index(r), n) for n in store.capture_names} for r in KNOWN}


def prefill_step(req_id):
    n = len(PROMPTS[req_id])
    return SchedulerOutput([NewRequest(req_id, PROMPTS[req_id])], set(), {req_id: n},
                           {req_id: smallest(PREFILL_BUCKETS, n)}, n)


def decode_step(req_ids, drafts=0, finished=()):
    counts = {r: 1 + drafts for r in req_ids}
    return SchedulerOutput([], set(finished), counts, dict(counts), sum(counts.values()),
                           {r: [1] * drafts for r in req_ids} if drafts else {})


def drive(runner, spy):
    """Warm-up and graph capture, then steps of every layout, a dummy batch between them."""
    for bucket in PREFILL_BUCKETS:
        runner.warmup_prefill(bucket)
    for batch in BATCH_BUCKETS:
        for tokens_per_req in (1, 1 + DRAFTS):
            runner.warmup_decode(batch, tokens_per_req)
    runner.extract_prefill_graphs(min(PREFILL_BUCKETS))
    warm = (runner.counter.frame_count, runner.capture_counter.frame_count)
    spy.clear()
    runner.execute_model(prefill_step("a"))  # 5 tokens in bucket 8
    runner.execute_model(prefill_step("b"))  # 11 in 16
    runner.execute_model(prefill_step("c"))  # unknown prompt, 3 in 8
    runner.execute_model(decode_step(["a", "b", "c"]))  # 3 in batch bucket 4: one trailing padding slot
    runner.execute_model(decode_step(["a", "b", "c"], drafts=DRAFTS))  # 1 + k each: 9 tokens in 12 slots
    runner.drop_drafts = True
    runner.execute_model(decode_step(["a", "b", "c"], drafts=DRAFTS))  # drafts dropped by the runner: 1 each
    runner.drop_drafts = False
    spy.dummy = len(spy)
    runner.execute_dummy_batch()
    runner.dp_padding = 2
    runner.execute_model(decode_step(["a", "b"], finished=["c"]))  # bucket 2 + 2 data-parallel padding requests
    runner.dp_padding = 0
    runner.execute_model(decode_step(["a", "b"], drafts=DRAFTS))  # new positions, new values: the same graph
    return warm


class Spy:
    """Records what each compiled call received (after fxreplace's own pre-hook) and returned."""

    def __init__(self, compiled):
        self.calls = []
        self.dummy = None
        compiled.register_forward_pre_hook(self, with_kwargs=True)
        compiled.register_forward_hook(
            lambda module, args, kwargs, output: self.calls[-1].append(output.detach().cpu()) if "replacements" in kwargs
            else None, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ctx = kwargs.get("replacements")
        if ctx is None:  # capture: nothing fed
            return
        self.calls.append([{n: ctx[n].detach().cpu().clone() for n in ctx}, ctx.mask.detach().cpu().clone()])

    def clear(self):
        self.calls.clear()

    def __len__(self):
        return len(self.calls)


@pytest.fixture
def wrapped_runner_class():
    """The fake class with ``load_model`` wrapped by the plugin exactly as vllm-neuron's class is."""
    cls = type("FakeNeuronRunner", (FakeNeuronRunner,), {"load_model": FakeNeuronRunner.load_model})
    plugin._wrap(cls, "load_model", plugin._load_model(NeuronRunner))
    return cls


def expected(slots, captures, names, width):
    """The context an exact engine reads: each slot's reference row where its request is known
    and the row stored, else off."""
    rows = {n: torch.zeros(len(slots), width) for n in names}
    mask = torch.zeros(len(slots), dtype=torch.bool)
    for s, owner in enumerate(slots):
        if owner is None or owner[0] not in KNOWN:
            continue
        req_id, position = owner
        stored = captures[KNOWN.index(req_id)]
        if position < stored[names[0]].shape[0]:
            mask[s] = True
            for n in names:
                rows[n][s] = stored[n][position]
    return ReplacementContext(rows, mask)


def logit_errors(runner, step_calls, reference):
    """Per request, the largest |logits - HF logits| over the slots whose next token the HF
    reference generated (positions from the prompt's last on)."""
    worst = {}
    for (_, _, got), slots in zip(step_calls, runner.slots):
        for s, owner in enumerate(slots):
            if owner is None:
                continue
            req_id, position = owner
            step = position - (len(PROMPTS[req_id]) - 1)
            if step >= 0:
                want = reference.logits(list(PROMPTS).index(req_id))[step]
                worst[req_id] = max(worst.get(req_id, 0.0), (got[s] - want).abs().max().item())
    return worst


def run_and_check(wrapped_runner_class, hf, hf_reference, device="cpu", backend="aot_eager", sync=lambda: None):
    with torch._dynamo.config.patch(recompile_limit=64):  # vllm-neuron lifts Dynamo's limit: a graph per bucket
        return _run_and_check(wrapped_runner_class, hf, hf_reference, device, backend, sync)


def _run_and_check(wrapped_runner_class, hf, hf_reference, device, backend, sync):
    torch._dynamo.reset()
    captures = known_captures(hf_reference)
    names = hf_reference.store.capture_names
    runner = wrapped_runner_class(
        {"fxreplace": {"tensors": captures, "prompt_token_ids": [PROMPTS[r] for r in KNOWN]}},  # no targets named
        lambda: served_model(hf, ROUTER_FAULT), hf.config, sequences(hf_reference), device=device, backend=backend)
    runner.load_model()
    state = get_state(runner)
    assert state is not None and runner.model._orig_mod is state.model  # the compiled module's original, instrumented
    assert state.model.targets == ["layers.0.mlp.router", "layers.1.mlp.router"]  # the family's vllm-neuron targets
    spy = Spy(runner.model)
    warm = drive(runner, spy)
    sync()
    buckets = len(PREFILL_BUCKETS) + 2 * len(BATCH_BUCKETS)
    assert warm == (buckets, 1), warm
    assert (runner.counter.frame_count, runner.capture_counter.frame_count) == (buckets, 1)  # nothing recompiled
    assert state.errors == 0 and state.steps > 0

    step_calls = [c for i, c in enumerate(spy.calls) if i != spy.dummy]
    assert len(step_calls) == len(runner.slots)
    width = hf.config.num_experts
    for (rows, mask, _), slots in zip(step_calls, runner.slots):
        want = expected(slots, captures, names, width)
        assert torch.equal(mask, want.mask), (slots, mask)
        for n in names:
            torch.testing.assert_close(rows[n][mask], want[n][want.mask])
    # the served routers are off by a fault: the known requests read HF's router logits and give HF's
    # logits; the unknown one is served as it is and drifts
    worst = logit_errors(runner, step_calls, hf_reference)
    assert max(worst["a"], worst["b"]) < 1e-4 and worst["c"] > 0.05, worst
    # the dummy batch (and every warm-up) ran with replacement off
    assert not spy.calls[spy.dummy][1].any()
    assert not any(s is not None and s[0] == "c" for s in runner.slots[-1])  # c was released
    assert set(state.requests) == {"a", "b"}
    return runner, state


@pytest.mark.compat
def test_fake_neuron_runner_right_rows_padding_off_one_graph_per_bucket(wrapped_runner_class, hf, hf_reference):
    runner, state = run_and_check(wrapped_runner_class, hf, hf_reference)
    # every kind of padding occurred: a prefill's (its bucket), a decode batch's, data-parallel padding
    assert [len(s) for s in runner.slots] == [8, 16, 8, 4, 12, 4, 4, 6]
    assert state.tokens_replaced == sum(1 for slots in runner.slots for s in slots if s and s[0] in KNOWN)


@pytest.mark.compat
def test_fake_neuron_runner_capture_records_the_hf_rows(wrapped_runner_class, hf, hf_reference, tmp_path):
    """Capture through the same protocol, with the family's registered targets: every (request,
    position) the steps computed is stored with the row HF's own capture holds; padding never is."""
    from fxreplace.store import ReferenceStore

    torch._dynamo.reset()
    runner = wrapped_runner_class({"fxreplace": {"capture": {"out": str(tmp_path / "ref")}}},
                                  lambda: served_model(hf), hf.config, sequences(hf_reference))
    with torch._dynamo.config.patch(recompile_limit=64):
        runner.load_model()
        state = get_state(runner)
        drive(runner, Spy(runner.model))
    state.close()
    store = ReferenceStore.load(tmp_path / "ref")
    hf_store = hf_reference.store
    assert sorted(store.capture_names) == sorted(hf_store.capture_names)
    assert sorted(map(tuple, store.prompt_token_ids)) == sorted(tuple(p) for p in PROMPTS.values())
    for p in store.prompt_ids:
        prompt = list(store.prompt_token_ids[store.internal_index(p)])
        req_id = next(r for r, tokens in PROMPTS.items() if tokens == prompt)
        computed = runner.computed[req_id]
        assert int(store.lengths[store.internal_index(p)]) == computed
        for name in store.capture_names:
            torch.testing.assert_close(store.rows(p, name), hf_store.rows(list(PROMPTS).index(req_id), name)[:computed],
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.compat
def test_shared_key_and_async_speculation_refused_with_the_fix(monkeypatch, hf, hf_reference):
    config = {"tensors": known_captures(hf_reference), "prompt_token_ids": [PROMPTS[r] for r in KNOWN]}
    monkeypatch.setattr(neuron_internals, "on_neuron", lambda: True)
    with pytest.raises(ConfigError, match=r"additional_config\['fxreplace'\]"):
        plugin._refuse_shared_key_on_neuron({"neuron_config": {"tensor_replacement": config}})
    plugin._refuse_shared_key_on_neuron({"fxreplace": config})  # the fxreplace key is fxreplace's only key there
    runner = FakeNeuronRunner({"fxreplace": config}, lambda: served_model(hf), hf.config, sequences(hf_reference))
    runner.load_model()
    runner.use_async_scheduling = True
    with pytest.raises(ConfigError, match="no-async-scheduling"):
        NeuronRunner(runner)
    runner.use_async_scheduling, runner._tensor_replacer = False, object()
    with pytest.raises(ConfigError, match="own tensor replacer"):
        NeuronRunner(runner)


@pytest.mark.xla
def test_fake_neuron_runner_on_torch_xla(wrapped_runner_class, hf, hf_reference):
    """The same workload on torch-xla's CPU device through the ``openxla`` backend (lazy tensors
    traced to HLO, as torch-neuronx does): the same rows and HF logits, one Dynamo graph per bucket."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    run_and_check(wrapped_runner_class, hf, hf_reference, device=torch_xla.device(), backend="openxla",
                  sync=torch_xla.sync)


def test_the_fake_runner_provides_every_vllm_neuron_name_fxreplace_reads(monkeypatch):
    """``neuron_internals.check()`` against the fake (vllm-neuron itself is not installed here):
    only the scheduler module, which the fake does not model, is reported; a renamed runner
    method is reported by name."""
    monkeypatch.setattr(neuron_internals, "NEURON_MODEL_RUNNER", (__name__, "FakeNeuronRunner"))
    monkeypatch.setattr(neuron_internals, "NEURON_SCHEDULER", (__name__, "NoSuchScheduler"))
    scheduler_gone = f"{__name__}.NoSuchScheduler is gone (module '{__name__}' has no attribute 'NoSuchScheduler')"
    assert neuron_internals.check() == [scheduler_gone]
    monkeypatch.delattr(FakeNeuronRunner, "_execute_model_forward")
    assert neuron_internals.check() == ["FakeNeuronRunner has no '_execute_model_forward'", scheduler_gone]
