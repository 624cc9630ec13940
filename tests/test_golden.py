"""Golden fingerprints replay on this machine (CPU reference in CI; GPU keys on the device)."""

import hashlib

import jax
import numpy as np
import pytest

from detlogp_jax import backends, golden

# sha256 of the bytes of make_inputs() for the CPU cases: the seeded input set must not
# drift (a numpy or ml_dtypes change of generator or rounding would silently move it).
INPUTS_SHA256 = "831861155b11dc68ef84866f1e0cc50baa3370c5130f1bcf34cf7a45df66166f"


def test_golden_replay_matches_records():
    backend = backends.preferred()
    key = golden.platform_key(backend)
    if key not in golden.load():
        if jax.devices()[0].platform == "cpu":
            pytest.fail(f"no golden record for {key}: re-record with python -m detlogp_jax.golden --record "
                        "(after a contract or JAX version change)")
        pytest.skip(f"no golden record for {key}")
    out = golden.replay(backend, log=lambda *_: None)
    results = out["results"]
    assert not [n for n, r in results.items() if r.startswith("FAIL")], results
    assert any(r == "pass" for r in results.values()), results


def test_golden_inputs_are_pinned():
    h = hashlib.sha256()
    for case in golden.CASES[:3]:
        for a in golden.make_inputs(case):
            if a is not None:
                h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    assert h.hexdigest() == INPUTS_SHA256
