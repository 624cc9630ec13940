"""The ws kernel's swizzled hand-off on small odd shapes, against the chain-in-wgmma kernel.

  PYTHONPATH=. python3 -m benchmarks.experiments.handoff_check [--interpret] [--only swz8]

With the swizzled hand-off in both ws buckets, the H200's ladder stage A2 (N=7, D=192, V=1001,
bias, per-row T) once found the trainer entry's m/S differing from the serving entry's (a
missing barrier around the bias rewrite; docs/PERFORMANCE.md). This runs those shapes (and
neighbours: no bias, a vocab of whole tiles) through the shipped ws buckets ("swz8": two
swizzled [bm, 32] halves per tile, 8 slices per epilogue step), both entries, and counts the
rows whose m, S, z_t, logp, lse (and logits) bytes differ from the "small" bucket's
(`sm90_forward_wgmma`, no hand-off buffer). `--only` keeps the named variants (and the cases
with a bias). Exit status 1 when a run differs. `--interpret` (CPU, a check of the script: the
first case, the decode bucket) cannot show a race inside a warpgroup.
"""

from __future__ import annotations

import dataclasses
import sys

import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from detlogp_jax import contract as C
from detlogp_jax import oracle
from pallas_kernels import tuning

CASES = (
    # (name, N, D, V rows, vocab, bias)
    ("v1001_bias", 7, 192, 1001, 1001, True),
    ("v1001_nobias", 7, 192, 1001, 1001, False),
    ("v1024_bias", 7, 192, 1024, 1024, True),
    ("rows1000_v997_bias", 37, 192, 1000, 997, True),
)


def _variants(base):
    b = tuning.BUCKETS[base]
    return [dataclasses.replace(b, name=f"{base}_swz8")]


def _run(h, w, b, t, it, vocab, vp, bucket, logits, interpret):
    kw = dict(interpret=True, num_ctas=2) if interpret else {}
    out = pk.partials(h, w, b, t, it, vocab_size=vocab, padded_vocab_size=vp, bucket=bucket, return_logits=logits, **kw)
    logp, lse = pk.fold(out[0], out[1], out[2], t, it, vocab, **({"interpret": True} if interpret else {}))
    return [np.asarray(x) for x in (out[0], out[1], out[2], logp, lse)], (
        None if out[4] is None else np.asarray(out[4])
    )


def _rows(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    d = a.view(np.uint32) != b.view(np.uint32)
    return int(d.reshape(d.shape[0], -1).any(axis=1).sum()) if d.ndim else int(d)


def main(argv):
    interpret = "--interpret" in argv
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else None
    cases = [c for c in CASES if c[5]] if only else CASES
    bad = 0
    # interpret mode (a CPU check of this script): the first case, the decode bucket's variants
    for name, n, d, v_rows, vocab, bias in cases[:1] if interpret else cases:
        rng = np.random.default_rng(n + v_rows)
        vp = C.canonical_padded_vocab(vocab)
        h = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((v_rows, d)) * (2.0 / np.sqrt(d)), jnp.bfloat16)
        b = jnp.asarray(rng.standard_normal(v_rows), jnp.float32) if bias else None
        t = jnp.asarray(rng.integers(0, vocab, n), jnp.int32)
        it = jnp.asarray(oracle.inv_temperature(rng.uniform(0.5, 1.5, n).astype(np.float32), n))
        ref, ref_lg = _run(h, w, b, t, it, vocab, vp, "small", True, interpret)
        for base in ("decode",) if interpret else ("decode", "prefill"):
            for cfg in [c for c in _variants(base) if only is None or c.name.split("_", 1)[1] in only]:
                for logits in (False, True):
                    out, lg = _run(h, w, b, t, it, vocab, vp, cfg, logits, interpret)
                    diff = {
                        k: _rows(x.T if x.ndim == 2 else x, y.T if y.ndim == 2 else y)
                        for k, x, y in zip(("m", "s", "z_t", "logp", "lse"), out, ref)
                    }
                    if lg is not None:
                        diff["logits"] = _rows(lg[:, :vocab], ref_lg[:, :vocab])
                    n_bad = sum(diff.values())
                    bad += n_bad > 0
                    entry = "serving" if logits else "trainer"
                    print(f"{name:20s} {cfg.name:22s} {entry:8s} {'same' if not n_bad else 'DIFF'} {diff}", flush=True)
    print(f"{bad} variant runs differ from the small bucket")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
