"""fxreplace's vllm-neuron runner side, driven by a fake ``NeuronModelRunner`` that prepares
inputs by vllm-neuron's rules (its source, vllm-neuron 0.24.x, read for the rules; no code
copied): one prefill per step, padded to its token bucket by repeating the last position;
decode of 1 or 1 + k tokens per request, padded at the end with position 0 to a batch bucket,
plus data-parallel padding; a step whose speculative tokens the runner drops by editing the
scheduler output; ``execute_dummy_batch``; a graph-capture call through a second compiled
wrapper. The plugin wraps the fake class's ``load_model`` as it wraps vllm-neuron's, and a
tiny model compiled per bucket (``aot_eager``, ``fullgraph=True``; on torch-xla's CPU device
``openxla`` in the compat environment) must read the reference row of every (request,
position), mask False on every padded slot, and build one graph per bucket across warm-up,
off, on, new values and dummy calls. No vLLM needed (but for the names check, which reads vLLM's
scheduler output): the compat environment runs them too."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from fxreplace.context import ReplacementContext
from fxreplace.instrument import instrument
from fxreplace.vllm import neuron_internals, plugin
from fxreplace.vllm.config import ConfigError
from fxreplace.vllm.internals import get_state
from fxreplace.vllm.neuron import NeuronRunner

VOCAB, HIDDEN, EXPERTS, MAX_LEN = 64, 16, 6, 64
TARGETS = ["layers.*.router"]
PREFILL_BUCKETS, BATCH_BUCKETS, DRAFTS = (8, 16), (2, 4), 2


class TinyNeuronModel(nn.Module):
    """A vllm-neuron-style model: flat ``input_ids``/``positions`` of one step, other step inputs
    taken and ignored; a per-token MoE (no attention) so a token's router rows depend only on
    its id and position, whatever else the step holds."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(MAX_LEN, HIDDEN)
        self.layers = nn.ModuleList(nn.ModuleDict({"router": nn.Linear(HIDDEN, EXPERTS, bias=False),
                                                   "experts": nn.Linear(HIDDEN, HIDDEN * EXPERTS)}) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen) * 0.5

    def forward(self, input_ids, positions, sampling_positions=None, rank=None):
        h = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            weights = torch.softmax(layer["router"](h), -1)
            experts = layer["experts"](h).view(-1, EXPERTS, HIDDEN)
            h = h + (weights.unsqueeze(-1) * experts).sum(1)
        return self.head(h)


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
    """``NeuronModelRunner``'s structure and input rules, on a tiny model."""

    def __init__(self, additional_config, device="cpu", backend="aot_eager", speculative=True):
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="tiny")),
                                           additional_config=additional_config)
        self.device = torch.device(device)
        self.backend = backend
        self.max_num_batched_tokens = max(PREFILL_BUCKETS)
        self.max_num_reqs = max(BATCH_BUCKETS)
        self.speculative_config = SimpleNamespace(num_speculative_tokens=DRAFTS) if speculative else None
        self.use_async_scheduling = False
        self._tensor_replacer = None
        self.input_batch = InputBatch()
        self.tokens: dict[str, list[int]] = {}  # request -> its tokens so far (kept after it finishes: the test reads them)
        self.computed: dict[str, int] = {}
        self.prompt_len: dict[str, int] = {}
        self.dp_padding = 0  # requests another data-parallel rank has beyond this one's bucket
        self.drop_drafts = False  # the next step drops its speculative tokens (DI mixed-batch guard)
        self.slots: list = []  # per forward: (request, position) of every slot, None for padding

    def load_model(self):
        module = TinyNeuronModel().to(self.device)
        self.counter = CompileCounterWithBackend(self.backend)
        self.capture_counter = CompileCounterWithBackend(self.backend)
        self.model = torch.compile(module, backend=self.counter, fullgraph=True, dynamic=False)
        self.capture_backend_model = torch.compile(module, backend=self.capture_counter, fullgraph=True, dynamic=False)

    # warm-ups, graph capture, dummy batch: compiled calls outside a step
    def _call(self, compiled, input_ids, positions):
        with torch.no_grad():  # the keywords of a step's call: one graph per bucket serves both
            return compiled(input_ids=input_ids.to(self.device), positions=positions.to(self.device),
                            sampling_positions=None)

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
            self.tokens[new.req_id], self.computed[new.req_id] = list(new.prompt_token_ids), 0
            self.prompt_len[new.req_id] = len(new.prompt_token_ids)
        self.input_batch.req_ids = list(so.num_scheduled_tokens)
        if self.drop_drafts:  # the runner edits the scheduler output before preparing the inputs
            for req_id, drafts in so.scheduled_spec_decode_tokens.items():
                so.num_scheduled_tokens[req_id] -= len(drafts)
                so.num_scheduled_tokens_padded[req_id] -= len(drafts)
                so.total_num_scheduled_tokens -= len(drafts)
            so.scheduled_spec_decode_tokens.clear()
        input_ids, positions, slots = [], [], []
        prefill = any(self.computed[r] < self.prompt_len[r] for r in self.input_batch.req_ids)  # vllm-neuron's test
        for req_id in self.input_batch.req_ids:
            start, count = self.computed[req_id], so.num_scheduled_tokens[req_id]
            seq = self.tokens[req_id]
            seq += [(7 * p + 1) % VOCAB for p in range(len(seq), start + count)]  # sampled tokens and drafts, all kept
            pos = list(range(start, start + count))
            input_ids += seq[start:start + count]
            positions += pos
            slots += [(req_id, p) for p in pos]
            if prefill:  # prefill padding: the last position repeated up to the request's padded count
                pad = so.num_scheduled_tokens_padded[req_id] - count
                input_ids += [0] * pad
                positions += [pos[-1]] * pad
                slots += [None] * pad
        if not prefill:  # decode: trailing position-0 padding to the batch bucket, then data-parallel padding
            tokens_per_req = max(so.num_scheduled_tokens.values())
            batch = smallest(BATCH_BUCKETS, len(self.input_batch.req_ids)) + self.dp_padding
            pad = batch * tokens_per_req - len(positions)
            input_ids += [0] * pad
            positions += [0] * pad
            slots += [None] * pad
        self.slots.append(slots)
        out = self._execute_model_forward(torch.tensor(input_ids), torch.tensor(positions), None, None)
        for req_id in self.input_batch.req_ids:
            self.computed[req_id] += so.num_scheduled_tokens[req_id]
        return out

    def _execute_model_forward(self, input_ids, positions, logits_indices, attn_metadata, spec_decode_metadata=None):
        with torch.no_grad():  # inputs moved to the device here, as vllm-neuron does
            return self.model(input_ids=input_ids.to(self.device), positions=positions.to(self.device),
                              sampling_positions=logits_indices)


# --------------------------------------------------------------------------- the workload

PROMPTS = {"a": [3, 9, 4, 11, 5], "b": [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31], "c": [40, 41, 42]}
KNOWN = ("a", "b")  # "c" is not in the reference: served untouched


def reference():
    """Random rows per known prompt: prompt + 12 generated positions, per target."""
    gen = torch.Generator().manual_seed(5)
    names = [f"layers.{i}.router" for i in range(2)]
    captures = {i: {n: torch.randn(len(PROMPTS[p]) + 12, EXPERTS, generator=gen) * 3 for n in names}
                for i, p in enumerate(KNOWN)}
    return captures, [PROMPTS[p] for p in KNOWN], names


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
    """Records what each compiled call received (after fxreplace's own pre-hook)."""

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
        self.calls.append([{n: ctx[n].detach().cpu().clone() for n in ctx}, ctx.mask.detach().cpu().clone(),
                           {k: kwargs[k].detach().cpu().clone() for k in ("input_ids", "positions")}])

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


def expected(slots, captures, names):
    """The context an exact engine reads: each slot's reference row where its request is known
    and the row stored, else off."""
    rows = {n: torch.zeros(len(slots), EXPERTS) for n in names}
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


def run_and_check(wrapped_runner_class, device="cpu", backend="aot_eager", sync=lambda: None):
    with torch._dynamo.config.patch(recompile_limit=64):  # vllm-neuron lifts Dynamo's limit: a graph per bucket
        return _run_and_check(wrapped_runner_class, device, backend, sync)


def _run_and_check(wrapped_runner_class, device, backend, sync):
    torch._dynamo.reset()
    captures, token_ids, names = reference()
    runner = wrapped_runner_class({"fxreplace": {"tensors": captures, "prompt_token_ids": token_ids,
                                                 "targets": TARGETS}}, device=device, backend=backend)
    runner.load_model()
    state = get_state(runner)
    assert state is not None and runner.model._orig_mod is state.model  # the compiled module's original, instrumented
    spy = Spy(runner.model)
    warm = drive(runner, spy)
    sync()
    buckets = len(PREFILL_BUCKETS) + 2 * len(BATCH_BUCKETS)
    assert warm == (buckets, 1), warm
    assert (runner.counter.frame_count, runner.capture_counter.frame_count) == (buckets, 1)  # nothing recompiled
    assert state.errors == 0 and state.steps > 0

    eager = instrument(TinyNeuronModel().to(device), TARGETS)
    eager.load_state_dict(state.model.state_dict(), strict=False)
    step_calls = [c for i, c in enumerate(spy.calls) if i != spy.dummy]
    assert len(step_calls) == len(runner.slots)
    for (rows, mask, inputs, got), slots in zip(step_calls, runner.slots):
        want = expected(slots, captures, names)
        assert torch.equal(mask, want.mask), (slots, mask)
        for n in names:
            torch.testing.assert_close(rows[n][mask], want[n][want.mask])
        # what the compiled model computed with it equals the eager model given the exact context
        with torch.no_grad():
            oracle = eager(inputs["input_ids"].to(device), inputs["positions"].to(device),
                           replacements=ReplacementContext({n: want[n].to(device) for n in names},
                                                           want.mask.to(device)))
        torch.testing.assert_close(got, oracle.cpu(), rtol=1e-5, atol=1e-5)
    # the dummy batch (and every warm-up) ran with replacement off
    rows, mask, _, _ = spy.calls[spy.dummy]
    assert not mask.any()
    assert not any(s is not None and s[0] == "c" for s in runner.slots[-1])  # c was released
    assert set(state.requests) == {"a", "b"}
    return runner, state


@pytest.mark.compat
def test_fake_neuron_runner_right_rows_padding_off_one_graph_per_bucket(wrapped_runner_class):
    runner, state = run_and_check(wrapped_runner_class)
    # every kind of padding occurred: a prefill's (its bucket), a decode batch's, data-parallel padding
    assert [len(s) for s in runner.slots] == [8, 16, 8, 4, 12, 4, 4, 6]
    assert state.tokens_replaced == sum(1 for slots in runner.slots for s in slots if s and s[0] in KNOWN)


@pytest.mark.compat
def test_fake_neuron_runner_capture_records_the_rows_of_the_eager_model(wrapped_runner_class, tmp_path):
    """Capture through the same protocol: every (request, position) the steps computed is stored
    with the row the eager model computes over that request's whole sequence; padding never is."""
    from fxreplace.instrument import observe
    from fxreplace.store import ReferenceStore

    torch._dynamo.reset()
    runner = wrapped_runner_class({"fxreplace": {"capture": {"out": str(tmp_path / "ref"), "targets": TARGETS}}})
    with torch._dynamo.config.patch(recompile_limit=64):
        runner.load_model()
        state = get_state(runner)
        drive(runner, Spy(runner.model))
    state.close()
    store = ReferenceStore.load(tmp_path / "ref")
    eager = TinyNeuronModel()
    eager.load_state_dict(state.model.state_dict(), strict=False)
    eager = instrument(eager, TARGETS)
    assert sorted(map(tuple, store.prompt_token_ids)) == sorted(tuple(p) for p in PROMPTS.values())
    for p in store.prompt_ids:
        i = store.internal_index(p)
        req_id = next(r for r, prompt in PROMPTS.items() if list(store.prompt_token_ids[i]) == prompt)
        tokens = runner.tokens[req_id][:runner.computed[req_id]]
        seen = {}
        with torch.no_grad(), observe(eager, lambda name, value: seen.__setitem__(name, value.clone())):
            eager(torch.tensor(tokens), torch.arange(len(tokens)))
        assert int(store.lengths[i]) == len(tokens)
        for name in store.capture_names:
            torch.testing.assert_close(store.rows(p, name), seen[name], rtol=1e-5, atol=1e-5)


@pytest.mark.compat
def test_shared_key_and_async_speculation_refused_with_the_fix(monkeypatch):
    captures, token_ids, _ = reference()
    config = {"tensors": captures, "prompt_token_ids": token_ids, "targets": TARGETS}
    monkeypatch.setattr(neuron_internals, "on_neuron", lambda: True)
    with pytest.raises(ConfigError, match=r"additional_config\['fxreplace'\]"):
        plugin._refuse_shared_key_on_neuron({"neuron_config": {"tensor_replacement": config}})
    plugin._refuse_shared_key_on_neuron({"fxreplace": config})  # the fxreplace key is fxreplace's only key there
    runner = FakeNeuronRunner({"fxreplace": config})
    runner.load_model()
    runner.use_async_scheduling = True
    with pytest.raises(ConfigError, match="no-async-scheduling"):
        NeuronRunner(runner)
    runner.use_async_scheduling, runner._tensor_replacer = False, object()
    with pytest.raises(ConfigError, match="own tensor replacer"):
        NeuronRunner(runner)


@pytest.mark.xla
def test_fake_neuron_runner_on_torch_xla(wrapped_runner_class):
    """The same workload on torch-xla's CPU device through the ``openxla`` backend (lazy tensors
    traced to HLO, as torch-neuronx does): the same rows, and one Dynamo graph per bucket."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    run_and_check(wrapped_runner_class, device=torch_xla.device(), backend="openxla", sync=torch_xla.sync)


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
