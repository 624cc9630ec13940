"""RL parity validation: does the trainer get the rollout's logp bytes?

A small random Flax NNX decoder LM (`detlogp_jax.apps.toy_lm`, lm_head =
`LogpHead`) plays both sides of an RL step:

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
      full-sequence forward of the body, the sequences in another order and
      in forward calls of another batch size (`trainer_batch`, the last call
      padded with dummy sequences).
  Both again with the XLA materialized baseline (`backend="xla"`).
  It also replays the sampler's processed logprob from the op's logits.
* BODY: the model body of both sides (`body`): "batch_invariant" (the
  default: `detlogp_jax.body`'s GEMM, attention over the KV cache and RMSNorm,
  so a decode step and the full-sequence forward give the same hidden states)
  or "xla" (Flax's layers as XLA builds them). With an invariant body the run
  also measures the plain XLA body on the same tokens (`compare_xla_body`):
  (c) a teacher-forced decode of the sampled tokens and the trainer's forward,
  both with the XLA body, scored by the contract op.

Rows report mismatch_count (rows whose logp bytes differ), max_abs_diff and
max |K3| with rho = exp(logp_trainer - logp_rollout), K3 = rho - 1 - log(rho)
(float64, from the two float32 values). Drift in (b) but not in (a) is the
body's (attention/FFN), not the operator's.

Entropy (on where the backend produces it, `ValidateConfig.entropy`): the rollout's
logp call also returns the per-row entropy (`return_entropy=True`, one call), the
trainer scores the entropy of the same packed rows with a second call (its logp
rows keep `return_entropy=False`), and the entropy bytes are compared like the logp
bytes, for (a) and (b).

Defaults (the main job): on a Hopper GPU (`pallas_sm90` available) the
Qwen3-8B lm_head shape (`qwen3_8b`), batch 64 x 128 steps on `pallas_sm90`;
elsewhere the `small` preset, batch 16 x 32 steps on the `reference` backend;
strict mode on the contract lane in both. Reports go to a new, untracked
`./detlogp-results/<UTC timestamp>/` unless `out_dir` says otherwise.

`run_validation(ValidateConfig(...)) -> dict` is the importable entry; the CLI
is `detlogp_jax.apps.cli` (`python -m detlogp_jax.validate`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
import sys
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from detlogp_jax import api, backends, sampling
from detlogp_jax import contract as C
from detlogp_jax import fingerprint as fp_lib
from detlogp_jax.apps import claims as claims_lib
from detlogp_jax.apps import report as report_lib
from detlogp_jax.apps.metrics import bits, row_mismatch
from detlogp_jax.apps.toy_lm import BODIES, ToyLM, ToyLMConfig

__all__ = ["PRESETS", "ValidateConfig", "hopper_available", "resolve_config", "run_validation"]

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on a CPU: smoke runs and tests.
    "tiny": dict(
        vocab_size=500, padded_vocab_size=512, d_model=32, n_layers=1, n_heads=2, d_ff=64, dtype="float32", prompt_len=4
    ),
    # CPU-sized: the reference backend walks K sequentially, keep D and V small.
    "small": dict(
        vocab_size=1900,
        padded_vocab_size=2048,
        d_model=64,
        n_layers=2,
        n_heads=4,
        d_ff=128,
        dtype="float32",
        prompt_len=4,
    ),
    # Qwen3-8B's lm_head shape (D=4096, vocab 151936 padded 152064, bf16) on a light one-block body.
    "qwen3_8b": dict(
        vocab_size=151936,
        padded_vocab_size=152064,
        d_model=4096,
        n_layers=1,
        n_heads=32,
        d_ff=4096,
        dtype="bfloat16",
        prompt_len=8,
    ),
}

DEFAULT_RESULTS_DIR = "detlogp-results"  # relative to the working directory; in .gitignore


@dataclasses.dataclass
class ValidateConfig:
    backend: str | None = None  # None: pallas_sm90 on a Hopper GPU, else reference
    preset: str | None = None  # None: qwen3_8b on a Hopper GPU, else small
    batch: int | None = None  # None: 64 on a Hopper GPU, else 16
    steps: int | None = None  # None: 128 on a Hopper GPU, else 32
    tp: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    out_dir: str | None = "default"  # "default": ./detlogp-results/<UTC timestamp>/; None: write nothing
    strict: bool = True  # strict mode on the contract lane (the baseline lane never is)
    baseline: bool = True  # also run the XLA materialized lane
    replay_chunk: int = 256  # rows per replay call (bit-neutral)
    time_reps: int = 3  # timed calls per lane of the trainer's packed scoring (0: no timing)
    png: bool = True  # also write the PNG (needs matplotlib)
    name: str | None = None  # report basename (default validate_<platform>_<preset>)
    command: str | None = None  # the exact command line, recorded in the report
    progress: bool = True
    model_overrides: dict = dataclasses.field(default_factory=dict)  # e.g. {"d_model": 32}
    corrupt_trainer_weight: bool = False  # test hook: flip one bit of the trainer's lm_head copy
    entropy: bool | None = None  # compare entropy bytes too; None: where the contract backend produces it
    body: str = "batch_invariant"  # the model body of both sides: "batch_invariant" or "xla"
    body_backend: str = "auto"  # the invariant body ops' backend (auto: the Hopper kernels where they serve)
    compare_xla_body: bool = True  # with an invariant body: also row (c), the plain XLA body end to end
    trainer_batch: int | None = None  # sequences per trainer forward call; None: batch // 2 + 1 (another size)


# -- configuration -------------------------------------------------------------------------


def hopper_available() -> bool:
    """Whether the Hopper backend (`pallas_sm90`) can serve on this machine (never raises)."""
    try:
        return bool(backends.get("pallas_sm90").available())
    except Exception:
        return False


def backend_produces_entropy(backend: str) -> bool:
    """Whether the backend declares the entropy statistic (never raises; "auto": the preferred one)."""
    try:
        return bool(backends.get(backends.preferred() if backend == "auto" else backend).entropy)
    except Exception:
        return False


def default_out_dir(root: str = DEFAULT_RESULTS_DIR) -> str:
    """A new directory name `<root>/<UTC timestamp>` (suffixed -2, -3, ... if taken); not created."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path, n = os.path.join(root, stamp), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(root, f"{stamp}-{n}")
    return path


def resolve_config(config: ValidateConfig) -> ValidateConfig:
    """Fills the platform defaults into a copy of `config` (idempotent).

    Keeps every explicit choice; fills None backend/preset/batch/steps from the
    platform (Hopper: pallas_sm90, qwen3_8b, 64 x 128; elsewhere: reference,
    small, 16 x 32) and out_dir "default" with a new ./detlogp-results/<stamp>.
    """
    hopper = hopper_available()
    preset = config.preset or ("qwen3_8b" if hopper else "small")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = dataclasses.replace(
        config,
        backend=config.backend or ("pallas_sm90" if hopper else "reference"),
        preset=preset,
        batch=config.batch or (64 if hopper else 16),
        steps=config.steps or (128 if hopper else 32),
        out_dir=default_out_dir() if config.out_dir == "default" else config.out_dir,
    )
    if cfg.entropy is None:
        cfg = dataclasses.replace(cfg, entropy=backend_produces_entropy(cfg.backend))
    if cfg.batch < 1 or cfg.steps < 1:
        raise ValueError("batch and steps must be >= 1")
    if cfg.body not in BODIES:
        raise ValueError(f"body must be one of {BODIES}, got {cfg.body!r}")
    if cfg.trainer_batch is None:
        cfg = dataclasses.replace(cfg, trainer_batch=cfg.batch // 2 + 1)
    if cfg.trainer_batch < 1:
        raise ValueError("trainer_batch must be >= 1")
    if cfg.name is None:
        cfg = dataclasses.replace(cfg, name=f"validate_{backends.platform_info()['platform']}_{preset}")
    return cfg


def _model_config(cfg: ValidateConfig) -> tuple[ToyLMConfig, int]:
    """(ToyLMConfig, prompt_len) of the preset plus overrides; a new vocab_size gets its canonical padding."""
    p = dict(PRESETS[cfg.preset])
    p.update(cfg.model_overrides)
    prompt_len = int(p.pop("prompt_len"))
    dtype = jnp.dtype(p.pop("dtype"))
    if "padded_vocab_size" not in cfg.model_overrides and "vocab_size" in cfg.model_overrides:
        p["padded_vocab_size"] = C.canonical_padded_vocab(p["vocab_size"])
    model = ToyLMConfig(
        max_len=prompt_len + cfg.steps,
        dtype=dtype,
        backend=cfg.backend,
        body=cfg.body,
        body_backend=cfg.body_backend,
        **p,
    )
    return model, prompt_len


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


# -- progress and provenance ---------------------------------------------------------------


class Progress:
    """Progress lines on stderr (`[validate] ...`); one carriage-return line on a TTY."""

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


def _prov_record(p: C.Provenance | None) -> dict[str, Any] | None:
    if p is None:
        return None
    fields = (
        "backend",
        "contract_id",
        "contract_bearing",
        "requested_backend",
        "fallback",
        "vocab_size",
        "padded_vocab_size",
        "n_split",
        "platform",
        "device_kind",
        "entropy_id",
    )
    return {f: getattr(p, f) for f in fields}


class Recorder:
    """Collects `last_provenance()` right after each traced op call, by role (call site)."""

    def __init__(self):
        self.records: dict[str, dict[str, Any]] = {}

    def mark(self, role: str):
        rec = _prov_record(api.last_provenance())
        if rec is not None:
            self.records[role] = rec


def _lane_ctx(strict: bool, contract_lane: bool):
    # The baseline lane is non-contract by design: it runs outside strict mode.
    return backends.strict_mode(strict if contract_lane else False)


# -- the stages ----------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """What both sides share: the resolved config, the model, the prompts and the keys."""

    cfg: ValidateConfig
    mcfg: ToyLMConfig
    prompt_len: int
    program: sampling.SamplingProgram
    model: ToyLM
    prompt: jax.Array  # [B, P] int32
    k_sample: jax.Array
    k_perm: jax.Array
    rec: Recorder
    prog: Progress

    @property
    def temperature(self) -> float:
        return float(self.program.temperature)


@dataclasses.dataclass
class Rollout:
    """The rollout's record of every sampled position ([B, S] unless noted)."""

    fingerprint: str
    tokens_full: jax.Array  # [B, P + S]: prompt + sampled tokens
    hidden: np.ndarray  # [B, S, D]: the decode loop's final hidden states
    tokens: np.ndarray
    logp: np.ndarray  # the op's contract logp of the sampled token
    processed_logprob: np.ndarray  # the sampler's processed logprob
    xla_logp: np.ndarray | None  # the XLA baseline lane's logp of the same token
    entropy: np.ndarray | None = None  # the op's entropy of each row (same call as logp), if compared


@dataclasses.dataclass
class TrainerScores:
    """The trainer's re-scoring, unpacked back to the rollout's [B, S] order."""

    trainer: ToyLM
    fingerprint: str
    perm: np.ndarray  # packed row r holds rollout row perm[r] (flattened [B * S])
    h_packed: jax.Array  # [N, D]: the rollout's hidden states, packed
    targets_packed: jax.Array  # [N]
    logp_a: np.ndarray  # (a) operator: rollout hidden states
    logp_b: np.ndarray  # (b) end to end: the trainer's own forward
    xla_logp_a: np.ndarray | None
    xla_logp_b: np.ndarray | None
    entropy_a: np.ndarray | None  # the trainer's entropy of the packed rows, (a) and (b), if compared
    entropy_b: np.ndarray | None
    hidden_rows_differ: int
    hidden_max_abs_diff: float
    score: Callable  # jitted (model, h, t) -> logp, contract lane (for timing)
    score_xla: Callable | None


def build_setup(cfg: ValidateConfig) -> Setup:
    """Builds the model and the seeded inputs of a resolved config.

    Keeps: everything derives from `cfg.seed` (init, prompts, sampling keys,
    trainer order), so a config replays the same run.
    """
    prog = Progress(cfg.progress)
    program = sampling.SamplingProgram(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
    mesh = _make_mesh(cfg.tp)
    head_kwargs = {} if mesh is None else {"mesh": mesh, "tp_axis": "tp"}
    mcfg, prompt_len = _model_config(cfg)
    prog.note(
        f"preset={cfg.preset} D={mcfg.d_model} V={mcfg.vocab_size} (padded {mcfg.padded_vocab_size}) "
        f"dtype={jnp.dtype(mcfg.dtype).name} batch={cfg.batch} steps={cfg.steps} backend={cfg.backend} strict={cfg.strict}"
    )
    model = ToyLM(mcfg, rngs=nnx.Rngs(cfg.seed), head_kwargs=head_kwargs)
    k_prompt, k_sample, k_perm = jax.random.split(jax.random.key(cfg.seed), 3)
    prompt = jax.random.randint(k_prompt, (cfg.batch, prompt_len), 0, mcfg.vocab_size, jnp.int32)
    return Setup(cfg, mcfg, prompt_len, program, model, prompt, k_sample, k_perm, Recorder(), prog)


def run_rollout(s: Setup) -> Rollout:
    """The rollout: teacher-forced prefill, then `steps` decode + sample steps of M = batch rows.

    Keeps: at each step the serving entry's logits, the sampled token, the op's
    logp of that token and the sampler's processed logprob come from the same
    call site under the lane's strict mode; the lm_head is fingerprinted before
    the first step; the sampling key of row b at position p is fold_in(fold_in(k, b), p).
    """
    cfg, rec, temperature, program = s.cfg, s.rec, s.temperature, s.program
    fp = s.model.head.fingerprint()

    @nnx.jit
    def decode(m, tok, pos, cache):
        with backends.strict_mode(cfg.strict):  # the invariant body's ops: no fallback either
            return m.decode(tok, pos, cache)

    @nnx.jit
    def serve(m, h, pos):
        rows = jnp.arange(h.shape[0])
        keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(s.k_sample, b), pos))(rows)
        ent = {}

        def logp_from_op(tok):  # one op call: the logp of the sampled token (and the row's entropy)
            out = m.head(h, tok, temperature=temperature, return_entropy=bool(cfg.entropy))
            ent["entropy"] = out.entropy
            return out.logp

        with _lane_ctx(cfg.strict, True):
            logits = m.head.logits(h)  # serving entry: FP32 logits [B, V]
            rec.mark("rollout_serve")
            res = sampling.sample(logits, program, keys, logp_from_op=logp_from_op)
            rec.mark("rollout_logp")
        xla_logp = None
        if cfg.baseline:
            with _lane_ctx(cfg.strict, False):
                xla_logp = m.head(h, res.token, temperature=temperature, backend="xla").logp
                rec.mark("baseline_rollout")
        return res.token, res.processed_logprob, res.logp, xla_logp, ent["entropy"]

    P, S = s.prompt_len, cfg.steps
    cache = s.model.init_cache(cfg.batch)
    seq = [s.prompt[:, i] for i in range(P)]
    hs, toks, logps, plogps, xlogps, ents = [], [], [], [], [], []
    for pos in range(P - 1):  # prefill, one token per step, teacher forced
        _, cache = decode(s.model, seq[pos], jnp.int32(pos), cache)
    for i in range(S):
        pos = P - 1 + i
        h, cache = decode(s.model, seq[pos], jnp.int32(pos), cache)
        tok, plp, lp, xlp, ent = serve(s.model, h, jnp.int32(pos))
        seq.append(tok)
        hs.append(h)
        toks.append(tok)
        logps.append(lp)
        plogps.append(plp)
        xlogps.append(xlp)
        ents.append(ent)
        s.prog.step("rollout", i + 1, S)
    return Rollout(
        fingerprint=fp,
        tokens_full=jnp.stack(seq, axis=1),
        hidden=np.asarray(jnp.stack(hs, axis=1)),
        tokens=np.asarray(jnp.stack(toks, axis=1)),
        logp=np.asarray(jnp.stack(logps, axis=1), np.float32),
        processed_logprob=np.asarray(jnp.stack(plogps, axis=1), np.float32),
        xla_logp=np.asarray(jnp.stack(xlogps, axis=1), np.float32) if cfg.baseline else None,
        entropy=np.asarray(jnp.stack(ents, axis=1), np.float32) if cfg.entropy else None,
    )


def trainer_copy(s: Setup, rollout: Rollout) -> tuple[ToyLM, str]:
    """The trainer's own copy of the weights, fingerprint-checked against the rollout's.

    Keeps: the check runs before any scoring; a mismatch raises
    `FingerprintMismatchError` (the `corrupt_trainer_weight` hook flips one bit to show it).
    """
    graphdef, state = nnx.split(s.model)
    state = jax.tree.map(lambda a: jnp.array(a, copy=True), state)
    trainer = nnx.merge(graphdef, state)
    if s.cfg.corrupt_trainer_weight:
        trainer.head.kernel[...] = _flip_one_bit(trainer.head.kernel[...])
    fp = trainer.head.fingerprint()
    fp_lib.check_fingerprints(rollout.fingerprint, fp, what="lm_head (rollout vs trainer)")
    return trainer, fp


def _unpack(packed, perm, shape) -> np.ndarray:
    """Packed rows (row r holds rollout row perm[r]) back in the rollout's order, as float32 `shape`."""
    return np.asarray(packed, np.float32)[np.argsort(perm)].reshape(shape)


def score_trainer(s: Setup, rollout: Rollout, trainer: ToyLM, fp: str) -> TrainerScores:
    """Re-scores every sampled token in one packed, shuffled batch (M = batch * steps rows).

    Keeps: (a) uses the rollout's hidden states bytes as they were, (b) the
    trainer's own full-sequence forward; both through the trainer entry (no
    logits); the permutation is seeded; results are unpacked to [B, S].
    """
    cfg, rec, temperature = s.cfg, s.rec, s.temperature
    B, S, P = cfg.batch, cfg.steps, s.prompt_len
    N = B * S
    perm = np.asarray(jax.random.permutation(s.k_perm, N))
    tgt = jnp.asarray(rollout.tokens.reshape(N)[perm])

    @nnx.jit
    def score(m, h, t):
        with _lane_ctx(cfg.strict, True):
            out = m.head(h, t, temperature=temperature)  # trainer entry: no logits
            rec.mark("trainer")
        return out.logp

    @nnx.jit
    def score_entropy(m, h, t):
        with _lane_ctx(cfg.strict, True):
            out = m.head(h, t, temperature=temperature, return_entropy=True)  # trainer entry + entropy
            rec.mark("trainer_entropy")
        return out.entropy

    @nnx.jit
    def score_xla(m, h, t):
        with _lane_ctx(cfg.strict, False):
            out = m.head(h, t, temperature=temperature, backend="xla")
            rec.mark("baseline_trainer")
        return out.logp

    def unpack(x):
        return _unpack(x, perm, (B, S))

    h_a = jnp.asarray(rollout.hidden.reshape(N, -1)[perm])
    s.prog.note(f"trainer: scoring {N} packed rows (operator)")
    logp_a = unpack(score(trainer, h_a, tgt))
    s.prog.note(
        f"trainer: full-sequence forward of {B} sequences ({s.mcfg.body} body, shuffled, "
        f"{cfg.trainer_batch} per call) + scoring (end to end)"
    )
    H_tr = trainer_hidden(s, trainer, rollout.tokens_full)[:, P - 1 : P - 1 + S]  # [B, S, D]
    h_b = jnp.asarray(H_tr.reshape(N, -1)[perm])
    logp_b = unpack(score(trainer, h_b, tgt))
    hid_rows, hid_mad = row_mismatch(rollout.hidden.reshape(N, -1), H_tr.reshape(N, -1))
    ent_a = ent_b = None
    if cfg.entropy:
        s.prog.note("trainer: entropy of the packed rows (operator, end to end)")
        ent_a = unpack(score_entropy(trainer, h_a, tgt))
        ent_b = unpack(score_entropy(trainer, h_b, tgt))
    xa = xb = None
    if cfg.baseline:
        s.prog.note("trainer: XLA baseline lane")
        xa = unpack(score_xla(trainer, h_a, tgt))
        xb = unpack(score_xla(trainer, h_b, tgt))
    return TrainerScores(
        trainer,
        fp,
        perm,
        h_a,
        tgt,
        logp_a,
        logp_b,
        xa,
        xb,
        ent_a,
        ent_b,
        hid_rows,
        hid_mad,
        score,
        score_xla if cfg.baseline else None,
    )


def trainer_hidden(s: Setup, model: ToyLM, tokens_full, body: str | None = None) -> np.ndarray:
    """The trainer's final hidden states [B, L, D] of its own full-sequence forward: the
    sequences in a seeded shuffled order, `trainer_batch` of them per forward call (another
    batch size and composition than the rollout's), the last call padded with copies of the
    first sequence; unshuffled back to the rollout's order."""
    cfg = s.cfg
    B, tb = cfg.batch, cfg.trainer_batch
    order = np.asarray(jax.random.permutation(jax.random.fold_in(s.k_perm, 1), B))
    toks = np.asarray(tokens_full)[order]
    n_calls = -(-B // tb)
    toks = np.concatenate([toks, np.repeat(toks[:1], n_calls * tb - B, axis=0)])

    @nnx.jit
    def forward(m, t):
        with backends.strict_mode(cfg.strict):
            return m.hidden(t, body=body)

    parts = [np.asarray(forward(model, jnp.asarray(toks[i * tb : (i + 1) * tb]))) for i in range(n_calls)]
    out = np.empty((B,) + parts[0].shape[1:], parts[0].dtype)
    out[order] = np.concatenate(parts)[:B]
    return out


@dataclasses.dataclass
class BodyComparison:
    """Row (c): the plain XLA body end to end on the rollout's tokens ([B, S] unless noted)."""

    rollout_logp: np.ndarray  # the op's logp of each sampled token after a teacher-forced decode (XLA body)
    trainer_logp: np.ndarray  # the op's logp after the trainer's full-sequence forward (XLA body), packed
    hidden_rows_differ: int
    hidden_max_abs_diff: float


def compare_xla_body(s: Setup, rollout: Rollout, ts: TrainerScores) -> BodyComparison:
    """Row (c): the same tokens through the plain XLA body on both sides (a teacher-forced
    decode, B rows per step, scored per step by the contract op as the rollout scores; the
    trainer's full-sequence forward, scored packed), so the body's own drift is measured
    next to the invariant body's. The contract op and its strict mode are the main lane's."""
    cfg, temperature = s.cfg, s.temperature
    B, S, P = cfg.batch, cfg.steps, s.prompt_len

    @nnx.jit
    def decode(m, tok, pos, cache):
        return m.decode(tok, pos, cache, body="xla")

    @nnx.jit
    def step_logp(m, h, tok):
        with _lane_ctx(cfg.strict, True):
            return m.head(h, tok, temperature=temperature).logp

    s.prog.note(f"plain XLA body: teacher-forced decode of the {B} x {S} sampled tokens, and the trainer's forward")
    tokens = np.asarray(rollout.tokens_full)
    cache = s.model.init_cache(B)
    hs, logps = [], []
    for pos in range(P - 1 + S):
        h, cache = decode(s.model, jnp.asarray(tokens[:, pos]), jnp.int32(pos), cache)
        if pos >= P - 1:
            hs.append(np.asarray(h))
            logps.append(np.asarray(step_logp(s.model, h, jnp.asarray(tokens[:, pos + 1]))))
    h_roll = np.stack(hs, axis=1)  # [B, S, D]
    h_tr = trainer_hidden(s, ts.trainer, rollout.tokens_full, body="xla")[:, P - 1 : P - 1 + S]
    N = B * S
    trainer_logp = np.asarray(ts.score(ts.trainer, jnp.asarray(h_tr.reshape(N, -1)[ts.perm]), ts.targets_packed))
    rows, mad = row_mismatch(h_roll.reshape(N, -1), h_tr.reshape(N, -1))
    return BodyComparison(
        rollout_logp=np.stack(logps, axis=1).astype(np.float32),
        trainer_logp=_unpack(trainer_logp, ts.perm, (B, S)),
        hidden_rows_differ=rows,
        hidden_max_abs_diff=mad,
    )


def replay_sampler(s: Setup, rollout: Rollout, ts: TrainerScores) -> int:
    """Replays the sampler's processed logprob from the op's logits of the packed rows.

    Returns how many of the B * S values equal the rollout's bit for bit.
    Keeps: fixed-shape chunks of `replay_chunk` rows (zero-padded at the end;
    rows are independent, so the chunking is bit-neutral).
    """
    cfg, rec, program = s.cfg, s.rec, s.program
    N = cfg.batch * cfg.steps

    @nnx.jit
    def replay(m, h, t):
        with _lane_ctx(cfg.strict, True):
            logits = m.head.logits(h)
            rec.mark("trainer_replay_logits")
        return sampling.processed_logprob(logits, program, t)

    chunk = max(1, min(cfg.replay_chunk, N))
    parts = []
    for start in range(0, N, chunk):
        h_c, t_c = ts.h_packed[start : start + chunk], ts.targets_packed[start : start + chunk]
        n_c = h_c.shape[0]
        if n_c < chunk:
            h_c = jnp.pad(h_c, ((0, chunk - n_c), (0, 0)))
            t_c = jnp.pad(t_c, (0, chunk - n_c))
        parts.append(np.asarray(replay(ts.trainer, h_c, t_c))[:n_c])
        s.prog.step("replay", start // chunk + 1, -(-N // chunk))
    packed = np.concatenate(parts)
    unpacked = np.empty_like(packed)
    unpacked[ts.perm] = packed
    return int(np.count_nonzero(bits(unpacked) == bits(rollout.processed_logprob.reshape(N))))


def _time_per_call(fn: Callable, args, reps: int) -> float:
    """Median wall time (ms) of `reps` calls of an already compiled fn (result fetched)."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def time_scoring(s: Setup, ts: TrainerScores) -> dict[str, Any] | None:
    """Times the trainer's packed scoring call (M = batch * steps rows): the op vs XLA.

    Keeps: the same compiled functions, operands and lanes as row (a); only
    reruns them (the bytes are not re-checked here). None when time_reps is 0.
    """
    reps = s.cfg.time_reps
    if reps <= 0:
        return None
    args = (ts.trainer, ts.h_packed, ts.targets_packed)
    out = {
        "rows_per_call": int(ts.h_packed.shape[0]),
        "reps": reps,
        "op_ms": _time_per_call(ts.score, args, reps),
        "xla_ms": None,
    }
    if ts.score_xla is not None:
        out["xla_ms"] = _time_per_call(ts.score_xla, args, reps)
    return out


def _split_warnings(caught) -> list[str]:
    """Fallback warnings (returned) apart from the rest (re-emitted)."""
    fallbacks = []
    for w in caught:
        msg = str(w.message)
        if "fall" in msg.lower():
            fallbacks.append(msg)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return fallbacks


def git_rev() -> str | None:
    """Short commit (+ "-dirty") of the checkout this package runs from, else None.

    Never raises: no git, not a checkout, or an installed copy (the package's
    parent must be the top of a git work tree, so a venv inside some other
    repository does not report that repository's commit) all give None.
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args):
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None

    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or os.path.realpath(top) != os.path.realpath(root):
            return None
        rev = git("rev-parse", "--short", "HEAD")
        if not rev:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return rev + ("-dirty" if dirty else "")
    except Exception:
        return None


def _config_repr(cfg: ValidateConfig) -> str:
    default = ValidateConfig()
    parts = [
        f"{f.name}={getattr(cfg, f.name)!r}"
        for f in dataclasses.fields(cfg)
        if f.name != "command" and getattr(cfg, f.name) != getattr(default, f.name)
    ]
    return "ValidateConfig(" + ", ".join(parts) + ")"


def run_validation(config: ValidateConfig) -> dict[str, Any]:
    """Runs rollout + trainer and returns the report dict; writes its files when out_dir is set.

    Keeps: the stages run in order setup -> rollout -> fingerprint check ->
    trainer scoring -> sampler replay -> timing, all inside one warnings
    capture (fallback warnings become report entries); `report["ok"]` is False
    when a PASS/FAIL claim fails; `report["files"]` names what was written.
    """
    t_start = time.perf_counter()
    cfg = resolve_config(config)
    timings: dict[str, float] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        setup = build_setup(cfg)
        timings["init_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rollout = run_rollout(setup)
        timings["rollout_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer, fp_trainer = trainer_copy(setup, rollout)
        scores = score_trainer(setup, rollout, trainer, fp_trainer)
        timings["trainer_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        replay_exact = replay_sampler(setup, rollout, scores)
        timings["replay_s"] = time.perf_counter() - t0
        xla_body = None
        if cfg.compare_xla_body and cfg.body != "xla":
            t0 = time.perf_counter()
            xla_body = compare_xla_body(setup, rollout, scores)
            timings["xla_body_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        op_timing = time_scoring(setup, scores)
        timings["timing_s"] = time.perf_counter() - t0
    fallback_warnings = _split_warnings(caught)

    report = claims_lib.build_report(
        setup,
        rollout,
        scores,
        replay_exact,
        fallback_warnings,
        op_timing,
        xla_body=xla_body,
        command=cfg.command or f"run_validation({_config_repr(cfg)})",
        git_rev=git_rev(),
    )
    report["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
    report["timings_s"]["total_s"] = round(time.perf_counter() - t_start, 3)
    if cfg.out_dir:
        report["files"] = report_lib.write_all(report, cfg.out_dir, cfg.name, png=cfg.png)
    setup.prog.note(f"done in {report['timings_s']['total_s']:.1f}s; ok={report['ok']}")
    return report
