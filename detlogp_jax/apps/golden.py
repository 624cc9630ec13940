"""Golden fingerprints: sha256 of logp/lse bytes on a fixed, seeded input set.

Inputs are generated in-repo from seeds (numpy PCG64 + ml_dtypes bf16 rounding,
identical on every machine), never stored as files. Fingerprints are stored per
key `platform/cc/contract/jax/backend` in a JSON file (`platform_key` says why those fields;
an H100 replays the H200's records); the records
ship inside the package (`detlogp_jax/apps/data/fingerprints.json`, read with
`importlib.resources`, so an installed wheel replays them from any directory).
A replay reports, per case, pass / FAIL / new (no record for this key yet).

The per-row entropy (`linear-logp-entropy-v1`, CONTRACT.md section 9) has its own
records under its own key, `platform/cc/linear-logp-entropy-v1/jax/backend`
(field `entropy_sha256`), so the `linear-logp-contract-v1` records (and a replay by an
older version, which reads only those) are untouched. On a backend that produces the
entropy (`reference` and `pallas_sm90` both do) each case runs a second time with
`return_entropy=True`; its logp/lse must be the first run's bytes and its entropy must
match the entropy record. A backend without the entropy (a plugin that does not declare
it) skips the entropy records.

    python -m detlogp_jax.golden                       # replay on the best backend
    python -m detlogp_jax.golden --record --out FILE   # write the records + this machine's key to FILE
    python -m detlogp_jax.golden --fingerprints FILE   # replay against another records file
    python -m detlogp_jax.golden --backend reference --cases small_odd,decode_row

Exit status: 0 when every selected case that runs here passes (at least one);
1 when a case fails (other bytes, or served by another backend; entropy records
included); 2 when this machine's key has no record for a case (or an entropy
case has no entropy record, or nothing ran) and --record is not given, or
--record has no --out. Recording never rewrites the packaged file
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


def platform_key(backend: str, contract_id: str = contract.CONTRACT_ID) -> str:
    """The records key of this machine for `backend` (`contract_id`: the contract's, or
    `contract.ENTROPY_ID` for the entropy records).

    It names what decides the bits: the contract (the programs), the backend (the kernels),
    the platform and the compute capability (the instruction set the kernels run: an H100 and
    an H200 are both cc 9.0, the same sm_90 instructions, so they share records), and jax /
    jaxlib (pinned by the package: the compiler that lowers the kernels). The device's
    marketing name (memory size, SKU) is not part of it."""
    info = backends.platform_info()
    cc = info["compute_capability"] or "-"
    return f"{info['platform']}/cc{cc}/{contract_id}/jax{jax.__version__}/{backend}"


def entropy_key(backend: str) -> str:
    """The key of this machine's entropy records (`linear-logp-entropy-v1`) for `backend`."""
    return platform_key(backend, contract.ENTROPY_ID)


def produces_entropy(backend: str) -> bool:
    """Whether `backend` declares the entropy statistic (False for an unknown or broken plugin)."""
    try:
        return bool(backends.get(backend).entropy)
    except Exception:
        return False


def _sha(x) -> str:
    return hashlib.sha256(np.asarray(jax.device_get(x), np.float32).tobytes()).hexdigest()


def fingerprint_case(case: Case, backend: str, entropy: bool = False) -> dict:
    """sha256 of a case's logp/lse bytes (and, with `entropy`, of its entropy bytes from a
    second run with return_entropy=True, and whether that run's logp/lse bytes are the first's)."""
    h, w, t, b, temp = make_inputs(case)
    kw = dict(
        bias=b,
        temperature=temp if np.isscalar(temp) else jnp.asarray(temp),
        vocab_size=case.vocab,
        padded_vocab_size=case.padded,
        backend=backend,
    )
    out = dl.linear_logp(h, w, t, **kw)
    prov = dl.last_provenance()
    got = {"logp_sha256": _sha(out.logp), "lse_sha256": _sha(out.lse), "served_by": prov.backend}
    if entropy:
        ent = dl.linear_logp(h, w, t, return_entropy=True, **kw)
        got["entropy_sha256"] = _sha(ent.entropy)
        got["entropy_served_by"] = ent.provenance.backend
        got["entropy_same_logp_lse"] = (_sha(ent.logp), _sha(ent.lse)) == (got["logp_sha256"], got["lse_sha256"])
    return got


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

    Returns {"key", "results": {case: "pass" | "FAIL..." | "new" | "skipped..."},
    "entropy_key", "entropy_results" (the same for the entropy records; empty when the
    backend does not produce the entropy), "records"}.
    Keeps: a case served by another backend than `backend` is a FAIL and its bytes
    are never filed under this key; with `record`, "records" is `db` with this
    key's (and the entropy key's) served cases set to the bytes got here (other keys
    untouched); `db` is not modified and nothing is written (see `main --out`).
    """
    on_cpu = jax.devices()[0].platform == "cpu"
    db = load() if db is None else db
    key = platform_key(backend)
    ekey = entropy_key(backend)
    with_entropy = produces_entropy(backend)
    stored = dict(db.get(key, {}))
    e_stored = dict(db.get(ekey, {}))
    results, e_results = {}, {}
    for case in CASES:
        if cases and case.name not in cases:
            continue
        if case.gpu_only and on_cpu:
            results[case.name] = "skipped (gpu only)"
            continue
        got = fingerprint_case(case, backend, entropy=with_entropy)
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
        line = f"{case.name:24s} {results[case.name]:10s} logp={got['logp_sha256'][:16]} lse={got['lse_sha256'][:16]}"
        if with_entropy:
            e_results[case.name] = _entropy_status(got, backend, e_stored.get(case.name))
            if record and got["entropy_served_by"] == backend and got["entropy_same_logp_lse"]:
                e_stored[case.name] = {"entropy_sha256": got["entropy_sha256"]}
            line += f" entropy={got['entropy_sha256'][:16]} {e_results[case.name]}"
        log(line)
    records = db
    if record:
        records = dict(db, **{key: stored})
        if with_entropy and e_stored:
            records[ekey] = e_stored
    return {"key": key, "results": results, "entropy_key": ekey, "entropy_results": e_results, "records": records}


def _entropy_status(got: dict, backend: str, stored: dict | None) -> str:
    if got["entropy_served_by"] != backend:
        return f"FAIL (entropy served by {got['entropy_served_by']})"
    if not got["entropy_same_logp_lse"]:
        return "FAIL (return_entropy=True changed logp/lse bytes)"
    if stored is None:
        return "new"
    return "pass" if stored.get("entropy_sha256") == got["entropy_sha256"] else "FAIL"


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
    e_res = out["entropy_results"].values()
    e_pass, e_new = sum(r == "pass" for r in e_res), sum(r == "new" for r in e_res)
    e_fail = sum(r.startswith("FAIL") for r in e_res)
    info = backends.platform_info()
    print(f"key: {out['key']} (device: {info['device_kind']})")
    print(f"records: {source}")
    print(f"golden replay: {n_pass} pass, {n_fail} fail, {n_new} new")
    if produces_entropy(backend):
        print(f"entropy replay ({out['entropy_key']}): {e_pass} pass, {e_fail} fail, {e_new} new")
    else:
        print(f"entropy replay: skipped ({backend} does not produce the entropy)")
    if args.record:
        dump(out["records"], args.out)
        also = f" and {out['entropy_key']}" if out["entropy_results"] else ""
        print(f"recorded {out['key']}{also} into {args.out}")
    if n_fail or e_fail:
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
    if e_new:
        print(
            f"error: {e_new} case(s) without an entropy record for {out['entropy_key']}; nothing may pass "
            "unchecked (record with --record --out FILE)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
