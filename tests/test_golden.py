"""Golden fingerprints replay on this machine (CPU reference in CI; GPU keys on the device)."""

import jax
import pytest

from detlogp_jax import backends, golden


def test_golden_replay_matches_records():
    backend = backends.preferred()
    key = golden.platform_key(backend)
    if key not in golden.load():
        pytest.skip(f"no golden record for {key}; record with python -m detlogp_jax.golden --record")
    out = golden.replay(backend, log=lambda *_: None)
    results = out["results"]
    assert not [n for n, r in results.items() if r.startswith("FAIL")], results
    assert any(r == "pass" for r in results.values()), results


def test_golden_inputs_are_deterministic():
    a = golden.make_inputs(golden.CASES[0])
    b = golden.make_inputs(golden.CASES[0])
    assert all((x == y).all() for x, y in zip(a[:3], b[:3]))
