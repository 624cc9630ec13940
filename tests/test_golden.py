"""Golden fingerprints replay on this machine (CPU reference in CI; GPU keys on the device).

The records ship as package data (`detlogp_jax/apps/data/fingerprints.json`); the
CLI (`python -m detlogp_jax.golden`) exits 0 only when something passed and
nothing failed, 1 on a failing record, 2 when this machine has no record.
"""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import jax
import numpy as np
import pytest

from detlogp_jax import backends
from detlogp_jax.apps import golden

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_CPU = jax.devices()[0].platform == "cpu"

# sha256 of the bytes of make_inputs() for the CPU cases: the seeded input set must not
# drift (a numpy or ml_dtypes change of generator or rounding would silently move it).
INPUTS_SHA256 = "831861155b11dc68ef84866f1e0cc50baa3370c5130f1bcf34cf7a45df66166f"


def test_golden_replay_matches_records():
    backend = backends.preferred()
    key = golden.platform_key(backend)
    if key not in golden.load():
        if ON_CPU:
            pytest.fail(
                f"no golden record for {key}: re-record with python -m detlogp_jax.golden --record --out FILE "
                "(after a contract or JAX version change) and copy FILE over detlogp_jax/apps/data/fingerprints.json"
            )
        pytest.skip(f"no golden record for {key}")
    out = golden.replay(backend, log=lambda *_: None)
    results = out["results"]
    assert not [n for n, r in results.items() if r.startswith("FAIL")], results
    assert any(r == "pass" for r in results.values()), results
    e_results = out["entropy_results"]  # the entropy records, under their own key
    if backends.get(backend).entropy:
        assert out["entropy_key"] in golden.load(), out["entropy_key"]
        ran = {n for n, r in results.items() if not r.startswith("skipped")}
        assert set(e_results) == ran and all(r == "pass" for r in e_results.values()), e_results
    else:
        assert e_results == {}


def test_golden_inputs_are_pinned():
    h = hashlib.sha256()
    for case in golden.CASES[:3]:
        for a in golden.make_inputs(case):
            if a is not None:
                h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    assert h.hexdigest() == INPUTS_SHA256


def test_records_are_package_data():
    text = golden.PACKAGED.read_text()
    assert golden.load() == json.loads(text)
    assert str(golden.PACKAGED).endswith(os.path.join("detlogp_jax", "apps", "data", "fingerprints.json"))
    assert not os.path.exists(os.path.join(ROOT, "tests", "golden", "fingerprints.json"))


pytestmark_cpu = pytest.mark.skipif(not ON_CPU, reason="the CLI cases below use the CPU reference key")


def _cpu_key():
    return golden.platform_key("reference")


@pytestmark_cpu
def test_cli_fails_on_a_tampered_record(tmp_path, capsys):
    db = golden.load()
    rec = db[_cpu_key()]["small_odd"]
    rec["logp_sha256"] = ("0" if rec["logp_sha256"][0] != "0" else "1") + rec["logp_sha256"][1:]
    tampered = tmp_path / "tampered.json"
    golden.dump(db, tampered)
    assert (
        golden.main(["--fingerprints", str(tampered), "--backend", "reference", "--cases", "small_odd,decode_row"]) == 1
    )
    out = capsys.readouterr().out
    assert "1 pass, 1 fail" in out and "small_odd                FAIL" in out


@pytestmark_cpu
def test_cli_without_a_record_for_this_machine_exits_nonzero(tmp_path, capsys):
    other = {k: v for k, v in golden.load().items() if k != _cpu_key()}
    path = tmp_path / "other_keys.json"
    golden.dump(other, path)
    assert golden.main(["--fingerprints", str(path), "--backend", "reference", "--cases", "decode_row"]) == 2
    assert f"no golden record for this machine's key {_cpu_key()}" in capsys.readouterr().err
    # nothing replayed (a GPU-only case on a CPU) is not a pass either
    assert golden.main(["--backend", "reference", "--cases", "qwen3_8b_m64"]) == 2


@pytestmark_cpu
def test_cli_record_needs_out_and_keeps_bytes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert golden.main(["--record"]) == 2
    assert "--record needs --out" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    # Re-recording this machine's key into a new file reproduces the packaged file byte for byte.
    out = tmp_path / "sub" / "fingerprints.json"
    assert golden.main(["--record", "--backend", "reference", "--out", str(out)]) == 0
    assert out.read_bytes() == golden.PACKAGED.read_bytes()
    # A new key is added without touching the others.
    empty = tmp_path / "empty.json"
    empty.write_text("{}\n")
    out2 = tmp_path / "new.json"
    assert (
        golden.main(
            [
                "--record",
                "--fingerprints",
                str(empty),
                "--backend",
                "reference",
                "--cases",
                "decode_row",
                "--out",
                str(out2),
            ]
        )
        == 0
    )
    ekey = golden.entropy_key("reference")
    assert json.loads(out2.read_text()) == {
        _cpu_key(): {"decode_row": golden.load()[_cpu_key()]["decode_row"]},
        ekey: {"decode_row": golden.load()[ekey]["decode_row"]},
    }


@pytestmark_cpu
def test_entropy_records_are_their_own_key(tmp_path, capsys):
    """The entropy records (linear-logp-entropy-v1) sit under their own key: the contract
    records are the ones recorded before the entropy existed (an older replay reads only
    those), a tampered entropy record fails the replay, a missing one is not a pass."""
    db = golden.load()
    ekey = golden.entropy_key("reference")
    assert ekey.split("/")[2] == "linear-logp-entropy-v1" and set(db[ekey]) == {
        "small_odd",
        "decode_row",
        "unpadded_weight",
    }
    assert all(set(r) == {"entropy_sha256"} for r in db[ekey].values())
    assert all(set(r) == {"logp_sha256", "lse_sha256"} for r in db[_cpu_key()].values())
    assert db[_cpu_key()]["small_odd"]["logp_sha256"].startswith("63a2ed7055530a8b")  # recorded before the entropy
    rec = db[ekey]["decode_row"]
    rec["entropy_sha256"] = ("0" if rec["entropy_sha256"][0] != "0" else "1") + rec["entropy_sha256"][1:]
    tampered = tmp_path / "tampered.json"
    golden.dump(db, tampered)
    assert golden.main(["--fingerprints", str(tampered), "--backend", "reference", "--cases", "decode_row"]) == 1
    out = capsys.readouterr().out
    assert "golden replay: 1 pass, 0 fail, 0 new" in out and "entropy replay" in out and "0 pass, 1 fail" in out
    no_entropy = {k: v for k, v in golden.load().items() if k != ekey}
    path = tmp_path / "no_entropy.json"
    golden.dump(no_entropy, path)
    assert golden.main(["--fingerprints", str(path), "--backend", "reference", "--cases", "decode_row"]) == 2
    assert "without an entropy record" in capsys.readouterr().err


def _tracked_tree(dst):
    """Copies the files git would commit (tracked + untracked, not ignored) of ROOT to dst."""
    r = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    )
    for rel in filter(None, r.stdout.decode().split("\0")):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, rel))


@pytest.mark.slow
@pytestmark_cpu
def test_installed_wheel_replays_from_another_directory(tmp_path):
    """Wheel -> fresh venv (no checkout on the path) -> `python -m detlogp_jax.golden` elsewhere: passes."""
    if (
        shutil.which("git") is None
        or subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode
    ):
        pytest.skip("not a git checkout")
    src, wheels, venv, elsewhere = (tmp_path / d for d in ("src", "wheels", "venv", "elsewhere"))
    _tracked_tree(src)  # build from a copy: pip's build/ and egg-info stay out of the source tree
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), "."],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (whl,) = glob.glob(str(wheels / "*.whl"))
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=120
    )
    py = str(venv / "bin" / "python")
    # A venv made from a venv's python sees the *base* interpreter's site-packages only;
    # point it at this interpreter's (jax, flax, ...) with a plain path .pth (no .pth of
    # that directory is processed, so no editable checkout comes along).
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "_parent_site.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DETLOGP_BACKEND", "DETLOGP_STRICT")}
    env["JAX_PLATFORMS"] = "cpu"
    # Without PYTHONPATH here too: with the checkout on it (scripts/test.sh puts it there), pip
    # would take a stray detlogp_jax.egg-info in the checkout for an installed copy and skip.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", whl],
        check=True,
        capture_output=True,
        timeout=300,
        env=env,
    )
    elsewhere.mkdir()
    found = subprocess.run(
        [py, "-c", "import detlogp_jax.apps.golden as g; print(g.__file__); print(g.PACKAGED)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stdout + found.stderr[-3000:]
    where = found.stdout.split()
    assert all(p.startswith(site) for p in where), where
    r = subprocess.run(
        [py, "-m", "detlogp_jax.golden"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pass" in r.stdout and " 0 fail, 0 new" in r.stdout and not r.stdout.count(" 0 pass,")
    assert os.listdir(elsewhere) == []


def test_an_h100_replays_the_h200_records(monkeypatch):
    """The records key names what decides the bits (platform, compute capability, contract,
    jax, backend), not the device's name: an H100 (cc 9.0, the same sm_90 instructions) finds
    the packaged H200 records of both the contract and the entropy."""
    from detlogp_jax import backends
    from detlogp_jax.apps import golden as g

    db = g.load()
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        info = {"platform": "gpu", "device_kind": kind, "compute_capability": "9.0"}
        monkeypatch.setattr(backends, "platform_info", lambda info=info: info)
        assert g.platform_key("pallas_sm90") in db, (kind, sorted(db))
        assert g.entropy_key("pallas_sm90") in db
    monkeypatch.setattr(
        backends, "platform_info", lambda: {"platform": "gpu", "device_kind": "A100", "compute_capability": "8.0"}
    )
    assert g.platform_key("pallas_sm90") not in db  # another instruction set: no record
