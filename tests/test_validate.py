"""RL parity validator (`detlogp_jax.validate`) on CPU, small shapes."""

import json
import math
import os

import numpy as np
import pytest

import jax

from detlogp_jax import StrictModeError, CONTRACT_ID
from detlogp_jax.fingerprint import FingerprintMismatchError
from detlogp_jax.validate import ValidateConfig, compare_logp, render_markdown, run_validation

SMALL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "vocab_size": 500}  # padded 512


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    # batch=1: the rollout scores one row per decode step (M=1). On XLA:CPU that
    # takes a matrix-vector path whose sums differ from the trainer's packed
    # matrix-matrix product, so the XLA baseline shows drift; the contract lane must not.
    out = tmp_path_factory.mktemp("validate")
    cfg = ValidateConfig(
        batch=1, steps=12, strict=True, seed=3, top_k=50, top_p=0.95, temperature=0.8,
        out_dir=str(out), name="validate_test", progress=False, model_overrides=SMALL,
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


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the drift case is built for XLA:CPU")
def test_xla_baseline_drifts(report):
    xa = _row(report, "baseline", "(a)")
    assert xa["backend"] == "xla"
    assert xa["mismatch_count"] > 0 and xa["max_abs_diff"] > 0 and xa["max_abs_k3"] > 0


def test_replay_fingerprints_provenance(report):
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


def test_end_to_end_row_present(report):
    e2e = _row(report, "contract", "(b)")
    assert e2e["rows"] == 12
    # Drift here can only come from the body: the operator row is exact.
    hd = report["hidden_state_drift"]
    if e2e["mismatch_count"]:
        assert hd["rows_differ"] > 0


def test_report_files(report):
    files = report["files"]
    assert os.path.exists(files["markdown"]) and os.path.exists(files["json"])
    with open(files["json"]) as fh:
        js = json.load(fh)
    assert js["command"].startswith("run_validation(ValidateConfig(")
    assert js["rows"][0]["mismatch_count"] == 0
    md = open(files["markdown"]).read()
    assert "| contract | reference | (a) operator" in md and "## Claims" in md
    assert render_markdown(report).startswith("# RL parity validation")


def test_fingerprint_mismatch_raises():
    cfg = ValidateConfig(batch=1, steps=2, out_dir=None, progress=False, baseline=False,
                         model_overrides=SMALL, corrupt_trainer_weight=True)
    with pytest.raises(FingerprintMismatchError, match="fingerprint mismatch"):
        run_validation(cfg)


def test_strict_refuses_xla_lane():
    cfg = ValidateConfig(backend="xla", strict=True, batch=1, steps=1, out_dir=None, progress=False,
                         baseline=False, model_overrides=SMALL)
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
