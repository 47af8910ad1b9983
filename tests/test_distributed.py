"""Shard slicing across real ``torch.distributed`` process groups (gloo, CPU).

A tiny HF Qwen3-MoE runs in three parallel layouts, each process holding one rank:

- sequence parallel: each rank routes and runs the experts on its contiguous
  block of ``T/world`` tokens (rows ``rank*T/world ...`` of the flattened
  ``[B*S]`` tokens), then the outputs are all-gathered in rank order;
- expert parallel: the router is replicated, each rank holds ``E/world``
  contiguous experts and consumes its columns of the dense routing weights (the
  injection point is that ``[T, E/world]`` output, so the replacement logits go
  through ``softmax_topk_renorm`` and are sliced by expert); partial expert
  outputs are summed with an all-reduce;
- data parallel: replicas serve different requests from one reference store on
  disk, each loading it lazily.

Each layout is instrumented with ``Target(..., shard=ShardSpec(mode, world, rank))``
and compared with the single-process HF model given the same replacement
(computed in the parent process). The rank is a Python int (one graph per rank)
or a rank tensor (one SPMD graph: identical graph code on every rank).

Every layout of one world size runs in one process group (process start-up
dominates); the tests below check the collected results. Set
``FXREPLACE_DIST_BACKEND=inductor`` to compile with inductor instead of eager.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fxreplace import ReplacementContext, ShardSpec, Target, instrument
from fxreplace.sharding import ShapeError

ARCH = "Qwen3MoeForCausalLM"
TARGET = "model.layers.*.mlp.gate"
NAMES = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
BATCH, SEQ = 2, 8                 # T = 16 tokens: divisible by 2 and 4
ATOL = 1e-5
TIMEOUT_S = 240                   # per process group, start-up included
COLLECTIVE_TIMEOUT_S = 60
BACKEND = os.environ.get("FXREPLACE_DIST_BACKEND", "eager")
# Layouts also run under torch.compile (compiles dominate the run time: keep few).
COMPILED = {2: {"sequence/int", "sequence/tensor", "expert/tensor"}, 4: {"sequence/tensor"}}


# --------------------------------------------------------------------------- layouts


def _block(x: torch.Tensor, dim: int, world: int, rank) -> torch.Tensor:
    """This rank's contiguous block of ``dim``; a rank tensor keeps the graph rank-free."""
    size = x.shape[dim] // world
    if isinstance(rank, int):
        return x.narrow(dim, rank * size, size)
    return x.index_select(dim, rank * size + torch.arange(size, device=x.device))


def _group():
    return dist.group.WORLD


class SequenceParallelMoe(nn.Module):
    """The HF MoE block on this rank's ``T/world`` tokens, all-gathered after.

    Keeps the block's ``gate`` and ``experts`` (same names, same weights).
    ``uneven=True`` splits with ``tensor_split`` (sizes may differ by one), to show
    how fxreplace reports a token count the world size does not divide."""

    def __init__(self, block, world: int, rank, uneven: bool = False):
        super().__init__()
        self.gate, self.experts = block.gate, block.experts
        self.world, self.rank, self.uneven = world, rank, uneven

    def forward(self, hidden_states):
        import torch.distributed._functional_collectives as funcol

        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        if self.uneven:
            local = torch.tensor_split(x, self.world)[int(self.rank)]
        else:
            local = _block(x, 0, self.world, self.rank)
        _, weights, indices = self.gate(local)
        out = self.experts(local, indices, weights)
        return funcol.all_gather_single(out, 0, _group()).reshape(b, s, h)


class ExpertParallelGate(nn.Module):
    """Replicated router (full ``[T, E]`` logits on every rank, same weight) whose
    output is this rank's columns ``[T, E/world]`` of the dense routing weights."""

    def __init__(self, gate, world: int, rank):
        super().__init__()
        self.weight = gate.weight
        self.top_k, self.norm_topk_prob, self.num_experts = gate.top_k, gate.norm_topk_prob, gate.num_experts
        self.world, self.rank = world, rank

    def forward(self, x):
        logits = F.linear(x, self.weight)
        values, indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
        if self.norm_topk_prob:
            values = values / values.sum(dim=-1, keepdim=True)
        dense = torch.zeros_like(logits).scatter(1, indices, values.to(logits.dtype))
        return _block(dense, 1, self.world, self.rank)


class ExpertParallelMoe(nn.Module):
    """Experts ``rank*E/world ...`` on this rank; partial outputs all-reduced."""

    def __init__(self, block, world: int, rank):
        super().__init__()
        experts = block.experts
        local = experts.num_experts // world
        lo = int(rank) * local
        self.gate = ExpertParallelGate(block.gate, world, rank)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[lo:lo + local].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[lo:lo + local].clone())
        self.act_fn = experts.act_fn

    def forward(self, hidden_states):
        import torch.distributed._functional_collectives as funcol

        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        affinity = self.gate(x)                                             # [T, E/world]
        gate, up = torch.einsum("th,eih->tei", x, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("tei,ehi->teh", self.act_fn(gate) * up, self.down_proj)
        partial = (out * affinity.unsqueeze(-1)).sum(1)
        return funcol.all_reduce(partial, "sum", _group()).reshape(b, s, h)


def _layout(model, kind: str, world: int, rank, **kw):
    for layer in model.model.layers:
        layer.mlp = (SequenceParallelMoe if kind == "sequence" else ExpertParallelMoe)(layer.mlp, world, rank, **kw)
    return model


def _targets(kind: str, world: int, rank) -> list[Target]:
    spec = ShardSpec(kind, world, rank)
    if kind == "expert":
        return [Target(TARGET, point="output", adapter="softmax_topk_renorm", shard=spec)]
    return [Target(TARGET, shard=spec)]


# --------------------------------------------------------------------------- reference data


def _reference(seed_prompts: int = 0):
    """Input ids and forced router logits (every token's least likely expert), as a
    flat dict ``{name: [T, E]}`` in the flattened ``[B*S]`` token order."""
    from fxreplace.models import get_family, tiny_model
    from fxreplace.engines.vllm.testing import capture_router_logits, force_routing

    g = torch.Generator().manual_seed(seed_prompts)
    ids = torch.randint(4, 128, (BATCH, SEQ), generator=g)
    hf = instrument(tiny_model(ARCH), get_family(ARCH).targets)
    per_row = [force_routing(capture_router_logits(hf, hf.targets, row.tolist())) for row in ids]
    forced = {n: torch.cat([r[n] for r in per_row]) for n in NAMES}
    return hf, ids, forced


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss() -> dict:
    """Resident memory of this process in MiB (anonymous, file-backed, total)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


# --------------------------------------------------------------------------- worker


def _compile(model, codes: list):
    """torch.compile with a backend that records each graph's code."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(BACKEND)

    def backend(gm, example_inputs):
        codes.append(gm.code)
        return inner(gm, example_inputs)

    return torch.compile(model, backend=backend)


def _run_layouts(rank: int, world: int, data: dict, out: dict) -> None:
    from fxreplace.models import tiny_model

    ids, forced, mask = data["ids"], data["forced"], data["mask"]
    for kind in ("sequence", "expert"):
        for rank_kind in ("int", "tensor"):
            r = rank if rank_kind == "int" else torch.tensor(rank)
            model = instrument(_layout(tiny_model(ARCH), kind, world, r), _targets(kind, world, r))
            key = f"{kind}/{rank_kind}"
            with torch.no_grad():
                out[key] = model(ids, replacements=forced).logits
                out[key + "/off"] = model(ids).logits
                out[key + "/masked"] = model(ids, replacements=ReplacementContext(forced, mask)).logits
                if key in COMPILED.get(world, ()):
                    torch._dynamo.reset()
                    codes: list = []
                    compiled = _compile(model, codes)
                    out[key + "/compiled"] = compiled(ids, replacements=forced).logits
                    out[key + "/compiled_masked"] = compiled(ids, replacements=ReplacementContext(forced, mask)).logits
                    out[key + "/compiled_off"] = compiled(ids, replacements=ReplacementContext(forced, mask & False)).logits
                    out[key + "/graphs"] = len(codes)
                    gathered = [None] * world
                    dist.all_gather_object(gathered, "\n".join(codes))
                    out[key + "/same_graph_code"] = len(set(gathered)) == 1


def _run_data_parallel(rank: int, world: int, data: dict, out: dict) -> None:
    from fxreplace import TensorReplacer
    from fxreplace.models import tiny_model
    from fxreplace.store import ReferenceStore

    out["rss_start"] = _rss()
    model = instrument(tiny_model(ARCH), [Target(TARGET, shard=ShardSpec("data", world, rank))])
    out["rss_model"] = _rss()
    store = ReferenceStore.load(data["store"])
    out["rss_loaded"] = _rss()
    replacer = TensorReplacer(store, on_unknown="passthrough")
    out["rss_replacer"] = _rss()
    prompt = data["dp_prompts"][rank]           # replica `rank` serves its own request
    replacer.register_request(f"req-{rank}", prompt)
    ctx = replacer.build_context_for_batch([f"req-{rank}"], [len(prompt)], list(range(len(prompt))))
    with torch.no_grad():
        out["dp"] = model(torch.tensor([prompt]), replacements=ctx).logits
    out["dp_mask_any"] = bool(ctx.mask.any())
    out["rss_served"] = _rss()
    replacer.release_request(f"req-{rank}")


def _expect_error(out: dict, key: str, fn) -> None:
    try:
        fn()
    except Exception as exc:  # the test checks type and message
        out[key] = (type(exc).__name__, str(exc))
    else:
        out[key] = None


def _run_errors(rank: int, world: int, data: dict, out: dict) -> None:
    from fxreplace.models import tiny_model

    ids, forced = data["ids"], data["forced"]
    with torch.no_grad():
        # 7 tokens (first row, 7 positions) over 2 or 4 ranks; the layout splits unevenly.
        odd_ids, odd = ids[:1, :7], {n: v[:7] for n, v in forced.items()}
        model = instrument(_layout(tiny_model(ARCH), "sequence", world, rank, uneven=True),
                           _targets("sequence", world, rank))
        _expect_error(out, "err/tokens_not_divisible", lambda: model(odd_ids, replacements=odd))
        # 2*world+1 experts: world does not divide them (the layout floors the split).
        experts = 2 * world + 1
        model = instrument(_layout(tiny_model(ARCH, num_experts=experts), "expert", world, rank),
                           _targets("expert", world, rank))
        bad = {n: torch.randn(BATCH * SEQ, experts) for n in NAMES}
        _expect_error(out, "err/experts_not_divisible", lambda: model(ids, replacements=bad))
        _expect_error(out, "err/rank_out_of_range", lambda: ShardSpec("sequence", world, world))
        r = torch.tensor(rank)  # the spec's rank tensor, later set out of range (the layout keeps its int rank)
        model = instrument(_layout(tiny_model(ARCH), "sequence", world, rank), _targets("sequence", world, r))
        r.fill_(world + 3)
        _expect_error(out, "err/rank_tensor_out_of_range", lambda: model(ids, replacements=forced))
        # Sequence-parallel spec on a model whose router sees all T tokens.
        model = instrument(tiny_model(ARCH), _targets("sequence", world, rank))
        _expect_error(out, "err/sp_spec_not_sharded", lambda: model(ids, replacements=forced))
        # Expert-parallel spec on the replicated router's full [T, E] logits.
        model = instrument(tiny_model(ARCH), [Target(TARGET, shard=ShardSpec("expert", world, rank))])
        _expect_error(out, "err/ep_spec_not_sharded", lambda: model(ids, replacements=forced))
        # Spec world size disagreeing with the layout (SP over `world` ranks, spec says 2x more).
        model = instrument(_layout(tiny_model(ARCH), "sequence", world, rank), _targets("sequence", 2 * world, rank))
        _expect_error(out, "err/world_mismatch", lambda: model(ids, replacements=forced))
        spec = ShardSpec.from_process_group("sequence", rank_as_tensor=True)
        out["from_process_group"] = (spec.world_size, int(spec.rank))


def _worker(rank: int, world: int, port: int, data: dict, result_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    out: dict = {"errors": {}}
    try:
        for name, fn in (("layouts", _run_layouts), ("data", _run_data_parallel), ("errors", _run_errors)):
            start = time.perf_counter()
            try:
                fn(rank, world, data, out)
            except Exception:
                out["errors"][name] = traceback.format_exc()
            out[f"time/{name}"] = time.perf_counter() - start
            dist.barrier()
    finally:
        torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_group(world: int, data: dict, result_dir: str, timeout: float = TIMEOUT_S) -> list[dict]:
    """Start ``world`` processes (spawn, loopback), wait at most ``timeout`` s,
    and return each rank's results. A hang kills the group and fails."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned processes
    ctx = mp.start_processes(_worker, args=(world, _free_port(), data, result_dir), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process group of {world} did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [torch.load(os.path.join(result_dir, f"rank{r}.pt")) for r in range(world)]


# --------------------------------------------------------------------------- parent side


class Reference:
    """Single-process expectations, and the reference store on disk for data parallel."""

    def __init__(self, directory):
        from fxreplace.store import ReferenceStore
        from fxreplace.engines.vllm.testing import capture_router_logits, force_routing

        self.hf, self.ids, self.forced = _reference()
        with torch.no_grad():
            self.full = self.hf(self.ids, replacements=self.forced).logits
            self.off = self.hf(self.ids).logits
        g = torch.Generator().manual_seed(1)
        lengths = [11, 20, 9, 16]
        self.prompts = [torch.randint(4, 128, (n,), generator=g).tolist() for n in lengths]
        captures = {i: force_routing(capture_router_logits(self.hf, NAMES, p)) for i, p in enumerate(self.prompts)}
        # Filler prompts make the store big enough (~32 MiB) for lazy loading to show in RSS.
        filler_len, filler = 2048, 256
        for i in range(len(self.prompts), len(self.prompts) + filler):
            captures[i] = {n: torch.randn(filler_len, 8, generator=g) for n in NAMES}
        # distinct token ids (a store refuses two prompts with the same tokens)
        token_ids = self.prompts + [[3, i // 100 + 4] + [i % 100 + 4] * (filler_len - 2) for i in range(filler)]
        self.store = str(directory / "reference")
        ReferenceStore.from_captures(captures, prompt_token_ids=token_ids).save(self.store)
        self.store_mib = sum(f.stat().st_size for f in (directory / "reference").iterdir()) / 2**20
        self.captures = captures
        self.unknown = torch.randint(4, 128, (13,), generator=g).tolist()
        self._expected_dp = {}

    def mask(self, world: int) -> torch.Tensor:
        """Replacement on the last rank's sequence-parallel block only."""
        t = BATCH * SEQ
        return torch.arange(t) >= t - t // world

    def masked(self, world: int) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(self.ids, replacements=ReplacementContext(self.forced, self.mask(world))).logits

    def dp_prompts(self, world: int) -> list[list[int]]:
        """Replica 0 serves a prompt the store does not hold (replacement off there);
        replica r > 0 serves stored prompt r - 1."""
        return [self.unknown] + self.prompts[: world - 1]

    def expected_dp(self, world: int) -> list[torch.Tensor]:
        out = []
        with torch.no_grad():
            for r, prompt in enumerate(self.dp_prompts(world)):
                ids = torch.tensor([prompt])
                if r == 0:
                    out.append(self.hf(ids).logits)
                else:
                    rep = {n: v[: len(prompt)] for n, v in self.captures[r - 1].items()}
                    out.append(self.hf(ids, replacements=rep).logits)
        return out

    def data(self, world: int) -> dict:
        return {"ids": self.ids, "forced": self.forced, "mask": self.mask(world), "store": self.store,
                "dp_prompts": self.dp_prompts(world)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(tmp_path_factory.mktemp("fxreplace_dist"))


@pytest.fixture(scope="module")
def groups(reference, tmp_path_factory):
    cache = {}

    def get(world):
        if world not in cache:
            directory = tmp_path_factory.mktemp(f"group{world}")
            start = time.perf_counter()
            results = run_group(world, reference.data(world), str(directory))
            for r in results:
                r["time/group"] = time.perf_counter() - start
            cache[world] = results
        return cache[world]

    return get


def _diff(a, b) -> float:
    return (a - b).abs().max().item()


WORLDS = [2, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["sequence", "expert"])
def test_sharded_layouts_match_single_process(reference, groups, world, kind):
    results = groups(world)
    masked = reference.masked(world)
    assert reference.off.sub(reference.full).abs().max() > 0.1  # the forced routing changes the logits
    report = {}
    for rank, res in enumerate(results):
        assert not res["errors"].get("layouts"), res["errors"]["layouts"]
        for rank_kind in ("int", "tensor"):
            key = f"{kind}/{rank_kind}"
            report[(rank, key)] = d = _diff(res[key], reference.full)
            assert d < ATOL, (rank, key, d)
            assert _diff(res[key + "/off"], reference.off) < ATOL, (rank, key)
            assert _diff(res[key + "/masked"], masked) < ATOL, (rank, key)
            if key + "/compiled" in res:
                assert _diff(res[key + "/compiled"], reference.full) < ATOL, (rank, key)
                assert _diff(res[key + "/compiled_masked"], masked) < ATOL, (rank, key)
                assert _diff(res[key + "/compiled_off"], reference.off) < ATOL, (rank, key)
    for rank_kind in ("int", "tensor"):
        key = f"{kind}/{rank_kind}"
        if key + "/graphs" not in results[0]:
            continue
        # One compile per rank serves on, partial mask and off.
        assert {r[key + "/graphs"] for r in results} == {results[0][key + "/graphs"]}
        if rank_kind == "tensor":
            assert all(r[key + "/same_graph_code"] for r in results)  # one SPMD graph for every rank
        else:
            assert not results[0][key + "/same_graph_code"]  # the int rank is baked into each rank's graph
    print(f"\nworld={world} {kind}: max abs diff vs single process {max(report.values()):.2e}")


@pytest.mark.parametrize("world", WORLDS)
def test_sequence_parallel_replacement_on_one_rank_only(reference, groups, world):
    """The mask selects only the last rank's tokens: the other ranks compute their own routing."""
    results = groups(world)
    masked = reference.masked(world)
    assert _diff(masked, reference.full) > 0.1 and _diff(masked, reference.off) > 0.1
    for res in results:
        assert _diff(res["sequence/tensor/masked"], masked) < ATOL


@pytest.mark.parametrize("world", WORLDS)
def test_data_parallel_replicas_share_one_store_on_disk(reference, groups, world):
    results = groups(world)
    expected = reference.expected_dp(world)
    lines = []
    for rank, (res, exp) in enumerate(zip(results, expected)):
        assert not res["errors"].get("data"), res["errors"]["data"]
        assert res["dp_mask_any"] == (rank != 0)  # replica 0's request is unknown: replacement off there only
        d = _diff(res["dp"], exp)
        assert d < ATOL, (rank, d)
        # Loading memory-maps the file: the store does not land in anonymous memory.
        grew = res["rss_served"]["RssAnon"] - res["rss_model"]["RssAnon"]
        assert grew < 0.5 * reference.store_mib, (rank, res["rss_model"], res["rss_served"])
        lines.append(f"rank {rank}: diff {d:.1e}; RSS MiB total/anon/file: " + ", ".join(
            f"{stage} {res['rss_' + stage]['VmRSS']:.0f}/{res['rss_' + stage]['RssAnon']:.0f}/"
            f"{res['rss_' + stage]['RssFile']:.0f}" for stage in ("start", "model", "loaded", "replacer", "served")))
    assert _diff(expected[1], reference.hf(torch.tensor([reference.prompts[0]])).logits.detach()) > 0.1
    print(f"\nworld={world} data parallel, store {reference.store_mib:.1f} MiB on disk\n" + "\n".join(lines))


@pytest.mark.parametrize("world", WORLDS)
def test_misconfiguration_is_a_clear_error(groups, world):
    results = groups(world)
    for rank, res in enumerate(results):
        assert not res["errors"].get("errors"), res["errors"]["errors"]
        err = {k[4:]: v for k, v in res.items() if k.startswith("err/")}
        assert all(v is not None for v in err.values()), err
        t, msg = err["tokens_not_divisible"]
        assert t == "ShapeError" and "7 tokens cannot be split evenly over world_size" in msg, msg
        assert "model.layers.0.mlp.gate" in msg and f"ShardSpec('sequence', world_size={world}, rank={rank})" in msg
        t, msg = err["experts_not_divisible"]
        assert t == "ShapeError" and f"size {2 * world + 1} is not divisible by world_size {world}" in msg, msg
        assert "experts of model.layers.0.mlp.gate" in msg and "ShardSpec('expert'" in msg
        t, msg = err["rank_out_of_range"]
        assert t == "ValueError" and f"rank {world} out of range for world_size {world}" in msg
        t, msg = err["rank_tensor_out_of_range"]
        assert t == "ValueError" and f"rank {world + 3} out of range" in msg
        t, msg = err["sp_spec_not_sharded"]
        assert t == "ShapeError" and "model.layers.0.mlp.gate" in msg, msg
        assert f"({BATCH * SEQ}, 8)" in msg and "its input is not sequence-sharded" in msg, msg
        assert f"ShardSpec('sequence', world_size={world}, rank={rank})" in msg, msg
        t, msg = err["ep_spec_not_sharded"]
        assert t == "ShapeError" and "its output is not expert-sharded" in msg and "ShardSpec('expert'" in msg, msg
        t, msg = err["world_mismatch"]
        assert t == "ShapeError" and f"split of {BATCH * SEQ} tokens gives" in msg, msg
        assert res["from_process_group"] == (world, rank)
    print(f"\nworld={world} errors (rank 0):\n" + "\n".join(
        f"  {k[4:]}: {v[1]}" for k, v in results[0].items() if k.startswith("err/")))
    print("timings (s, rank 0): " + ", ".join(f"{k[5:]} {v:.1f}" for k, v in results[0].items() if k.startswith("time/")))
