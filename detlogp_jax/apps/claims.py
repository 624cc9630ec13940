"""The parity validation's verdict: rows, claims, the report dict and its one-line summary.

Claims (in this order, each with a short `key`):

1. `operator`: the contract lane's row (a) is byte-exact (PASS/FAIL; N/A on a
   non-contract backend);
2. `same_backend`: rollout (serve + logp) and trainer ran the same backend and contract id;
3. `no_fallback`: no call site fell back (strict mode forbids it anyway);
4. `fingerprints`: the lm_head fingerprints are equal (checked before scoring);
5. `replay`: the sampler's processed logprob replays bit-exactly from the op's logits;
6. `end_to_end`: row (b), the run's own body. With the batch-invariant body it is
   PASS/FAIL (the body promises the bytes). With the plain XLA body: PASS, or
   "DRIFT (body)" (informational) when only the body drifts, i.e. row (a) is exact;
   "DRIFT" (a failure) otherwise;
7. `xla_body`: row (c), the plain XLA body end to end on the same tokens (INFO: what
   the invariant body removes), when it ran;
8. `baseline`: the XLA materialized lane's rows (INFO);
9. `entropy`: the trainer's entropy bytes of the packed rows (a) equal the rollout's
   (PASS/FAIL; N/A when the backend does not produce the entropy or it was not asked).

`report["ok"]` is True when no PASS/FAIL claim failed. These modules take the
run's stage results by duck typing (no import of `parity`, which imports this).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import jax
import jax.numpy as jnp

from detlogp_jax import backends
from detlogp_jax.apps.metrics import compare_logp, compare_values, per_step
from detlogp_jax.body import backends as body_backends

__all__ = ["build_rows", "build_entropy_rows", "build_claims", "build_report", "verdict"]

OP_CHECK = "(a) operator: rollout hidden states"
E2E_CHECK = "(b) end to end: trainer's own forward"
XLA_BODY_CHECK = "(c) end to end, plain XLA body"
BODY_NAMES = {"batch_invariant": "batch-invariant body", "xla": "plain XLA body"}


def _status(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def build_rows(rollout, scores, provenance: dict, xla_body=None) -> tuple[list[dict], dict[str, dict]]:
    """(rows, per_step): the byte comparisons of every lane x check, whole-run and per decode step.

    Keeps: rows[0] and rows[1] are the contract (or main) lane's (a) and (b),
    rows[2:4] the XLA baseline's when it ran, the last row (c) when the plain XLA
    body was compared (`check == XLA_BODY_CHECK`); per_step has one entry per row,
    keyed `<lane>_<a|b>` or `body_xla`, with B-row statistics for each of the S steps.
    """
    trainer = provenance.get("trainer", {})
    lane = "contract" if trainer.get("contract_bearing") else "main (non-contract)"
    be = trainer.get("backend")
    pairs = [
        (lane, be, OP_CHECK, "contract_a", rollout.logp, scores.logp_a),
        (lane, be, E2E_CHECK, "contract_b", rollout.logp, scores.logp_b),
    ]
    if rollout.xla_logp is not None:
        pairs += [
            ("baseline", "xla", OP_CHECK, "xla_a", rollout.xla_logp, scores.xla_logp_a),
            ("baseline", "xla", E2E_CHECK, "xla_b", rollout.xla_logp, scores.xla_logp_b),
        ]
    if xla_body is not None:
        pairs.append((lane, be, XLA_BODY_CHECK, "body_xla", xla_body.rollout_logp, xla_body.trainer_logp))
    rows = [dict(lane=ln, backend=b, check=chk, **compare_logp(r, t)) for ln, b, chk, _, r, t in pairs]
    steps = {key: per_step(r, t) for _, _, _, key, r, t in pairs}
    return rows, steps


def build_entropy_rows(rollout, scores) -> list[dict]:
    """The entropy's byte comparisons, rollout vs trainer, for (a) and (b) ([] when not compared)."""
    if getattr(rollout, "entropy", None) is None or getattr(scores, "entropy_a", None) is None:
        return []
    return [
        dict(check=OP_CHECK, **compare_values(rollout.entropy, scores.entropy_a)),
        dict(check=E2E_CHECK, **compare_values(rollout.entropy, scores.entropy_b)),
    ]


def _entropy_claim(entropy_rows, provenance) -> dict:
    claim = "Entropy: trainer entropy bytes == rollout entropy bytes for every sampled row (packed, shuffled)"
    if not entropy_rows:
        backend = provenance.get("trainer", {}).get("backend")
        return dict(
            key="entropy",
            claim=claim,
            status="N/A (not compared)",
            evidence=f"the entropy was not asked for ({backend} does not produce it, or entropy=False)",
        )
    a, b = entropy_rows
    exact = a["mismatch_count"] == 0 and a["nonfinite"] == 0
    return dict(
        key="entropy",
        claim=claim,
        status=_status(exact),
        evidence=f"(a) {a['mismatch_count']}/{a['rows']} rows differ (max_abs_diff={a['max_abs_diff']:.3g}); "
        f"(b) {b['mismatch_count']}/{b['rows']} (max_abs_diff={b['max_abs_diff']:.3g})",
    )


def _row(rows, check):
    return next((r for r in rows if r["check"] == check), None)


def build_claims(
    rows, provenance, fallbacks, fingerprints, replay, hidden, strict, entropy_rows=(), body="xla", xla_hidden=None
) -> list[dict]:
    """The claims table (see the module docstring); each claim has key, claim, status, evidence.
    body: the run's body ("batch_invariant" or "xla"); xla_hidden: row (c)'s hidden-state drift."""
    side_r, side_t = provenance.get("rollout_logp", {}), provenance.get("trainer", {})
    same_backend = (
        bool(side_r)
        and side_r.get("backend") == side_t.get("backend") == provenance.get("rollout_serve", {}).get("backend")
        and side_r.get("contract_id") == side_t.get("contract_id")
    )
    op, e2e = rows[0], rows[1]
    op_exact = op["mismatch_count"] == 0 and op["nonfinite"] == 0
    body_only = bool(e2e["mismatch_count"]) and op["mismatch_count"] == 0
    if body == "batch_invariant":
        e2e_status = _status(e2e["mismatch_count"] == 0 and e2e["nonfinite"] == 0)
    else:
        e2e_status = "PASS" if e2e["mismatch_count"] == 0 else "DRIFT (body)" if op["mismatch_count"] == 0 else "DRIFT"
    claims = [
        dict(
            key="operator",
            claim="Operator: trainer logp bytes == rollout logp bytes for every sampled token (packed, shuffled, other M)",
            status=_status(op_exact) if side_t.get("contract_bearing") else "N/A (non-contract backend)",
            evidence=f"{op['mismatch_count']}/{op['rows']} rows differ, max_abs_diff={op['max_abs_diff']:.3g}, "
            f"max|K3|={op['max_abs_k3']:.3g}",
        ),
        dict(
            key="same_backend",
            claim="Same backend and contract id on rollout (serve + logp) and trainer",
            status=_status(same_backend),
            evidence=f"rollout {side_r.get('backend')} / {side_r.get('contract_id')}; "
            f"trainer {side_t.get('backend')} / {side_t.get('contract_id')}",
        ),
        dict(
            key="no_fallback",
            claim="No fallback observed" + (" (strict mode)" if strict else ""),
            status=_status(not fallbacks),
            evidence="none" if not fallbacks else "; ".join(map(str, fallbacks)),
        ),
        dict(
            key="fingerprints",
            claim="lm_head fingerprints equal (checked before scoring)",
            status=_status(fingerprints["equal"]),
            evidence=f"rollout {fingerprints['rollout']}, trainer {fingerprints['trainer']}",
        ),
        dict(
            key="replay",
            claim="Sampler processed-logprob replay bit-exact (trainer replays from the op's logits, packed)",
            status=_status(replay["bit_exact"] == replay["rows"]),
            evidence=f"{replay['bit_exact']}/{replay['rows']} bit-exact",
        ),
        dict(
            key="end_to_end",
            claim=f"End to end with the {BODY_NAMES[body]} (trainer's own full-sequence forward, other batches)",
            status=e2e_status,
            evidence=(
                f"{e2e['mismatch_count']}/{e2e['rows']} logp rows differ (max|K3|={e2e['max_abs_k3']:.3g}); "
                f"hidden states differ in {hidden['rows_differ']}/{hidden['rows']} rows "
                f"(max_abs_diff={hidden['max_abs_diff']:.3g})"
                + ("; the operator row is exact, so this drift is the body's (attention/FFN)" if body_only else "")
            ),
        ),
    ]
    xb = _row(rows, XLA_BODY_CHECK)
    if xb is not None:
        claims.append(
            dict(
                key="xla_body",
                claim="End to end with the plain XLA body, same tokens (what the invariant body removes)",
                status="INFO",
                evidence=f"{xb['mismatch_count']}/{xb['rows']} logp rows differ (max|K3|={xb['max_abs_k3']:.3g}); "
                f"hidden states differ in {xla_hidden['rows_differ']}/{xla_hidden['rows']} rows "
                f"(max_abs_diff={xla_hidden['max_abs_diff']:.3g})",
            )
        )
    if len(rows) > 2 and rows[2]["lane"] == "baseline":
        xa, xb = rows[2], rows[3]
        claims.append(
            dict(
                key="baseline",
                claim="Baseline: XLA materialized logits (non-contract), same rows",
                status="INFO",
                evidence=f"operator {xa['mismatch_count']}/{xa['rows']} rows differ (max|K3|={xa['max_abs_k3']:.3g}); "
                f"end to end {xb['mismatch_count']}/{xb['rows']} (max|K3|={xb['max_abs_k3']:.3g})",
            )
        )
    claims.append(_entropy_claim(list(entropy_rows), provenance))
    return claims


def _claims_ok(claims) -> bool:  # DRIFT (body) is informational: the plain XLA body promises nothing
    return all(c["status"] in ("PASS", "INFO", "DRIFT (body)") or c["status"].startswith("N/A") for c in claims)


def verdict(report: dict[str, Any]) -> str:
    """One line: what passed (operator rows, replay, fingerprints, fallback) and where drift comes from."""
    by = {c["key"]: c for c in report["claims"]}
    op, e2e = report["rows"][0], report["rows"][1]
    rp, hd, prov = report["replay"], report["hidden_state_drift"], report["provenance"].get("trainer", {})
    parts = {
        "operator": f"operator rows exact ({op['rows'] - op['mismatch_count']}/{op['rows']} bit-equal, max|K3| 0)",
        "replay": f"replay exact ({rp['bit_exact']}/{rp['rows']})",
        "fingerprints": "fingerprints equal",
        "no_fallback": "no fallback" + (" (strict)" if report["config"]["strict"] else ""),
        "same_backend": f"same backend both sides ({prov.get('backend')}, {prov.get('contract_id')})",
    }
    if by.get("entropy", {}).get("status") in ("PASS", "FAIL"):
        ea = report["entropy_rows"][0]
        parts["entropy"] = f"entropy rows exact ({ea['rows'] - ea['mismatch_count']}/{ea['rows']} bit-equal)"
    passed = [parts[k] for k in parts if by[k]["status"] == "PASS"]
    failed = [k for k in parts if by[k]["status"] == "FAIL"]
    if by["operator"]["status"].startswith("N/A"):
        passed.insert(0, f"operator rows not contract-checked ({prov.get('backend')} is not contract-bearing)")
    if not report["ok"]:
        head = f"VERDICT: FAIL ({', '.join(failed) or by['end_to_end']['status']}) -- "
    elif by["operator"]["status"].startswith("N/A"):
        head = "VERDICT: NO CONTRACT CLAIM (non-contract backend) -- "
    else:
        head = "VERDICT: PASS -- "
    body = report["config"].get("body", "xla")
    name = BODY_NAMES[body]
    xb = _row(report["rows"], XLA_BODY_CHECK)
    if e2e["mismatch_count"] == 0:
        tail = f"end to end exact with the {name} too (0/{e2e['rows']} rows differ)"
        if xb is not None:
            xh = report["xla_body_hidden_drift"]
            tail += (
                f"; the plain XLA body on the same tokens drifts in {xb['mismatch_count']}/{xb['rows']} rows "
                f"(max|K3| {xb['max_abs_k3']:.3g}; its decode and prefill hidden states differ in "
                f"{xh['rows_differ']}/{xh['rows']} rows): that drift is the body's, not the operator's"
            )
    elif op["mismatch_count"] == 0:
        tail = (
            f"the operator is exact, so the end-to-end drift ({e2e['mismatch_count']}/{e2e['rows']} rows, "
            f"max|K3| {e2e['max_abs_k3']:.3g}) is the {name}'s: its decode and prefill hidden states differ in "
            f"{hd['rows_differ']}/{hd['rows']} rows"
            + (" (a FAILURE of the batch-invariant body)" if body == "batch_invariant" else "")
        )
    else:
        tail = (
            f"the op's own rows drift ({op['mismatch_count']}/{op['rows']}), so end-to-end drift "
            f"({e2e['mismatch_count']}/{e2e['rows']} rows) is not the body's alone"
        )
    return head + ", ".join(passed) + "; " + tail + "."


def _body_ops(cfg) -> dict[str, str] | None:
    """Which backend serves each invariant body op in this run (None for the plain XLA body)."""
    if cfg.body != "batch_invariant":
        return None
    resolve = lambda op: body_backends.preferred(op) if cfg.body_backend == "auto" else cfg.body_backend  # noqa: E731
    return {op: resolve(op) for op in body_backends.OPS}


def build_report(
    setup,
    rollout,
    scores,
    replay_exact: int,
    fallback_warnings: list[str],
    op_timing: dict | None,
    *,
    xla_body=None,
    command: str,
    git_rev: str | None,
) -> dict[str, Any]:
    """The report dict (JSON-ready) of one run; `report["verdict"]` is its one-line summary.

    Keeps the field names of the committed reports (benchmarks/results/*/main_job/*.json)
    and adds per_step, op_timing and verdict.
    """
    cfg, mcfg, P = setup.cfg, setup.mcfg, setup.prompt_len
    N = cfg.batch * cfg.steps
    provs = setup.rec.records
    fallbacks = [role for role, p in provs.items() if p.get("fallback")] + fallback_warnings
    rows, steps = build_rows(rollout, scores, provs, xla_body)
    fingerprints = {
        "rollout": rollout.fingerprint,
        "trainer": scores.fingerprint,
        "equal": rollout.fingerprint == scores.fingerprint,
    }
    replay = {"bit_exact": replay_exact, "rows": N}
    hidden = {"rows_differ": scores.hidden_rows_differ, "rows": N, "max_abs_diff": scores.hidden_max_abs_diff}
    entropy_rows = build_entropy_rows(rollout, scores)
    xla_hidden = None
    if xla_body is not None:
        xla_hidden = {
            "rows_differ": xla_body.hidden_rows_differ,
            "rows": N,
            "max_abs_diff": xla_body.hidden_max_abs_diff,
        }
    claims = build_claims(
        rows, provs, fallbacks, fingerprints, replay, hidden, cfg.strict, entropy_rows, cfg.body, xla_hidden
    )
    info = backends.platform_info()
    base = next((c for c in claims if c["key"] == "baseline"), None)
    if base is not None and info["platform"] == "cpu" and rows[2]["mismatch_count"] == 0:
        base["evidence"] += (
            "; on this CPU XLA's materialized logp happens to give a row the same bytes in both batches, so the "
            "lane cannot show the operator's drift here: with --batch 1 (one row per decode step, a matrix-vector "
            "product on XLA:CPU) it does, and on a GPU at any batch (an H200 moves a row's logp by up to 3.8e-5 "
            "between M=1 and a batch: benchmarks/results/h200/forward/fwd.json)"
        )
    report = {
        "tool": "detlogp_jax.validate",
        "command": command,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_rev": git_rev,
        "platform": {**info, "n_devices": jax.device_count(), "jax_version": jax.__version__},
        "config": dataclasses.asdict(cfg),
        "model": {
            "vocab_size": mcfg.vocab_size,
            "padded_vocab_size": mcfg.padded_vocab_size,
            "d_model": mcfg.d_model,
            "n_layers": mcfg.n_layers,
            "n_heads": mcfg.n_heads,
            "d_ff": mcfg.d_ff,
            "dtype": jnp.dtype(mcfg.dtype).name,
            "prompt_len": P,
            "seq_len": P + cfg.steps,
            "tp": cfg.tp,
            "body": cfg.body,
            "body_backend": cfg.body_backend,
            "body_ops": _body_ops(cfg),
        },
        "sampling_program": dataclasses.asdict(setup.program),
        "shapes": {
            "rollout_rows_per_step": cfg.batch,
            "trainer_rows": N,
            "trainer_order": "shuffled (seeded permutation)",
            "trainer_sequences_per_forward": cfg.trainer_batch,
        },
        "provenance": provs,
        "fallbacks": fallbacks,
        "fingerprints": fingerprints,
        "rows": rows,
        "entropy_rows": entropy_rows,
        "per_step": steps,
        "hidden_state_drift": hidden,
        "xla_body_hidden_drift": xla_hidden,
        "replay": replay,
        "op_timing": op_timing,
        "claims": claims,
        "ok": _claims_ok(claims),
    }
    report["verdict"] = verdict(report)
    return report
