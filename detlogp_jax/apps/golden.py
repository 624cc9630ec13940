"""Golden fingerprints: sha256 of logp/lse bytes on a fixed, seeded input set.

Inputs are generated in-repo from seeds (numpy PCG64 + ml_dtypes bf16 rounding,
identical on every machine), never stored as files. Fingerprints are stored per
key `platform/device_kind/cc/contract/jax/backend` in a JSON file; the records
ship inside the package (`detlogp_jax/apps/data/fingerprints.json`, read with
`importlib.resources`, so an installed wheel replays them from any directory).
A replay reports, per case, pass / FAIL / new (no record for this key yet).

    python -m detlogp_jax.golden                       # replay on the best backend
    python -m detlogp_jax.golden --record --out FILE   # write the records + this machine's key to FILE
    python -m detlogp_jax.golden --fingerprints FILE   # replay against another records file
    python -m detlogp_jax.golden --backend reference --cases small_odd,decode_row

Exit status: 0 when every selected case that runs here passes (at least one);
1 when a case fails (other bytes, or served by another backend); 2 when this
machine's key has no record for a case (or nothing ran) and --record is not
given, or --record has no --out. Recording never rewrites the packaged file
unless --out names it; unchanged records keep their bytes (same JSON layout).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.resources
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import detlogp_jax as dl
from detlogp_jax import backends, contract

# The packaged records (package data of detlogp_jax.apps, declared in pyproject.toml).
PACKAGED = importlib.resources.files("detlogp_jax.apps").joinpath("data", "fingerprints.json")


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
        h,
        w,
        t,
        bias=b,
        temperature=temp if np.isscalar(temp) else jnp.asarray(temp),
        vocab_size=case.vocab,
        padded_vocab_size=case.padded,
        backend=backend,
    )
    logp = np.asarray(jax.device_get(out.logp), np.float32)
    lse = np.asarray(jax.device_get(out.lse), np.float32)
    prov = dl.last_provenance()
    return {
        "logp_sha256": hashlib.sha256(logp.tobytes()).hexdigest(),
        "lse_sha256": hashlib.sha256(lse.tobytes()).hexdigest(),
        "served_by": prov.backend,
    }


def load(path=None) -> dict:
    """The records: `path` (a file the user names) or, by default, the packaged ones."""
    if path is None:
        return json.loads(PACKAGED.read_text())
    with open(path) as f:
        return json.load(f)


def dump(db: dict, path) -> None:
    """Writes records in the one layout they are kept in (indent 1, sorted keys, final newline)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(db, f, indent=1, sort_keys=True)
        f.write("\n")


def replay(backend: str, cases=None, record: bool = False, log=print, db: dict | None = None) -> dict:
    """Replays the golden set for `backend` on this machine against `db` (default: packaged).

    Returns {"key", "results": {case: "pass" | "FAIL..." | "new" | "skipped..."}, "records"}.
    Keeps: a case served by another backend than `backend` is a FAIL and its bytes
    are never filed under this key; with `record`, "records" is `db` with this
    key's served cases set to the bytes got here (other keys untouched); `db` is
    not modified and nothing is written (see `main --out`).
    """
    on_cpu = jax.devices()[0].platform == "cpu"
    db = load() if db is None else db
    key = platform_key(backend)
    stored = dict(db.get(key, {}))
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
        elif {k: stored[case.name][k] for k in ("logp_sha256", "lse_sha256")} == {
            k: got[k] for k in ("logp_sha256", "lse_sha256")
        }:
            results[case.name] = "pass"
        else:
            results[case.name] = "FAIL"
        if record and got["served_by"] == backend:  # never file a fallback's bytes under this key
            stored[case.name] = {k: got[k] for k in ("logp_sha256", "lse_sha256")}
        log(f"{case.name:24s} {results[case.name]:10s} logp={got['logp_sha256'][:16]} lse={got['lse_sha256'][:16]}")
    records = dict(db, **{key: stored}) if record else db
    return {"key": key, "results": results, "records": records}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m detlogp_jax.golden", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backend", default=None, help="default: the platform's preferred contract backend")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument(
        "--fingerprints",
        default=None,
        metavar="FILE",
        help="records to replay against (default: the packaged detlogp_jax/apps/data/fingerprints.json)",
    )
    p.add_argument("--record", action="store_true", help="record this machine's fingerprints (needs --out)")
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="with --record: where the records (those read + this machine's key) are written",
    )
    return p


def main(argv=None) -> int:
    """The CLI; returns the exit status (0 pass, 1 a case failed, 2 no record / nothing replayed)."""
    args = _parser().parse_args(argv)
    if args.record and not args.out:
        print(
            "error: --record needs --out FILE (the packaged records are never rewritten in place; "
            "name the file to write, e.g. --out fingerprints.json)",
            file=sys.stderr,
        )
        return 2
    source = args.fingerprints or f"packaged {PACKAGED}"
    db = load(args.fingerprints)
    backend = args.backend or backends.preferred()
    cases = [c for c in args.cases.split(",") if c] or None
    out = replay(backend, cases, record=args.record, db=db)
    res = out["results"].values()
    n_pass, n_new = sum(r == "pass" for r in res), sum(r == "new" for r in res)
    n_fail = sum(r.startswith("FAIL") for r in res)
    print(f"key: {out['key']}")
    print(f"records: {source}")
    print(f"golden replay: {n_pass} pass, {n_fail} fail, {n_new} new")
    if args.record:
        dump(out["records"], args.out)
        print(f"recorded {out['key']} into {args.out}")
    if n_fail:
        return 1
    if args.record:
        return 0
    if out["key"] not in db:
        print(
            f"error: no golden record for this machine's key {out['key']} in {source}; known keys: "
            f"{sorted(db)}. Record one with --record --out FILE.",
            file=sys.stderr,
        )
        return 2
    if n_new or not n_pass:
        what = f"{n_new} case(s) without a record" if n_new else "no case replayed here"
        print(
            f"error: {what} for {out['key']}; nothing may pass unchecked (record with --record --out FILE)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
