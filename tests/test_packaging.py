"""The wheel is complete: it declares what its documented paths import (flatbuffers for
jax.export's serialization), ships the golden fingerprints, and installs the three top-level
packages; after installing it, `import sharding` is detlogp-jax's tensor-parallel package
(marked, and checked by `detlogp_jax.plugins.tensor_parallel`)."""

import glob
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), ROOT],
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = glob.glob(str(out / "*.whl"))
    assert found, r.stderr[-2000:]
    return found[0]


def test_wheel_declares_flatbuffers_and_ships_the_packages(wheel):
    z = zipfile.ZipFile(wheel)
    names = z.namelist()
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert any("flatbuffers" in r for r in core), core
    for pkg in ("detlogp_jax/__init__.py", "pallas_kernels/__init__.py", "sharding/__init__.py"):
        assert pkg in names, pkg
    assert any(n.startswith("detlogp_jax/apps/data/") and n.endswith(".json") for n in names)


def test_installed_sharding_is_the_tp_package(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), wheel],
        check=True,
        timeout=600,
    )
    code = (
        "import sharding, detlogp_jax as dl\n"
        "from detlogp_jax import plugins\n"
        "assert sharding.__file__.startswith(%r), sharding.__file__\n"
        "assert sharding.DISTRIBUTION == 'detlogp-jax'\n"
        "assert dl.linear_logp_tp is plugins.tensor_parallel().linear_logp_tp\n"
        "print('ok')\n"
    ) % str(target)
    env = dict(os.environ, PYTHONPATH=str(target), JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_readme_installs_from_the_repository():
    """The package is not published: the README's install lines install this checkout (the wheel
    built above is what `pip install .` installs)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("pip install")]
    assert lines, "no install line"
    for line in lines:
        spec = line.split("#")[0].split()[2].strip("\"'")
        assert spec == "." or spec.startswith(".["), line
