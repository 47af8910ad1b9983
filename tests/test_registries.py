"""One registry behaviour for families, engines, adapters and bypass hints (a taken name needs
``replace=True``), and engines found through the ``fxreplace.engines`` entry-point group as
docs/extending.md describes it: an installed distribution is written as its ``*.dist-info`` into
a directory on ``sys.path``, which importlib.metadata reads (no pip install)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from fxreplace.adapters import register_adapter
from fxreplace.engines import registry
from fxreplace.bypass import _HINTS as _BYPASS_HINTS, register_bypass_hint
from fxreplace.models import get_family, register_family

ENGINE_MODULE = textwrap.dedent("""
    from fxreplace.engines.registry import EngineSpec, register_engine

    def _spec(name):
        return EngineSpec(name=name, summary="an engine of a test package", open_validation=None, open_blame=None)

    ENGINE = register_engine(_spec("ep-module"))          # the module form: importing it registers

    def register():                                        # the callable form: called once
        register_engine(_spec("ep-callable"))

    def broken():
        raise RuntimeError("boom")

    def takeover():                                        # a built-in engine's name, without replace=True
        register_engine(_spec("embedded"))
""")

ENTRY_POINTS = textwrap.dedent("""
    [fxreplace.engines]
    ep-module = fxreplace_testengines
    ep-callable = fxreplace_testengines:register
    ep-broken = fxreplace_testengines:broken
    ep-takeover = fxreplace_testengines:takeover
""")


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A distribution declaring engines in the entry-point group, on sys.path; its engines
    unregistered and its module forgotten after."""
    (tmp_path / "fxreplace_testengines.py").write_text(ENGINE_MODULE)
    info = tmp_path / "fxreplace_testengines-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fxreplace-testengines\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("ep-module", "ep-callable"):
        registry._ENGINES.unregister(name)
    sys.modules.pop("fxreplace_testengines", None)


def test_engines_declared_by_a_package_are_listed_without_importing_it(installed):
    names = registry.engine_names()
    assert names[:2] == ["embedded", "vllm"]
    assert {"ep-module", "ep-callable", "ep-broken"} <= set(names)
    assert "fxreplace_testengines" not in sys.modules  # listing (the command line's --engine) imports nothing
    assert registry.engine_name("ep-module") == "ep-module"


def test_an_engine_declared_as_a_module_registers_when_imported(installed):
    assert registry.get_engine("ep-module").summary == "an engine of a test package"
    assert "fxreplace_testengines" in sys.modules


def test_an_engine_declared_as_a_callable_registers_when_called(installed):
    assert registry.get_engine("ep-callable").name == "ep-callable"


def test_a_failing_entry_point_is_named_in_the_error(installed):
    with pytest.raises(KeyError, match="the engine 'ep-broken' declared in fxreplace.engines registered no engine of "
                                       "that name; the 'fxreplace.engines' entry point 'ep-broken' = "
                                       "'fxreplace_testengines:broken' failed to register: RuntimeError: boom"):
        registry.get_engine("ep-broken")
    builtin = registry.get_engine("embedded")
    with pytest.raises(KeyError, match="failed to register: ValueError: engine 'embedded' is already registered; "
                                       "pass replace=True to replace it"):
        registry.get_engine("ep-takeover")
    assert registry.get_engine("embedded") is builtin  # not taken over


def test_an_unknown_engine_names_the_engines_there_are(installed):
    with pytest.raises(KeyError, match="no engine 'sglang'; engines: embedded, vllm, .*ep-module"):
        registry.get_engine("sglang")


def test_every_registry_refuses_a_taken_name_unless_replace():
    """Families, engines, adapters and bypass hints alike: another value under a taken name is an
    error, the same value again is harmless, ``replace=True`` replaces."""
    family = get_family("Qwen3MoeForCausalLM")
    builtin = registry.get_engine("embedded")

    def identity(logits, module):
        return logits

    def hint(model, name):
        return None

    other_hint = lambda model, name: "other"  # noqa: E731
    other_hint.__qualname__ = hint.__qualname__
    cases = [
        ("family 'Qwen3MoeForCausalLM'", lambda value, **kw: register_family(value, **kw), family,
         family.__class__(architecture=family.architecture, tiny_config=family.tiny_config, targets=())),
        ("engine 'embedded'", lambda value, **kw: registry.register_engine(value, **kw), builtin,
         registry.EngineSpec(name="embedded", summary="", open_validation=None, open_blame=None)),
        ("adapter 'identity'", lambda value, **kw: register_adapter("identity", value, **kw),
         __import__("fxreplace.adapters").adapters.identity, identity),
    ]
    register_bypass_hint(hint)
    try:
        cases.append((f"bypass hint '{__name__}.{hint.__qualname__}'",
                      lambda value, **kw: register_bypass_hint(value, **kw), hint, other_hint))
        for what, register, registered, other in cases:
            assert register(registered) is registered  # the same value again
            with pytest.raises(ValueError, match=f"^{what} is already registered; pass replace=True to replace it$"):
                register(other)
            assert register(other, replace=True) is other
            assert register(registered, replace=True) is registered
    finally:
        _BYPASS_HINTS.unregister(f"{__name__}.{hint.__qualname__}")
    with pytest.raises(TypeError, match="engine names are non-empty strings, got ''"):
        registry.register_engine(registry.EngineSpec(name="", summary="", open_validation=None, open_blame=None))
