import importlib
import os
import pkgutil
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# What also runs in the compat environment (torch 2.9, transformers 4.57, torch-xla): whole
# modules (the core on the HF-independent family, store, replacer) and single tests on HF
# models that hold on transformers 4.x too (eager: 4.x MoE experts have data-dependent
# shapes, so the one-graph compile and export tests are main-only). Tests elsewhere can
# carry @pytest.mark.compat themselves; tests/test_xla.py carries the xla marker.
COMPAT_MODULES = {
    "test_config.py", "test_gather.py", "test_host_guards.py", "test_matching.py", "test_neuron_moe.py",
    "test_replacer.py", "test_store.py", "test_targets.py", "test_torch_only.py",
}
COMPAT_TESTS = {
    "test_instrument.py::test_targets_and_model_identity",
    "test_instrument.py::test_replacement_equals_independent_override",
    "test_instrument.py::test_off_and_plain_equal_the_plain_model",
    "test_instrument.py::test_dict_replaces_all_rows_and_missing_names_stay_off",
    "test_instrument.py::test_load_state_dict_updates_what_forward_uses",
    "test_instrument.py::test_shape_mismatch_names_module_and_shapes",
    "test_instrument.py::test_a_forward_that_skips_the_router_is_an_error",
    "test_instrument.py::test_feed_needs_max_tokens",
    "test_passes.py::test_module_paths_normalise_dynamo_and_export_spellings",
    "test_passes.py::test_adapter_registry",
    "test_passes.py::test_sequence_and_expert_parallel_slices",
    "test_passes.py::test_sequence_parallel_mask_and_tensor_rank_under_compile",
    "test_passes.py::test_sharding_errors",
    "test_passes.py::test_pair_points_are_replaced_elementwise_and_refuse_expert_sharding",
}


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        test = f"{item.path.name}::{item.originalname}"
        if item.path.name in COMPAT_MODULES or test in COMPAT_TESTS:
            item.add_marker(pytest.mark.compat)


@pytest.fixture(autouse=True)
def no_leaked_dispatch_exclusion(request):
    """A test must not leave torch's dispatch keys excluded (a ``no_dispatch()`` never exited
    excludes Python, PythonTLSSnapshot and PreDispatch): every later compile or export in that
    process would fail on its fake tensors, far from the cause (seen in CI, 12 compile tests of
    one xdist worker). The test that leaves them fails here, named, and each key is put back
    as it was, so the tests after it run as they would have."""
    torch = sys.modules.get("torch")  # (tests that never import torch stay without it)
    before = torch._C._dispatch_tls_local_exclude_set() if torch is not None else None
    yield
    if before is None:
        return
    after = torch._C._dispatch_tls_local_exclude_set()
    changed = [key for key in torch._C.DispatchKey.__members__.values() if after.has(key) != before.has(key)]
    for key in changed:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, before.has(key))
    if changed:
        left = ", ".join(f"{key.name} {'excluded' if after.has(key) else 'no longer excluded'}" for key in changed)
        pytest.fail(f"{request.node.nodeid} left torch's dispatch keys changed: {left} (a no_dispatch() not exited)")


_CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT")


def pytest_configure(config):
    """Compile caches (inductor's, vLLM's) live in a folder of this run, removed at its end: a
    run reads no stale cache of an earlier one and leaves no GBs behind (the README's test
    command installs the compat environment on the same disk right after the main suite).
    A variable the user set is kept. xdist workers inherit the controller's environment."""
    if hasattr(config, "workerinput"):
        return
    unset = [name for name in _CACHE_VARIABLES if name not in os.environ]
    if unset:
        config._fxreplace_caches = tempfile.mkdtemp(prefix="fxreplace-test-caches-")
        for name in unset:
            os.environ[name] = os.path.join(config._fxreplace_caches, name.lower())


def pytest_unconfigure(config):
    caches = getattr(config, "_fxreplace_caches", None)
    if caches:
        shutil.rmtree(caches, ignore_errors=True)


def forbid_model_loads(monkeypatch) -> None:
    """Fail the test if any command loads a model: every fxreplace module that took the loader
    (the commands' modules imported first: they are imported when a command runs) gets one that fails."""
    import fxreplace.cli
    import fxreplace.loading

    for info in pkgutil.iter_modules(fxreplace.cli.__path__):
        importlib.import_module(f"fxreplace.cli.{info.name}")
    importlib.import_module("fxreplace.engines.embedded.spec")
    real = fxreplace.loading.load_model
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("fxreplace") and getattr(module, "load_model", None) is real:
            monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("a model loaded before the check"))


@pytest.fixture
def no_model_loads(monkeypatch):
    forbid_model_loads(monkeypatch)
