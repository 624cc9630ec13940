"""The main job's command line: help asked for is a success."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("flag", ["--help", "--helpfull"])
def test_help_exits_zero_and_lists_the_flags(flag):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "detlogp_jax.validate", flag], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--out_dir" in out.stdout + out.stderr


def test_an_unknown_flag_still_fails():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "detlogp_jax.validate", "--no_such_flag"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode != 0
