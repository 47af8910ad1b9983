import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Whole test modules that also run in the compat environment (torch 2.9, transformers 4.57,
# torch-xla): the core on the HF-independent family, store and replacer. Single tests
# elsewhere carry @pytest.mark.compat; tests/test_xla.py carries the xla marker.
COMPAT_MODULES = {
    "test_matching.py", "test_neuron_moe.py", "test_replacer.py", "test_store.py",
    "test_targets.py", "test_torch_only.py",
}


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in COMPAT_MODULES:
            item.add_marker(pytest.mark.compat)
