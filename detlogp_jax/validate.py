"""RL parity validation: does the trainer get the rollout's logp bytes?

    python -m detlogp_jax.validate [--backend auto] [--preset small|qwen3_8b]
        [--batch 64|16] [--steps 128|32] [--temperature 1.0 --top_k 0 --top_p 1.0 --min_p 0.0]
        [--seed 0] [--tp 1] [--strict] [--out_dir benchmarks/results]

A small random Flax NNX decoder LM (`detlogp_jax.toy_lm`, lm_head = `LogpHead`)
plays both sides of an RL step:

* ROLLOUT: a decode loop, one token per sequence per step (M = batch rows),
  KV cache. At each sampled position it records the final hidden state, takes
  the serving entry's FP32 logits (`return_logits=True`), samples a token with
  the `SamplingProgram` (per-row keys), records the contract logp of the
  sampled token from the op (targets = sampled token), the sampler's processed
  logprob, and (baseline lane) the XLA-materialized logp of the same token.
  It fingerprints the lm_head once.
* TRAINER: takes a copy of the weights, checks the fingerprint first
  (mismatch -> `FingerprintMismatchError`), then re-scores every sampled
  token in ONE packed, shuffled batch (M = batch * steps rows, another order)
  with the trainer entry (`return_logits=False`):
  (a) operator: given the rollout's own hidden states;
  (b) end to end: with hidden states from its own teacher-forced causal
      full-sequence forward of the body.
  Both again with the XLA materialized baseline (`backend="xla"`).
  It also replays the sampler's processed logprob from the op's logits.

Rows report mismatch_count (rows whose logp bytes differ), max_abs_diff and
max |K3| with rho = exp(logp_trainer - logp_rollout), K3 = rho - 1 - log(rho)
(float64, from the two float32 values). Drift in (b) but not in (a) is the
body's (attention/FFN), not the operator's. Writes `validate_<platform>_<preset>
.md/.json` (claims table, exact command) into --out_dir.

`run_validation(ValidateConfig(...)) -> dict` is the importable entry.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import sys
import time
import warnings
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx

from detlogp_jax import api
from detlogp_jax import backends
from detlogp_jax import contract as C
from detlogp_jax import fingerprint as fp_lib
from detlogp_jax import sampling
from detlogp_jax.toy_lm import ToyLM, ToyLMConfig

__all__ = ["PRESETS", "ValidateConfig", "run_validation", "write_reports", "render_markdown", "compare_logp"]

PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized: the reference backend walks K sequentially, keep D and V small.
    "small": dict(vocab_size=1900, padded_vocab_size=2048, d_model=64, n_layers=2, n_heads=4, d_ff=128, dtype="float32", prompt_len=4),
    # Qwen3-8B's lm_head shape (D=4096, vocab 151936 padded 152064, bf16) on a light one-block body.
    "qwen3_8b": dict(vocab_size=151936, padded_vocab_size=152064, d_model=4096, n_layers=1, n_heads=32, d_ff=4096, dtype="bfloat16", prompt_len=8),
}


@dataclasses.dataclass
class ValidateConfig:
    backend: str = "auto"
    preset: str | None = None  # None: small on CPU, qwen3_8b on GPU
    batch: int | None = None  # None: 64 on GPU, 16 on CPU
    steps: int | None = None  # None: 128 on GPU, 32 on CPU
    tp: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    out_dir: str | None = "benchmarks/results"  # None: write nothing
    strict: bool = False
    baseline: bool = True  # also run the XLA materialized lane
    replay_chunk: int = 256  # rows per replay call (bit-neutral)
    name: str | None = None  # report basename (default validate_<platform>_<preset>)
    command: str | None = None  # the exact command line, recorded in the report
    progress: bool = True
    model_overrides: dict = dataclasses.field(default_factory=dict)  # e.g. {"d_model": 32}
    corrupt_trainer_weight: bool = False  # test hook: flip one bit of the trainer's lm_head copy


# -- metrics -------------------------------------------------------------------------------


def _bits(x):
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def compare_logp(rollout, trainer) -> dict[str, Any]:
    """Row metrics between two float32 logp vectors (one value per row)."""
    r = np.asarray(rollout, np.float32).reshape(-1)
    t = np.asarray(trainer, np.float32).reshape(-1)
    if r.shape != t.shape:
        raise ValueError(f"shape mismatch {r.shape} vs {t.shape}")
    mismatch = int(np.count_nonzero(_bits(r) != _bits(t)))
    with np.errstate(invalid="ignore", over="ignore"):
        d = t.astype(np.float64) - r.astype(np.float64)
        k3 = np.expm1(d) - d  # rho - 1 - log(rho), rho = exp(d)
    finite = np.isfinite(d)
    nonfinite = int(r.size - np.count_nonzero(finite))
    max_abs = float(np.max(np.abs(d[finite]))) if finite.any() else 0.0
    max_k3 = float(np.max(np.abs(k3[finite]))) if finite.any() else 0.0
    return {
        "rows": int(r.size),
        "mismatch_count": mismatch,
        "max_abs_diff": max_abs,
        "max_abs_k3": max_k3,
        "nonfinite": nonfinite,
    }


def _row_mismatch(a, b) -> tuple[int, float]:
    a = np.asarray(a, np.float32).reshape(a.shape[0], -1)
    b = np.asarray(b, np.float32).reshape(b.shape[0], -1)
    rows = int(np.count_nonzero((_bits(a) != _bits(b)).any(axis=1)))
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    d = d[np.isfinite(d)]
    return rows, float(d.max()) if d.size else 0.0


# -- progress ------------------------------------------------------------------------------


class _Progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()

    def step(self, what: str, i: int, n: int):
        if not self.enabled:
            return
        every = max(1, n // 16)
        if self.tty:
            sys.stderr.write(f"\r[validate] {what} step {i}/{n}")
            if i == n:
                sys.stderr.write("\n")
        elif i == n or i % every == 0 or i == 1:
            sys.stderr.write(f"[validate] {what} step {i}/{n}\n")
        sys.stderr.flush()

    def note(self, msg: str):
        if self.enabled:
            sys.stderr.write(f"[validate] {msg}\n")
            sys.stderr.flush()


# -- provenance capture ------------------------------------------------------------------------


def _prov_record(p: C.Provenance | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {
        "backend": p.backend,
        "contract_id": p.contract_id,
        "contract_bearing": p.contract_bearing,
        "requested_backend": p.requested_backend,
        "fallback": p.fallback,
        "vocab_size": p.vocab_size,
        "padded_vocab_size": p.padded_vocab_size,
        "n_split": p.n_split,
        "platform": p.platform,
        "device_kind": p.device_kind,
    }


class _Recorder:
    """Collects `last_provenance()` right after each traced op call, by role."""

    def __init__(self):
        self.records: dict[str, dict[str, Any]] = {}

    def mark(self, role: str):
        rec = _prov_record(api.last_provenance())
        if rec is not None:
            self.records[role] = rec


def _lane_ctx(strict: bool, contract_lane: bool):
    # The baseline lane is non-contract by design: it runs outside strict mode.
    return backends.strict_mode(strict if contract_lane else False)


# -- the run --------------------------------------------------------------------------------


def _resolve_preset(cfg: ValidateConfig) -> str:
    if cfg.preset is not None:
        if cfg.preset not in PRESETS:
            raise ValueError(f"unknown preset {cfg.preset!r}; choose from {sorted(PRESETS)}")
        return cfg.preset
    return "small" if jax.default_backend() == "cpu" else "qwen3_8b"


def _model_config(preset: str, cfg: ValidateConfig, head_backend: str) -> tuple[ToyLMConfig, int]:
    p = dict(PRESETS[preset])
    p.update(cfg.model_overrides)
    prompt_len = int(p.pop("prompt_len"))
    dtype = jnp.dtype(p.pop("dtype"))
    if "padded_vocab_size" not in cfg.model_overrides and "vocab_size" in cfg.model_overrides:
        p["padded_vocab_size"] = C.canonical_padded_vocab(p["vocab_size"])
    mcfg = ToyLMConfig(
        max_len=prompt_len + cfg.steps,
        dtype=dtype,
        backend=head_backend,
        **p,
    )
    return mcfg, prompt_len


def _make_mesh(tp: int):
    if tp == 1:
        return None
    devs = jax.devices()
    if len(devs) < tp:
        raise ValueError(f"--tp {tp} needs {tp} devices, found {len(devs)}")
    return jax.sharding.Mesh(np.asarray(devs[:tp]), ("tp",))


def _flip_one_bit(x):
    a = np.array(x)
    flat = a.reshape(-1).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)
    flat[0] ^= 1
    return jnp.asarray(a)


def run_validation(config: ValidateConfig) -> dict[str, Any]:
    """Runs rollout + trainer, returns the report dict (and writes it if out_dir is set)."""
    on_cpu = jax.default_backend() == "cpu"
    cfg = dataclasses.replace(
        config,
        batch=config.batch or (16 if on_cpu else 64),
        steps=config.steps or (32 if on_cpu else 128),
    )
    t_start = time.perf_counter()
    prog = _Progress(cfg.progress)
    preset = _resolve_preset(cfg)
    program = sampling.SamplingProgram(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
    temperature = float(program.temperature)
    mesh = _make_mesh(cfg.tp)
    head_kwargs = {} if mesh is None else {"mesh": mesh, "tp_axis": "tp"}
    mcfg, prompt_len = _model_config(preset, cfg, cfg.backend)
    B, S, P = int(cfg.batch), int(cfg.steps), prompt_len
    L = P + S
    if B < 1 or S < 1:
        raise ValueError("batch and steps must be >= 1")
    rec = _Recorder()
    fallback_warnings: list[str] = []
    timings: dict[str, float] = {}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        prog.note(
            f"preset={preset} D={mcfg.d_model} V={mcfg.vocab_size} (padded {mcfg.padded_vocab_size}) "
            f"dtype={jnp.dtype(mcfg.dtype).name} batch={B} steps={S} backend={cfg.backend} strict={cfg.strict}"
        )
        model = ToyLM(mcfg, rngs=nnx.Rngs(cfg.seed), head_kwargs=head_kwargs)
        key = jax.random.key(cfg.seed)
        k_prompt, k_sample, k_perm = jax.random.split(key, 3)
        prompt = jax.random.randint(k_prompt, (B, P), 0, mcfg.vocab_size, jnp.int32)
        timings["init_s"] = time.perf_counter() - t0

        # ---------------- ROLLOUT ----------------
        fp_rollout = model.head.fingerprint()

        @nnx.jit
        def decode(m, tok, pos, cache):
            return m.decode(tok, pos, cache)

        @nnx.jit
        def serve(m, h, pos):
            rows = jnp.arange(h.shape[0])
            keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(k_sample, b), pos))(rows)
            with _lane_ctx(cfg.strict, True):
                logits = m.head.logits(h)  # serving entry: FP32 logits [B, V]
                rec.mark("rollout_serve")
                res = sampling.sample(
                    logits, program, keys,
                    logp_from_op=lambda tok: m.head(h, tok, temperature=temperature).logp,
                )
                rec.mark("rollout_logp")
            xla_logp = None
            if cfg.baseline:
                with _lane_ctx(cfg.strict, False):
                    xla_logp = m.head(h, res.token, temperature=temperature, backend="xla").logp
                    rec.mark("baseline_rollout")
            return res.token, res.processed_logprob, res.logp, xla_logp

        t0 = time.perf_counter()
        cache = model.init_cache(B)
        seq = [prompt[:, i] for i in range(P)]
        hs, toks, logps, plogps, xlogps = [], [], [], [], []
        for pos in range(P - 1):  # prefill, one token per step, teacher forced
            _, cache = decode(model, seq[pos], jnp.int32(pos), cache)
        for i in range(S):
            pos = P - 1 + i
            h, cache = decode(model, seq[pos], jnp.int32(pos), cache)
            tok, plp, lp, xlp = serve(model, h, jnp.int32(pos))
            seq.append(tok)
            hs.append(h)
            toks.append(tok)
            logps.append(lp)
            plogps.append(plp)
            xlogps.append(xlp)
            prog.step("rollout", i + 1, S)
        tokens_full = jnp.stack(seq, axis=1)  # [B, L]
        H_roll = np.asarray(jnp.stack(hs, axis=1))  # [B, S, D]
        tok_roll = np.asarray(jnp.stack(toks, axis=1))  # [B, S]
        logp_roll = np.asarray(jnp.stack(logps, axis=1), np.float32)
        plogp_roll = np.asarray(jnp.stack(plogps, axis=1), np.float32)
        xlogp_roll = np.asarray(jnp.stack(xlogps, axis=1), np.float32) if cfg.baseline else None
        timings["rollout_s"] = time.perf_counter() - t0

        # ---------------- TRAINER ----------------
        t0 = time.perf_counter()
        graphdef, state = nnx.split(model)
        state = jax.tree.map(lambda a: jnp.array(a, copy=True), state)  # the trainer's own copy
        trainer = nnx.merge(graphdef, state)
        if cfg.corrupt_trainer_weight:
            trainer.head.kernel[...] = _flip_one_bit(trainer.head.kernel[...])
        fp_trainer = trainer.head.fingerprint()
        fp_lib.check_fingerprints(fp_rollout, fp_trainer, what="lm_head (rollout vs trainer)")

        N = B * S
        perm = np.asarray(jax.random.permutation(k_perm, N))
        inv = np.empty_like(perm)
        inv[perm] = np.arange(N)
        tgt_packed = jnp.asarray(tok_roll.reshape(N)[perm])

        @nnx.jit
        def score(m, h, t):
            with _lane_ctx(cfg.strict, True):
                out = m.head(h, t, temperature=temperature)  # trainer entry: no logits
                rec.mark("trainer")
            return out.logp

        @nnx.jit
        def score_xla(m, h, t):
            with _lane_ctx(cfg.strict, False):
                out = m.head(h, t, temperature=temperature, backend="xla")
                rec.mark("baseline_trainer")
            return out.logp

        @nnx.jit
        def full_hidden(m, tokens):
            return m.hidden(tokens)

        def unpack(x):
            return np.asarray(x, np.float32)[inv].reshape(B, S)

        # (a) operator: the rollout's hidden states, one packed shuffled batch.
        h_a = jnp.asarray(H_roll.reshape(N, -1)[perm])
        prog.note(f"trainer: scoring {N} packed rows (operator)")
        logp_a = unpack(score(trainer, h_a, tgt_packed))
        # (b) end to end: the trainer's own full-sequence forward.
        prog.note(f"trainer: full-sequence forward [{B}, {L}] + scoring (end to end)")
        H_tr = np.asarray(full_hidden(trainer, tokens_full))[:, P - 1 : P - 1 + S]  # [B, S, D]
        h_b = jnp.asarray(H_tr.reshape(N, -1)[perm])
        logp_b = unpack(score(trainer, h_b, tgt_packed))
        hid_rows, hid_mad = _row_mismatch(H_roll.reshape(N, -1), H_tr.reshape(N, -1))
        if cfg.baseline:
            prog.note("trainer: XLA baseline lane")
            xlogp_a = unpack(score_xla(trainer, h_a, tgt_packed))
            xlogp_b = unpack(score_xla(trainer, h_b, tgt_packed))
        timings["trainer_s"] = time.perf_counter() - t0

        # Replay of the sampler's processed logprob from the op's logits (packed, chunked).
        t0 = time.perf_counter()

        @nnx.jit
        def replay(m, h, t):
            with _lane_ctx(cfg.strict, True):
                logits = m.head.logits(h)
                rec.mark("trainer_replay_logits")
            return sampling.processed_logprob(logits, program, t)

        chunk = max(1, min(cfg.replay_chunk, N))
        rp = []
        for s in range(0, N, chunk):
            h_c, t_c = h_a[s : s + chunk], tgt_packed[s : s + chunk]
            n_c = h_c.shape[0]
            if n_c < chunk:  # fixed shape: pad rows (rows are independent)
                h_c = jnp.pad(h_c, ((0, chunk - n_c), (0, 0)))
                t_c = jnp.pad(t_c, (0, chunk - n_c))
            rp.append(np.asarray(replay(trainer, h_c, t_c))[:n_c])
            prog.step("replay", s // chunk + 1, -(-N // chunk))
        plogp_replay = unpack(np.concatenate(rp))
        replay_exact = int(np.count_nonzero(_bits(plogp_replay) == _bits(plogp_roll)))
        timings["replay_s"] = time.perf_counter() - t0

    for w in caught:
        msg = str(w.message)
        if "fall" in msg.lower():
            fallback_warnings.append(msg)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    # ---------------- REPORT ----------------
    main_be = rec.records.get("trainer", {}).get("backend")
    main_lane = "contract" if rec.records.get("trainer", {}).get("contract_bearing") else "main (non-contract)"
    rows = [
        dict(lane=main_lane, backend=main_be, check="(a) operator: rollout hidden states", **compare_logp(logp_roll, logp_a)),
        dict(lane=main_lane, backend=main_be, check="(b) end to end: trainer's own forward", **compare_logp(logp_roll, logp_b)),
    ]
    if cfg.baseline:
        rows += [
            dict(lane="baseline", backend="xla", check="(a) operator: rollout hidden states", **compare_logp(xlogp_roll, xlogp_a)),
            dict(lane="baseline", backend="xla", check="(b) end to end: trainer's own forward", **compare_logp(xlogp_roll, xlogp_b)),
        ]
    provs = rec.records
    fallbacks = [role for role, p in provs.items() if p.get("fallback")] + fallback_warnings
    side_r, side_t = provs.get("rollout_logp", {}), provs.get("trainer", {})
    same_backend = (
        bool(side_r)
        and side_r.get("backend") == side_t.get("backend") == provs.get("rollout_serve", {}).get("backend")
        and side_r.get("contract_id") == side_t.get("contract_id")
    )
    contract_bearing = bool(side_t.get("contract_bearing"))
    op = rows[0]
    e2e = rows[1]

    def status(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    claims = [
        {
            "claim": "Operator: trainer logp bytes == rollout logp bytes for every sampled token (packed, shuffled, other M)",
            "status": status(op["mismatch_count"] == 0 and op["nonfinite"] == 0) if contract_bearing else "N/A (non-contract backend)",
            "evidence": f"{op['mismatch_count']}/{op['rows']} rows differ, max_abs_diff={op['max_abs_diff']:.3g}, max|K3|={op['max_abs_k3']:.3g}",
        },
        {
            "claim": "Same backend and contract id on rollout (serve + logp) and trainer",
            "status": status(same_backend),
            "evidence": f"rollout {side_r.get('backend')} / {side_r.get('contract_id')}; trainer {side_t.get('backend')} / {side_t.get('contract_id')}",
        },
        {
            "claim": "No fallback observed" + (" (strict mode)" if cfg.strict else ""),
            "status": status(not fallbacks),
            "evidence": "none" if not fallbacks else "; ".join(map(str, fallbacks)),
        },
        {
            "claim": "lm_head fingerprints equal (checked before scoring)",
            "status": status(fp_rollout == fp_trainer),
            "evidence": f"rollout {fp_rollout}, trainer {fp_trainer}",
        },
        {
            "claim": "Sampler processed-logprob replay bit-exact (trainer replays from the op's logits, packed)",
            "status": status(replay_exact == N),
            "evidence": f"{replay_exact}/{N} bit-exact",
        },
        {
            "claim": "End to end (trainer's own full-sequence forward)",
            "status": "PASS" if e2e["mismatch_count"] == 0 else "DRIFT (body)" if op["mismatch_count"] == 0 else "DRIFT",
            "evidence": (
                f"{e2e['mismatch_count']}/{e2e['rows']} logp rows differ (max|K3|={e2e['max_abs_k3']:.3g}); "
                f"hidden states differ in {hid_rows}/{N} rows (max_abs_diff={hid_mad:.3g})"
                + ("; the operator row is exact, so this drift is the body's (attention/FFN)" if e2e["mismatch_count"] and op["mismatch_count"] == 0 else "")
            ),
        },
    ]
    if cfg.baseline:
        xa, xb = rows[2], rows[3]
        claims.append({
            "claim": "Baseline: XLA materialized logits (non-contract), same rows",
            "status": "INFO",
            "evidence": f"operator {xa['mismatch_count']}/{xa['rows']} rows differ (max|K3|={xa['max_abs_k3']:.3g}); "
            f"end to end {xb['mismatch_count']}/{xb['rows']} (max|K3|={xb['max_abs_k3']:.3g})",
        })

    info = backends.platform_info()
    report = {
        "tool": "detlogp_jax.validate",
        "command": cfg.command or f"run_validation({_config_repr(cfg)})",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_rev": _git_rev(),
        "platform": {**info, "n_devices": jax.device_count(), "jax_version": jax.__version__},
        "config": {**dataclasses.asdict(cfg), "preset": preset},
        "model": {
            "vocab_size": mcfg.vocab_size,
            "padded_vocab_size": mcfg.padded_vocab_size,
            "d_model": mcfg.d_model,
            "n_layers": mcfg.n_layers,
            "n_heads": mcfg.n_heads,
            "d_ff": mcfg.d_ff,
            "dtype": jnp.dtype(mcfg.dtype).name,
            "prompt_len": P,
            "seq_len": L,
            "tp": cfg.tp,
        },
        "sampling_program": dataclasses.asdict(program),
        "shapes": {"rollout_rows_per_step": B, "trainer_rows": N, "trainer_order": "shuffled (seeded permutation)"},
        "provenance": provs,
        "fallbacks": fallbacks,
        "fingerprints": {"rollout": fp_rollout, "trainer": fp_trainer, "equal": fp_rollout == fp_trainer},
        "rows": rows,
        "hidden_state_drift": {"rows_differ": hid_rows, "rows": N, "max_abs_diff": hid_mad},
        "replay": {"bit_exact": replay_exact, "rows": N},
        "claims": claims,
        "ok": all(c["status"] in ("PASS", "INFO", "DRIFT (body)") or c["status"].startswith("N/A") for c in claims),
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }
    report["timings_s"]["total_s"] = round(time.perf_counter() - t_start, 3)
    if cfg.out_dir:
        report["files"] = write_reports(report, cfg.out_dir, cfg.name or f"validate_{info['platform']}_{preset}")
    prog.note(f"done in {report['timings_s']['total_s']:.1f}s; ok={report['ok']}")
    return report


def _git_rev() -> str | None:
    """Short commit of the checkout this module runs from (+ "-dirty"), or None."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:
        return None


def _config_repr(cfg: ValidateConfig) -> str:
    default = ValidateConfig()
    parts = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
             if f.name != "command" and getattr(cfg, f.name) != getattr(default, f.name)]
    return "ValidateConfig(" + ", ".join(parts) + ")"


# -- output -----------------------------------------------------------------------------------


def _fmt(x) -> str:
    if isinstance(x, float):
        return "0.0" if x == 0 else f"{x:.3g}"
    return str(x)


def render_markdown(report: dict[str, Any]) -> str:
    m, c = report["model"], report["config"]
    prov = report["provenance"]
    lines = [
        f"# RL parity validation: {c['preset']} on {report['platform']['device_kind']}",
        "",
        "Command:",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"Date (UTC): {report['date_utc']}; code {report.get('git_rev') or 'unknown'}; JAX {report['platform']['jax_version']}; "
        f"platform {report['platform']['platform']} ({report['platform']['n_devices']} device(s)).",
        "",
        f"Model: random toy NNX decoder LM, D={m['d_model']}, vocab {m['vocab_size']} (padded {m['padded_vocab_size']}), "
        f"{m['n_layers']} block(s), {m['dtype']}, prompt {m['prompt_len']} + {c['steps']} sampled tokens, TP={m['tp']}. "
        f"Sampling program: {report['sampling_program']}.",
        f"Rollout: {report['shapes']['rollout_rows_per_step']} rows per decode step; trainer: "
        f"{report['shapes']['trainer_rows']} rows in one packed, shuffled batch.",
        "",
        "## Claims",
        "",
        "| # | claim | status | evidence |",
        "|---|---|---|---|",
    ]
    for i, cl in enumerate(report["claims"], 1):
        lines.append(f"| {i} | {cl['claim']} | **{cl['status']}** | {cl['evidence']} |")
    lines += [
        "",
        "## Rows (rollout logp vs trainer logp of the same sampled tokens)",
        "",
        "| lane | backend | check | rows | mismatch_count | max_abs_diff | max \\|K3\\| |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['lane']} | {r['backend']} | {r['check']} | {r['rows']} | {r['mismatch_count']} | "
            f"{_fmt(r['max_abs_diff'])} | {_fmt(r['max_abs_k3'])} |"
        )
    hd = report["hidden_state_drift"]
    lines += [
        "",
        f"Hidden states (rollout decode vs trainer full-sequence forward): {hd['rows_differ']}/{hd['rows']} rows differ "
        f"in bytes, max_abs_diff {_fmt(hd['max_abs_diff'])}.",
        f"Replay of the sampler's processed logprob: {report['replay']['bit_exact']}/{report['replay']['rows']} bit-exact.",
        "",
        "K3 = rho - 1 - log(rho), rho = exp(logp_trainer - logp_rollout), in float64 from the float32 values.",
        "",
        "## Provenance (`last_provenance()` at each call site)",
        "",
        "| call site | backend | contract id | fallback | requested |",
        "|---|---|---|---|---|",
    ]
    for role, p in prov.items():
        lines.append(f"| {role} | {p['backend']} | {p['contract_id']} | {p['fallback']} | {p['requested_backend']} |")
    f = report["fingerprints"]
    lines += [
        "",
        f"Fingerprints: rollout `{f['rollout']}`, trainer `{f['trainer']}` (equal: {f['equal']}). "
        f"Fallbacks: {report['fallbacks'] or 'none'}. Strict mode: {c['strict']}.",
        "",
        f"Timings (s): {report['timings_s']}",
        "",
    ]
    return "\n".join(lines)


def write_reports(report: dict[str, Any], out_dir: str, name: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    md_path = os.path.join(out_dir, name + ".md")
    js_path = os.path.join(out_dir, name + ".json")
    files = {"markdown": md_path, "json": js_path}
    rep = dict(report, files=files)
    with open(js_path, "w") as fh:
        json.dump(rep, fh, indent=2, default=str)
        fh.write("\n")
    with open(md_path, "w") as fh:
        fh.write(render_markdown(rep))
    return files


# -- CLI --------------------------------------------------------------------------------------


def _define_flags():
    from absl import flags

    flags.DEFINE_enum("backend", "auto", ["auto", "reference", "pallas_sm90", "xla"], "Backend of the contract lane.")
    flags.DEFINE_enum("preset", None, sorted(PRESETS), "Model preset (default: small on CPU, qwen3_8b on GPU).")
    flags.DEFINE_integer("batch", None, "Sequences (rollout rows per decode step; default 64 on GPU, 16 on CPU).")
    flags.DEFINE_integer("steps", None, "Decode steps (sampled tokens per sequence; default 128 on GPU, 32 on CPU).")
    flags.DEFINE_integer("tp", 1, "Tensor-parallel degree (needs sharding.linear_logp_tp for > 1).")
    flags.DEFINE_float("temperature", 1.0, "Sampling temperature (also the op's temperature).")
    flags.DEFINE_integer("top_k", 0, "Top-k (0 = off).")
    flags.DEFINE_float("top_p", 1.0, "Top-p (1 = off).")
    flags.DEFINE_float("min_p", 0.0, "Min-p (0 = off).")
    flags.DEFINE_integer("seed", 0, "Seed (model init, prompts, sampling keys, trainer order).")
    flags.DEFINE_string("out_dir", "benchmarks/results", "Where the .md/.json reports go.")
    flags.DEFINE_string("name", None, "Report basename (default validate_<platform>_<preset>).")
    flags.DEFINE_bool("strict", False, "Strict mode on the contract lane (no non-contract backend, no fallback).")
    flags.DEFINE_bool("baseline", True, "Also run the XLA materialized baseline lane.")
    return flags.FLAGS


def main(argv):
    from absl import flags

    FLAGS = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {argv[1:]}")
    command = " ".join(["python", "-m", "detlogp_jax.validate"] + [shlex.quote(a) for a in sys.argv[1:]])
    cfg = ValidateConfig(
        backend=FLAGS.backend,
        preset=FLAGS.preset,
        batch=FLAGS.batch,
        steps=FLAGS.steps,
        tp=FLAGS.tp,
        temperature=FLAGS.temperature,
        top_k=FLAGS.top_k,
        top_p=FLAGS.top_p,
        min_p=FLAGS.min_p,
        seed=FLAGS.seed,
        out_dir=FLAGS.out_dir,
        name=FLAGS.name,
        strict=FLAGS.strict,
        baseline=FLAGS.baseline,
        command=command,
    )
    report = run_validation(cfg)
    print(render_markdown(report))
    if report.get("files"):
        print(f"wrote {report['files']['markdown']} and {report['files']['json']}", file=sys.stderr)
    return 0 if report["ok"] else 1


def _entry():
    from absl import app

    _define_flags()
    app.run(main)


if __name__ == "__main__":
    _entry()
