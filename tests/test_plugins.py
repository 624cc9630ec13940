"""The tensor-parallel package is reached by name (`detlogp_jax.plugins`), and a foreign
module named `sharding` that shadows it is refused with an error naming it."""

import os
import subprocess
import sys

import detlogp_jax as dl
from detlogp_jax import plugins

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_entry_points_are_the_tp_package_s():
    import sharding

    assert sharding.DISTRIBUTION == plugins.DISTRIBUTION
    assert plugins.tensor_parallel() is sharding
    for name in plugins.TP_ENTRY_POINTS:
        assert getattr(dl, name) is getattr(sharding, name)


def test_a_shadowing_sharding_module_is_refused(tmp_path):
    (tmp_path / "sharding.py").write_text("def linear_logp_tp(*a, **k):\n    return 'not ours'\n")
    code = (
        "import detlogp_jax as dl\n"
        "try:\n"
        "    dl.linear_logp_tp\n"
        "except ImportError as e:\n"
        "    print('REFUSED', e)\n"
        "else:\n"
        "    print('SERVED')\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("REFUSED"), out.stdout
    assert str(tmp_path / "sharding.py") in out.stdout
