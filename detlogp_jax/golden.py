"""Golden fingerprints: sha256 of logp/lse bytes on a fixed, seeded input set.

Inputs are generated in-repo from seeds (numpy PCG64 + ml_dtypes bf16 rounding,
identical on every machine), never stored as files. Fingerprints are stored per
key `platform/device_kind/cc/contract/jax/backend` in
`tests/golden/fingerprints.json`; a replay on any machine reports, per case,
pass / FAIL / new (no record for this key yet).

    python -m detlogp_jax.golden                 # replay on the best backend
    python -m detlogp_jax.golden --record        # add/refresh this machine's key
    python -m detlogp_jax.golden --backend reference --cases small_odd,decode_row
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import detlogp_jax as dl
from detlogp_jax import backends, contract

GOLDEN_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "golden", "fingerprints.json")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    m: int
    d: int
    v_rows: int  # weight rows
    vocab: int
    padded: int
    seed: int
    bias: bool = False
    temperature: str = "scalar"  # "scalar" (0.7) or "rows" (per-row values)
    gpu_only: bool = False  # too slow for the reference backend on a CPU


CASES = (
    Case("small_odd", m=37, d=192, v_rows=1000, vocab=997, padded=1024, seed=1, bias=True, temperature="rows"),
    Case("decode_row", m=1, d=256, v_rows=5120, vocab=5000, padded=5120, seed=2),
    Case("unpadded_weight", m=9, d=128, v_rows=1000, vocab=1000, padded=1024, seed=3, bias=True),
    Case("qwen3_8b_m64", m=64, d=4096, v_rows=152064, vocab=151936, padded=152064, seed=4, gpu_only=True),
    Case("qwen3_8b_unpadded_m8", m=8, d=4096, v_rows=151936, vocab=151936, padded=152064, seed=5, gpu_only=True),
)


def make_inputs(case: Case):
    """Deterministic inputs for a case (numpy; bf16 via ml_dtypes round-to-nearest-even)."""
    rng = np.random.default_rng(case.seed)
    h = (rng.standard_normal((case.m, case.d), dtype=np.float32) * 2.0).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((case.v_rows, case.d), dtype=np.float32) * 0.02 * 4).astype(ml_dtypes.bfloat16)
    t = rng.integers(0, case.vocab, case.m).astype(np.int32)
    if case.m > 2:
        t[1] = -100
        t[2] = case.vocab - 1
    b = (rng.standard_normal(case.v_rows, dtype=np.float32) * 0.5) if case.bias else None
    if case.temperature == "rows":
        temp = rng.uniform(0.3, 1.7, case.m).astype(np.float32)
    else:
        temp = 0.7
    return h, w, t, b, temp


def platform_key(backend: str) -> str:
    info = backends.platform_info()
    cc = info["compute_capability"] or "-"
    return f"{info['platform']}/{info['device_kind']}/cc{cc}/{contract.CONTRACT_ID}/jax{jax.__version__}/{backend}"


def fingerprint_case(case: Case, backend: str) -> dict:
    h, w, t, b, temp = make_inputs(case)
    out = dl.linear_logp(
        h, w, t, bias=b, temperature=temp if np.isscalar(temp) else jnp.asarray(temp),
        vocab_size=case.vocab, padded_vocab_size=case.padded, backend=backend,
    )
    logp = np.asarray(jax.device_get(out.logp), np.float32)
    lse = np.asarray(jax.device_get(out.lse), np.float32)
    prov = dl.last_provenance()
    return {
        "logp_sha256": hashlib.sha256(logp.tobytes()).hexdigest(),
        "lse_sha256": hashlib.sha256(lse.tobytes()).hexdigest(),
        "served_by": prov.backend,
    }


def load() -> dict:
    if not os.path.exists(GOLDEN_PATH):
        return {}
    with open(GOLDEN_PATH) as f:
        return json.load(f)


def replay(backend: str, cases=None, record: bool = False, log=print) -> dict:
    """Replays (or records) the golden set for `backend` on this machine."""
    on_cpu = jax.devices()[0].platform == "cpu"
    db = load()
    key = platform_key(backend)
    stored = db.get(key, {})
    results = {}
    for case in CASES:
        if cases and case.name not in cases:
            continue
        if case.gpu_only and on_cpu:
            results[case.name] = "skipped (gpu only)"
            continue
        got = fingerprint_case(case, backend)
        if got["served_by"] != backend:
            results[case.name] = f"FAIL (served by {got['served_by']})"
        elif case.name not in stored:
            results[case.name] = "new"
        elif {k: stored[case.name][k] for k in ("logp_sha256", "lse_sha256")} == {k: got[k] for k in ("logp_sha256", "lse_sha256")}:
            results[case.name] = "pass"
        else:
            results[case.name] = "FAIL"
        if record and got["served_by"] == backend:  # never file a fallback's bytes under this key
            stored[case.name] = {k: got[k] for k in ("logp_sha256", "lse_sha256")}
        log(f"{case.name:24s} {results[case.name]:10s} logp={got['logp_sha256'][:16]} lse={got['lse_sha256'][:16]}")
    if record:
        db[key] = stored
        os.makedirs(os.path.dirname(GOLDEN_PATH), exist_ok=True)
        with open(GOLDEN_PATH, "w") as f:
            json.dump(db, f, indent=1, sort_keys=True)
            f.write("\n")
    return {"key": key, "results": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None, help="default: the platform's preferred contract backend")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--record", action="store_true", help="store this machine's fingerprints")
    args = p.parse_args(argv)
    backend = args.backend or backends.preferred()
    cases = [c for c in args.cases.split(",") if c] or None
    out = replay(backend, cases, record=args.record)
    print(f"key: {out['key']}")
    failed = [n for n, r in out["results"].items() if r.startswith("FAIL")]
    print(f"golden replay: {sum(r == 'pass' for r in out['results'].values())} pass, {len(failed)} fail, "
          f"{sum(r == 'new' for r in out['results'].values())} new")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
