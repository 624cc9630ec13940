"""The two commands' platform setup (scripts/_env.sh), exercised without installing anything.

Each case runs `scripts/test.sh` / `scripts/run.sh` in a subprocess with DETLOGP_SETUP=plan (or a
run that stops before any install) and a fake `nvidia-smi` first on PATH. The base interpreter is
a pip-less venv without jax (DETLOGP_PYTHON), so `auto` cannot pick `system` by accident on a
machine whose Python happens to have a GPU jax; the `system` cases use the interpreter running
these tests, which has the project's dependencies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("scripts/test.sh", "scripts/run.sh")
CUDA13_DRIVER = "580.159.04"
CUDA12_DRIVER = "550.54.15"


def lock_line(platform):
    """How the plan names a lock: its path and its number of pinned packages."""
    path = os.path.join(ROOT, "requirements", f"{platform}.lock")
    pins = [line for line in open(path).read().splitlines() if line.strip() and not line.startswith("#")]
    return f"requirements/{platform}.lock ({len(pins)} packages)"


def _venv_python(path: str) -> str:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    return os.path.join(path, "bin", "python")


@pytest.fixture(scope="module")
def nojax_python(tmp_path_factory):
    """A Python >= 3.12 that has no jax (a venv without pip or packages)."""
    return _venv_python(str(tmp_path_factory.mktemp("nojax") / "venv"))


@pytest.fixture(scope="module")
def gpujax_python(tmp_path_factory):
    """A Python whose (fake) jax is the pinned version and reports a GPU, as on our H200 device."""
    py = _venv_python(str(tmp_path_factory.mktemp("gpujax") / "venv"))
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    os.makedirs(os.path.join(site, "jax"))
    with open(os.path.join(site, "jax", "__init__.py"), "w") as f:
        f.write(
            textwrap.dedent("""\
            import types
            __version__ = "0.11.2"
            def devices():
                return [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")]
            """)
        )
    return py


def fake_bin(tmp_path, name="bin", *, driver=None, exit_code=0, gpus=2):
    """A PATH directory whose nvidia-smi prints `driver` (one line per GPU) or exits `exit_code`."""
    d = tmp_path / name
    d.mkdir()
    script = d / "nvidia-smi"
    if exit_code:
        body = f'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver." >&2\nexit {exit_code}\n'
    else:
        body = f"i=0\nwhile [ $i -lt {gpus} ]; do echo {driver}; i=$((i + 1)); done\n"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(d)


def base_env(tmp_path, python, path_prefix=None, **extra):
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("DETLOGP_", "JAX_", "PYTEST_")) and k != "PYTHONPATH"
    }
    env["DETLOGP_VENV"] = str(tmp_path / "venv")
    if python is not None:
        env["DETLOGP_PYTHON"] = python
    if path_prefix:
        env["PATH"] = path_prefix + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def run(script, env, *args, timeout=120):
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, script), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout, proc.stderr


def plan(script, env):
    env = dict(env, DETLOGP_SETUP="plan")
    rc, out, err = run(script, env)
    assert rc == 0, (out, err)
    lines = {}
    for line in out.splitlines():
        assert line.startswith("[plan] "), line
        key, _, value = line[len("[plan] ") :].partition(": ")
        lines[key] = value
    return lines


def path_without_nvidia_smi(env):
    """PATH minus every directory holding an nvidia-smi; None if that would drop bash/coreutils."""
    dirs = [d for d in env["PATH"].split(os.pathsep) if d and not os.path.exists(os.path.join(d, "nvidia-smi"))]
    path = os.pathsep.join(dirs)
    if all(shutil.which(tool, path=path) for tool in ("bash", "sha256sum", "timeout", "grep", "sed")):
        return path
    return None


@pytest.mark.parametrize("script", SCRIPTS)
def test_cuda13_driver_plans_cuda13(tmp_path, nojax_python, script):
    env = base_env(tmp_path, nojax_python, fake_bin(tmp_path, driver=CUDA13_DRIVER))
    p = plan(script, env)
    assert p["platform"].startswith("cuda13 (auto: driver 580.159.04 >= 580"), p
    assert "has no jax" in p["platform"], p  # why not system
    assert p["lock"] == lock_line("cuda13")
    assert p["JAX_PLATFORMS"] == "cuda,cpu (set by the setup)"
    assert p["python"].endswith("(Python %d.%d.%d)" % sys.version_info[:3])
    assert p["venv"].endswith("(absent: would create it and install requirements/cuda13.lock)")


@pytest.mark.parametrize("script", SCRIPTS)
def test_cuda12_driver_plans_cuda12(tmp_path, nojax_python, script):
    env = base_env(tmp_path, nojax_python, fake_bin(tmp_path, driver=CUDA12_DRIVER))
    p = plan(script, env)
    assert p["platform"].startswith("cuda12 (auto: driver 550.54.15 >= 525 (< 580)"), p
    assert p["lock"] == lock_line("cuda12")


@pytest.mark.parametrize("script", SCRIPTS)
def test_failing_nvidia_smi_plans_cpu(tmp_path, nojax_python, script):
    env = base_env(tmp_path, nojax_python, fake_bin(tmp_path, exit_code=9))
    p = plan(script, env)
    assert p["platform"] == "cpu (auto: nvidia-smi failed (exit 9), so no usable NVIDIA GPU)"
    assert p["lock"] == lock_line("cpu")
    assert p["JAX_PLATFORMS"] == "cpu (set by the setup)"


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_nvidia_smi_plans_cpu(tmp_path, nojax_python, script):
    env = base_env(tmp_path, nojax_python)
    path = path_without_nvidia_smi(env)
    if path is None:
        pytest.skip("nvidia-smi shares a PATH directory with bash/coreutils here")
    env["PATH"] = path
    p = plan(script, env)
    assert p["platform"] == "cpu (auto: no nvidia-smi on PATH, so no usable NVIDIA GPU)"
    assert p["lock"] == lock_line("cpu")


@pytest.mark.parametrize("script", SCRIPTS)
def test_forced_cpu_with_cuda13_driver(tmp_path, nojax_python, script):
    env = base_env(tmp_path, nojax_python, fake_bin(tmp_path, driver=CUDA13_DRIVER), DETLOGP_PLATFORM="cpu")
    p = plan(script, env)
    assert p["platform"] == "cpu (DETLOGP_PLATFORM=cpu, driver 580.159.04)"
    assert p["lock"] == lock_line("cpu")
    assert p["JAX_PLATFORMS"] == "cpu (set by the setup)"


def test_auto_picks_system_when_its_jax_sees_a_gpu(tmp_path, gpujax_python):
    env = base_env(tmp_path, gpujax_python, fake_bin(tmp_path, driver=CUDA13_DRIVER))
    p = plan("scripts/run.sh", env)
    assert p["platform"].startswith("system (auto: driver 580.159.04, and "), p
    assert p["platform"].endswith("has jax 0.11.2 on 1x NVIDIA H200)"), p
    assert p["lock"].startswith("none")
    assert p["venv"] == "none (system)"
    assert not (tmp_path / "venv").exists()


def test_many_driver_lines_read_only_the_first(tmp_path, nojax_python):
    # More lines than a pipe holds: the setup must take the first line without a pipe whose
    # reader quits early (that SIGPIPEd the writer and, under pipefail, exited the script 141).
    env = base_env(tmp_path, nojax_python, fake_bin(tmp_path, driver=CUDA13_DRIVER, gpus=20000))
    p = plan("scripts/run.sh", env)
    assert p["platform"].startswith("cuda13 (auto: driver 580.159.04"), p


def test_users_jax_platforms_is_kept(tmp_path, nojax_python):
    env = base_env(tmp_path, nojax_python, fake_bin(tmp_path, driver=CUDA13_DRIVER), JAX_PLATFORMS="cuda")
    assert plan("scripts/run.sh", env)["JAX_PLATFORMS"] == "cuda (yours)"


def test_plan_installs_nothing(tmp_path, nojax_python):
    bin_dir = fake_bin(tmp_path, driver=CUDA13_DRIVER)
    env = base_env(tmp_path, nojax_python, bin_dir)
    p = plan("scripts/test.sh", env)
    assert "absent" in p["venv"] and not (tmp_path / "venv").exists()
    # A venv that holds the cpu lock: the plan says it would be rebuilt, and leaves it as it is.
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /nowhere\n")
    stamp = venv / ".detlogp-lock"
    stamp.write_text("platform=cpu lock=requirements/cpu.lock sha256=0\n")
    before = sorted((str(q), q.stat().st_mtime_ns) for q in venv.rglob("*"))
    p = plan("scripts/test.sh", env)
    assert p["venv"].endswith(
        "(holds platform cpu, not cuda13: would delete it, create it again and install requirements/cuda13.lock)"
    ), p
    p = plan("scripts/test.sh", dict(env, DETLOGP_PLATFORM="cpu"))
    assert "requirements/cpu.lock changed since it was installed" in p["venv"], p
    assert sorted((str(q), q.stat().st_mtime_ns) for q in venv.rglob("*")) == before


# ids: a bare "gpu" id would be a keyword that conftest's no-Hopper skip matches.
@pytest.mark.parametrize("value", ["gpu", "CUDA13", "cuda"], ids=lambda v: f"DETLOGP_PLATFORM={v}")
def test_unknown_platform_fails_with_the_choices(tmp_path, nojax_python, value):
    rc, out, err = run(
        "scripts/test.sh", base_env(tmp_path, nojax_python, DETLOGP_PLATFORM=value, DETLOGP_SETUP="plan")
    )
    assert rc == 2 and out == ""
    assert (
        err
        == f"error: DETLOGP_PLATFORM='{value}' is not one of auto, cpu, cuda12, cuda13, system (unset it for auto)\n"
    )


def test_unknown_setup_mode_fails(tmp_path, nojax_python):
    rc, _, err = run("scripts/run.sh", base_env(tmp_path, nojax_python, DETLOGP_SETUP="dry"))
    assert rc == 2 and err.startswith("error: DETLOGP_SETUP='dry' is not 'plan'") and err.count("\n") == 1


def test_old_driver_fails_naming_the_cpu_override(tmp_path, nojax_python):
    env = base_env(tmp_path, nojax_python, fake_bin(tmp_path, driver="470.256.02"), DETLOGP_SETUP="plan")
    rc, out, err = run("scripts/run.sh", env)
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert "470.256.02 is older than 525" in err and "DETLOGP_PLATFORM=cpu" in err


def test_missing_python(tmp_path):
    rc, _, err = run("scripts/run.sh", base_env(tmp_path, str(tmp_path / "nope"), DETLOGP_SETUP="plan"))
    assert rc == 1 and err.count("\n") == 1 and "DETLOGP_PYTHON=" in err and ">= 3.12" in err
    # No Python 3.12 anywhere: fake python3.12/python3 that fail, and a HOME without pyenv.
    bin_dir = fake_bin(tmp_path, exit_code=9)
    for name in ("python3.12", "python3"):
        p = os.path.join(bin_dir, name)
        with open(p, "w") as f:
            f.write("#!/bin/sh\nexit 1\n")
        os.chmod(p, 0o755)
    env = base_env(tmp_path, None, bin_dir, HOME=str(tmp_path), DETLOGP_SETUP="plan")
    rc, _, err = run("scripts/run.sh", env)
    assert rc == 1 and err.count("\n") == 1
    assert err.startswith("error: Python >= 3.12 not found") and "pyenv install 3.12" in err and "DETLOGP_PYTHON" in err


def test_system_with_a_gpu_jax_cannot_see_fails(tmp_path):
    # The real interpreter, its jax held to CPU by the user's JAX_PLATFORMS: the setup must refuse
    # to run on CPU when nvidia-smi reports a GPU.
    env = base_env(
        tmp_path,
        sys.executable,
        fake_bin(tmp_path, driver=CUDA13_DRIVER),
        DETLOGP_PLATFORM="system",
        JAX_PLATFORMS="cpu",
    )
    rc, out, err = run("scripts/run.sh", env, "--help")
    assert rc == 1 and out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("error: this machine has an NVIDIA GPU (driver 580.159.04) but jax in ")
    assert "DETLOGP_PLATFORM=cpu" in err


def test_system_run_prints_the_check_line_and_no_tpu_noise(tmp_path):
    env = base_env(tmp_path, sys.executable, fake_bin(tmp_path, exit_code=9), DETLOGP_PLATFORM="system")
    probe = textwrap.dedent("""\
        source scripts/_env.sh
        echo "JAX_PLATFORMS=$JAX_PLATFORMS"
        exec "$PYTHON" -c 'from absl import app; import jax; app.run(lambda argv: print(jax.devices()[0].platform))'
        """)
    proc = subprocess.run(["bash", "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "JAX_PLATFORMS=cpu\ncpu\n"
    check = "[setup] check: Python %d.%d.%d, jax 0.11.2 on cpu (" % sys.version_info[:3]
    assert proc.stderr.startswith(check) and "linear_logp backend reference [system, " in proc.stderr, proc.stderr
    assert " host CPUs), linear_logp backend" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "tpu" not in proc.stderr.lower(), proc.stderr
    assert not (tmp_path / "venv").exists()


def test_failed_install_is_one_error_line_with_the_fix(tmp_path):
    # A real venv (no network needed) and a pip that can reach no index: it fails at once.
    env = base_env(
        tmp_path,
        sys.executable,
        fake_bin(tmp_path, exit_code=9),
        DETLOGP_PLATFORM="cpu",
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        TMPDIR=str(tmp_path),
    )
    env = {k: v for k, v in env.items() if k not in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    rc, out, err = run("scripts/run.sh", env, "--help", timeout=300)
    assert rc == 1 and out == "", (out, err)
    lines = err.splitlines()
    assert lines[0].startswith("[setup] venv ") and "absent; creating it for cpu" in lines[0]
    assert lines[1] == "[setup] installing %s into %s ... failed" % (lock_line("cpu"), tmp_path / "venv")
    assert any(line.startswith("  pip| ") for line in lines[2:-1])
    assert (
        lines[-1].startswith("error: pip could not install requirements/cpu.lock")
        and "DETLOGP_PLATFORM=system" in lines[-1]
    )
    assert not (tmp_path / "venv" / ".detlogp-lock").exists()  # the next run starts over
    rc, out, _ = run("scripts/run.sh", dict(env, DETLOGP_SETUP="plan"))
    assert "records no lock" in out


def test_the_suite_watchdog_stops_a_hung_test_with_its_stack(tmp_path):
    """tests/conftest.py as a plugin in a pytest subprocess: a test sleeping past
    DETLOGP_TEST_TIMEOUT_S ends the run with exit code 3 and the stacks of the threads (the test's
    own frame among them); NPROC (XLA's CPU pool size for interpret mode) is set for the run."""
    (tmp_path / "test_hangs.py").write_text(
        "import os, time\ndef test_sleeps():\n    assert os.environ['NPROC'] == '32'\n    time.sleep(60)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NPROC"}
    env.update(DETLOGP_TEST_TIMEOUT_S="3", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "test_hangs.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr)
    assert "[watchdog] test_hangs.py::test_sleeps ran past 3 s" in proc.stderr, proc.stderr
    assert 'test_hangs.py", line 4 in test_sleeps' in proc.stderr, proc.stderr
