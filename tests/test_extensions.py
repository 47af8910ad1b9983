"""An installed package registers a family and an adapter through the
``fxreplace.families`` entry-point group: a tiny local package is pip-installed
into a temporary directory (the shared environment is not touched) and used by a
fresh interpreter."""

import os
import subprocess
import sys
import textwrap

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
