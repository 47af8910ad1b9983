"""An installed package registers a family and an adapter through the
``fxreplace.families`` entry-point group: a tiny local package is pip-installed
into a temporary directory (the shared environment is not touched) and used by a
fresh interpreter."""

import os
import subprocess
import sys
import textwrap

import pytest

PYPROJECT = textwrap.dedent("""
    [build-system]
    requires = ["setuptools>=68"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "fxreplace-testfamily"
    version = "0.1"

    [project.entry-points."fxreplace.families"]
    testfamily = "fxreplace_testfamily:register"

    [tool.setuptools]
    packages = ["fxreplace_testfamily"]
""")

PACKAGE = textwrap.dedent("""
    def register():
        from fxreplace import Target, register_adapter
        from fxreplace.models import Family, register_family
        from fxreplace.models.qwen3_moe import tiny_config

        register_adapter("testfamily_double", lambda logits, module: 2 * logits)
        register_family(Family(architecture="TestFamilyForCausalLM", tiny_config=tiny_config,
                               targets=(Target("model.layers.*.mlp.gate", adapter="testfamily_double"),)))
""")

USE = textwrap.dedent("""
    import torch, fxreplace
    from fxreplace.models import families, get_family, tiny_model

    family = get_family("TestFamilyForCausalLM")           # found through the entry point
    model = fxreplace.instrument(tiny_model("TestFamilyForCausalLM"), family.targets)
    plain = fxreplace.instrument(tiny_model("Qwen3MoeForCausalLM"), ["model.layers.*.mlp.gate"])
    ids = torch.tensor([[5, 6, 7]])
    logits = {name: torch.randn(3, 8) for name in model.targets}
    with torch.no_grad():
        got = model(input_ids=ids, replacements=logits).logits
        want = plain(input_ids=ids, replacements={k: 2 * v for k, v in logits.items()}).logits
    assert torch.equal(got, want), "the package's adapter was not applied"
    assert "TestFamilyForCausalLM" in families()
    print("REGISTERED", fxreplace.get_adapter("testfamily_double").__name__)
""")


def test_installed_package_registers_family_and_adapter(tmp_path):
    src = tmp_path / "src"
    (src / "fxreplace_testfamily").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "fxreplace_testfamily" / "__init__.py").write_text(PACKAGE)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", USE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REGISTERED <lambda>" in proc.stdout
    # without the package the name is unknown, and the error lists what is registered
    proc = subprocess.run([sys.executable, "-c", "from fxreplace.models import get_family; "
                           "get_family('TestFamilyForCausalLM')"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "no fxreplace family for 'TestFamilyForCausalLM'" in proc.stderr


def test_broken_entry_point_is_named(tmp_path):
    src = tmp_path / "src"
    (src / "fxreplace_testfamily").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "fxreplace_testfamily" / "__init__.py").write_text("def register():\n    raise RuntimeError('boom')\n")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(target))
    proc = subprocess.run([sys.executable, "-c", "from fxreplace.models import get_family; get_family('X')"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert ("'fxreplace.families' entry point 'testfamily' = 'fxreplace_testfamily:register' failed to register: "
            "RuntimeError: boom") in proc.stderr


MULTI_ENTRY_POINTS = textwrap.dedent("""
    [fxreplace.families]
    a_broken = fxreplace_testfamilies:broken
    b_takeover = fxreplace_testfamilies:takeover
    c_good = fxreplace_testfamilies:good
""")

MULTI_PACKAGE = textwrap.dedent("""
    from fxreplace import Target
    from fxreplace.models import Family, register_family
    from fxreplace.models.qwen3_moe import tiny_config

    def broken():
        raise RuntimeError("boom")

    def takeover():  # a built-in family's name, without replace=True
        register_family(Family(architecture="Qwen3MoeForCausalLM", tiny_config=tiny_config,
                               targets=(Target("model.layers.*.self_attn"),)))

    def good():
        register_family(Family(architecture="GoodFamilyForCausalLM", tiny_config=tiny_config,
                               targets=(Target("model.layers.*.mlp.gate"),)))
""")

MULTI_USE = textwrap.dedent("""
    import logging
    from fxreplace.models import families, get_family
    logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
    assert get_family("GoodFamilyForCausalLM").architecture == "GoodFamilyForCausalLM"  # not hidden by the broken one
    assert [t.pattern for t in get_family("Qwen3MoeForCausalLM").targets] == ["model.layers.*.mlp.gate"]
    for attempt in range(2):  # reported every time, by name
        try:
            get_family("MissingForCausalLM")
        except KeyError as e:
            print("MISSING", attempt, e)
    assert "GoodFamilyForCausalLM" in families() and "GoodFamilyForCausalLM" in families()
""")


def test_every_broken_entry_point_is_named_every_time_and_hides_no_other(tmp_path):
    target = tmp_path / "site"  # an installed distribution's layout, written directly (pip is slow here)
    (target / "fxreplace_testfamilies").mkdir(parents=True)
    (target / "fxreplace_testfamilies" / "__init__.py").write_text(MULTI_PACKAGE)
    info = target / "fxreplace_testfamilies-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fxreplace-testfamilies\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(MULTI_ENTRY_POINTS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", MULTI_USE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    broken = "entry point 'a_broken' = 'fxreplace_testfamilies:broken' failed to register: RuntimeError: boom"
    takeover = ("entry point 'b_takeover' = 'fxreplace_testfamilies:takeover' failed to register: ValueError: family "
                "'Qwen3MoeForCausalLM' is already registered; pass replace=True to replace it")
    missing = [line for line in proc.stdout.splitlines() if line.startswith("MISSING")]
    assert len(missing) == 2 and all(broken in line and takeover in line for line in missing), proc.stdout
    logged = [line for line in proc.stderr.splitlines() if line.startswith("LOG")]
    assert sum(broken in line for line in logged) == 2 and sum(takeover in line for line in logged) == 2, proc.stderr


def test_registering_a_taken_name_needs_replace():
    from fxreplace import get_adapter, register_adapter
    from fxreplace.models import get_family, register_family

    qwen = get_family("Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match="family 'Qwen3MoeForCausalLM' is already registered; pass replace=True"):
        register_family(qwen.__class__(architecture="Qwen3MoeForCausalLM", tiny_config=qwen.tiny_config, targets=()))
    assert get_family("Qwen3MoeForCausalLM") is qwen
    assert register_family(qwen, replace=True) is qwen
    with pytest.raises(TypeError, match="register_family needs a Family, got str"):
        register_family("Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match="adapter 'identity' is already registered; pass replace=True"):
        register_adapter("identity", lambda logits, module: logits)
    assert get_adapter("identity").__name__ == "identity"
