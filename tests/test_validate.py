"""RL parity validation (`detlogp_jax.apps.parity`, `python -m detlogp_jax.validate`) on CPU, tiny shapes."""

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from detlogp_jax import CONTRACT_ID, StrictModeError
from detlogp_jax.apps import parity
from detlogp_jax.apps.metrics import compare_logp, per_step
from detlogp_jax.apps.parity import ValidateConfig, resolve_config, run_validation
from detlogp_jax.apps.report import render_markdown
from detlogp_jax.fingerprint import FingerprintMismatchError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    # batch=1: the rollout scores one row per decode step (M=1). On XLA:CPU that
    # takes a matrix-vector path whose sums differ from the trainer's packed
    # matrix-matrix product, so the XLA baseline shows drift; the contract lane must not.
    out = tmp_path_factory.mktemp("validate")
    cfg = ValidateConfig(
        preset="tiny",
        batch=1,
        steps=12,
        seed=3,
        top_k=50,
        top_p=0.95,
        temperature=0.8,
        out_dir=str(out),
        name="validate_test",
        progress=False,
    )
    return run_validation(cfg)


def _row(report, lane, check):
    return next(r for r in report["rows"] if r["lane"] == lane and r["check"].startswith(check))


def test_operator_row_exactly_zero(report):
    op = _row(report, "contract", "(a)")
    assert op["rows"] == 12
    assert op["mismatch_count"] == 0
    assert op["max_abs_diff"] == 0.0
    assert op["max_abs_k3"] == 0.0
    assert op["nonfinite"] == 0
    assert report["claims"][0]["status"] == "PASS"
    assert report["per_step"]["contract_a"] == {"mismatch": [0] * 12, "max_abs_k3": [0.0] * 12}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the drift case is built for XLA:CPU")
def test_xla_baseline_drifts(report):
    xa = _row(report, "baseline", "(a)")
    assert xa["backend"] == "xla"
    assert xa["mismatch_count"] > 0 and xa["max_abs_diff"] > 0 and xa["max_abs_k3"] > 0
    assert sum(report["per_step"]["xla_a"]["mismatch"]) == xa["mismatch_count"]


def test_replay_fingerprints_provenance(report):
    assert report["config"]["strict"] is True  # the default
    assert report["replay"] == {"bit_exact": 12, "rows": 12}
    assert report["fingerprints"]["equal"]
    assert report["fallbacks"] == []
    prov = report["provenance"]
    for role in ("rollout_serve", "rollout_logp", "trainer", "trainer_replay_logits"):
        assert prov[role]["backend"] == "reference" and prov[role]["contract_id"] == CONTRACT_ID
        assert prov[role]["fallback"] is False
    assert prov["baseline_rollout"]["backend"] == prov["baseline_trainer"]["backend"] == "xla"
    assert report["ok"]
    assert all(c["status"] in ("PASS", "INFO", "DRIFT (body)") for c in report["claims"])


def test_entropy_rows_exact(report):
    """The reference backend produces the entropy: the trainer's entropy bytes of the packed,
    shuffled rows equal the rollout's (one call with the logp there, a second call here)."""
    assert report["config"]["entropy"] is True
    a, b = report["entropy_rows"]
    assert a["rows"] == 12 and a["mismatch_count"] == 0 and a["max_abs_diff"] == 0.0 and a["nonfinite"] == 0
    claim = next(c for c in report["claims"] if c["key"] == "entropy")
    assert claim["status"] == "PASS" and "entropy rows exact (12/12 bit-equal)" in report["verdict"]
    prov = report["provenance"]
    assert prov["trainer_entropy"]["entropy_id"] == "linear-logp-entropy-v1"
    assert prov["rollout_logp"]["entropy_id"] == "linear-logp-entropy-v1" and prov["trainer"]["entropy_id"] is None
    if b["mismatch_count"]:  # end to end: only the body can move the entropy
        assert report["hidden_state_drift"]["rows_differ"] > 0


def test_entropy_off_where_the_backend_has_none(monkeypatch):
    from detlogp_jax import backends

    monkeypatch.setattr(parity, "hopper_available", lambda: True)
    assert resolve_config(ValidateConfig(out_dir=None)).entropy is True  # pallas_sm90 declares it
    be = backends.get("pallas_sm90")
    monkeypatch.setitem(backends._LOADED, "pallas_sm90", type(be)(**{**be.__dict__, "entropy": False}))
    assert resolve_config(ValidateConfig(out_dir=None)).entropy is False  # a backend without it
    assert resolve_config(ValidateConfig(backend="reference", out_dir=None)).entropy is True
    assert resolve_config(ValidateConfig(backend="reference", entropy=False, out_dir=None)).entropy is False


def test_end_to_end_exact_with_the_invariant_body(report):
    """The default body is batch invariant: the trainer's own forward (shuffled sequences, other
    batch sizes) gives the rollout's hidden states and logp bytes; the plain XLA body on the
    same tokens is row (c), whose drift is reported (it differs on XLA:CPU: decode and prefill
    attention shapes)."""
    assert report["config"]["body"] == "batch_invariant" and report["model"]["body"] == "batch_invariant"
    e2e = _row(report, "contract", "(b)")
    assert e2e["rows"] == 12 and e2e["mismatch_count"] == 0 and e2e["max_abs_k3"] == 0.0
    assert report["hidden_state_drift"]["rows_differ"] == 0
    by = {c["key"]: c for c in report["claims"]}
    assert by["end_to_end"]["status"] == "PASS" and by["xla_body"]["status"] == "INFO"
    xb = _row(report, "contract", "(c)")
    assert xb["rows"] == 12 and report["xla_body_hidden_drift"]["rows"] == 12
    assert report["xla_body_hidden_drift"]["rows_differ"] > 0
    assert len(report["per_step"]["body_xla"]["mismatch"]) == 12


def test_verdict_names_what_passed(report):
    v = report["verdict"]
    assert "\n" not in v and v.startswith("VERDICT: PASS -- ")
    for what in ("operator rows exact", "replay exact", "fingerprints equal", "no fallback"):
        assert what in v
    assert "end to end exact with the batch-invariant body too (0/12 rows differ)" in v
    assert "the plain XLA body on the same tokens drifts in" in v and "not the operator's" in v


@pytest.mark.slow
def test_plain_xla_body_run_reports_the_body_drift(tmp_path):
    """body="xla": no row (c); the end-to-end claim is informational ("DRIFT (body)" when only
    the body drifts) and the verdict says the operator is exact and the drift is the body's,
    with the number."""
    rep = run_validation(
        ValidateConfig(preset="tiny", batch=3, steps=4, body="xla", out_dir=None, progress=False, time_reps=0)
    )
    assert not any(r["check"].startswith("(c)") for r in rep["rows"])
    by = {c["key"]: c for c in rep["claims"]}
    assert "xla_body" not in by and rep["ok"]
    e2e = _row(rep, "contract", "(b)")
    if e2e["mismatch_count"]:
        assert by["end_to_end"]["status"] == "DRIFT (body)"
        assert "is the plain XLA body's: its decode and prefill hidden states differ in" in rep["verdict"]
        assert f"({e2e['mismatch_count']}/12 rows" in rep["verdict"]
    assert rep["hidden_state_drift"]["rows_differ"] > 0


def test_a_drifting_invariant_body_fails_the_run(report):
    """With the batch-invariant body, end-to-end drift is a failure, not information."""
    from detlogp_jax.apps.claims import build_claims

    rows = [dict(r) for r in report["rows"] if not r["check"].startswith("(c)")]
    rows[1]["mismatch_count"] = 2
    hidden = dict(report["hidden_state_drift"], rows_differ=2)
    claims = build_claims(
        rows, report["provenance"], [], report["fingerprints"], report["replay"], hidden, True, (), "batch_invariant"
    )
    assert next(c for c in claims if c["key"] == "end_to_end")["status"] == "FAIL"
    claims = build_claims(rows, report["provenance"], [], report["fingerprints"], report["replay"], hidden, True)
    assert next(c for c in claims if c["key"] == "end_to_end")["status"] == "DRIFT (body)"


def test_report_files(report):
    files = report["files"]
    for kind in ("markdown", "json", "png"):
        assert os.path.exists(files[kind]), kind
    assert open(files["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with open(files["json"]) as fh:
        js = json.load(fh)
    assert js["command"].startswith("run_validation(ValidateConfig(")
    assert js["rows"][0]["mismatch_count"] == 0
    assert js["files"] == files and js["verdict"] == report["verdict"]
    assert js["op_timing"]["op_ms"] > 0 and js["op_timing"]["xla_ms"] > 0 and js["op_timing"]["rows_per_call"] == 12
    md = open(files["markdown"]).read()
    assert "| contract | reference | (a) operator" in md and "## Claims" in md
    assert "`validate_test.png`" in md and md.rstrip().endswith(report["verdict"])
    assert render_markdown(report).startswith("# RL parity validation")


def test_defaults_off_hopper(monkeypatch):
    monkeypatch.setattr(parity, "hopper_available", lambda: False)
    cfg = resolve_config(ValidateConfig())
    assert (cfg.backend, cfg.preset, cfg.batch, cfg.steps, cfg.strict) == ("reference", "small", 16, 32, True)
    assert cfg.out_dir.startswith(parity.DEFAULT_RESULTS_DIR + os.sep) and not os.path.isabs(cfg.out_dir)
    assert resolve_config(cfg) == cfg  # idempotent
    explicit = resolve_config(
        ValidateConfig(backend="xla", preset="tiny", batch=2, steps=3, strict=False, out_dir=None)
    )
    assert (explicit.backend, explicit.preset, explicit.batch, explicit.steps, explicit.strict, explicit.out_dir) == (
        "xla",
        "tiny",
        2,
        3,
        False,
        None,
    )


def test_defaults_on_hopper(monkeypatch):
    monkeypatch.setattr(parity, "hopper_available", lambda: True)
    cfg = resolve_config(ValidateConfig(out_dir=None))
    assert (cfg.backend, cfg.preset, cfg.batch, cfg.steps, cfg.strict) == ("pallas_sm90", "qwen3_8b", 64, 128, True)


def test_git_rev_outside_a_checkout(monkeypatch, tmp_path):
    fake = tmp_path / "site-packages" / "detlogp_jax" / "apps" / "parity.py"
    monkeypatch.setattr(parity, "__file__", str(fake))
    assert parity.git_rev() is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert parity.git_rev() is None


def test_fingerprint_mismatch_raises():
    cfg = ValidateConfig(
        preset="tiny", batch=1, steps=2, out_dir=None, progress=False, baseline=False, corrupt_trainer_weight=True
    )
    with pytest.raises(FingerprintMismatchError, match="fingerprint mismatch"):
        run_validation(cfg)


def test_strict_refuses_xla_lane():
    cfg = ValidateConfig(backend="xla", preset="tiny", batch=1, steps=1, out_dir=None, progress=False, baseline=False)
    with pytest.raises(StrictModeError):
        run_validation(cfg)


def test_compare_logp_metrics():
    r = np.array([-1.0, -2.0, -3.0], np.float32)
    t = np.array([-1.0, np.nextafter(np.float32(-2.0), np.float32(0)), -2.5], np.float32)
    m = compare_logp(r, t)
    assert m["mismatch_count"] == 2 and m["rows"] == 3
    assert m["max_abs_diff"] == 0.5
    assert m["max_abs_k3"] == pytest.approx(math.exp(0.5) - 1 - 0.5, rel=1e-12)
    z = compare_logp(r, r.copy())
    assert z["mismatch_count"] == 0 and z["max_abs_diff"] == 0.0 and z["max_abs_k3"] == 0.0


def test_per_step_metrics():
    r = np.array([[-1.0, -2.0], [-3.0, -4.0]], np.float32)  # [B=2, S=2]
    t = r.copy()
    t[1, 0] = -3.5
    ps = per_step(r, t)
    assert ps["mismatch"] == [1, 0]
    assert ps["max_abs_k3"][0] == pytest.approx(math.exp(-0.5) - 1 + 0.5, rel=1e-12) and ps["max_abs_k3"][1] == 0.0


@pytest.mark.slow
def test_main_job_in_a_fresh_clone_writes_only_its_out_dir(tmp_path):
    """The CLI with its default out dir, in a fresh clone: report + PNG land there, git status stays empty."""
    if (
        shutil.which("git") is None
        or subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode
    ):
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", ROOT, str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("DETLOGP_BACKEND", "DETLOGP_STRICT")}
    env.update(PYTHONPATH=str(clone), JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "detlogp_jax.validate",
            "--preset",
            "tiny",
            "--batch",
            "2",
            "--steps",
            "3",
            "--time_reps",
            "1",
        ],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith("VERDICT: PASS -- ")
    assert "end to end exact with the batch-invariant body too" in lines[-1]
    runs = os.listdir(clone / parity.DEFAULT_RESULTS_DIR)
    assert len(runs) == 1
    out = clone / parity.DEFAULT_RESULTS_DIR / runs[0]
    assert sorted(os.listdir(out)) == ["validate_cpu_tiny.json", "validate_cpu_tiny.md", "validate_cpu_tiny.png"]
    started = next(ln for ln in lines if ln.startswith("[validate] report to be written:"))
    written = next(ln for ln in lines if ln.startswith("[validate] report written:"))
    assert started.split(": ", 1)[1] == written.split(": ", 1)[1]
    assert os.path.join(parity.DEFAULT_RESULTS_DIR, runs[0], "validate_cpu_tiny.png") in written
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True, check=True)
    assert status.stdout == "", status.stdout
    js = json.loads((out / "validate_cpu_tiny.json").read_text())
    assert js["ok"] and js["config"]["strict"] and js["config"]["backend"] == "reference"
    assert js["git_rev"] and not js["git_rev"].endswith("-dirty")


def test_verdict_on_an_operator_failure(report):
    import copy

    from detlogp_jax.apps.claims import verdict

    bad = copy.deepcopy(report)
    bad["rows"][0]["mismatch_count"] = 3
    next(c for c in bad["claims"] if c["key"] == "operator")["status"] = "FAIL"
    bad["ok"] = False
    v = verdict(bad)
    assert v.startswith("VERDICT: FAIL (operator) -- ") and "operator rows exact" not in v
    if bad["rows"][1]["mismatch_count"]:
        assert "not the body's alone" in v
