"""The batch-invariant body attention (`detlogp_jax.body.attention`, backend pallas_sm90) on a Hopper GPU.

    PYTHONPATH=. python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_body_attention_gpu.py

At the Qwen3-8B attention heads (Hq = 32, Hkv = 8, Dh = 128), bf16 q / k / v, 8 sequences of
4096 positions (random keys, values and queries):
* the kernel vs float64 (f32 output: relative Frobenius error < 4e-3; the contract rounds e to
  bf16 for the PV product) for a prefill and a decode batch, and its bf16 output == its f32
  output rounded to bf16, byte for byte;
* the same query rows computed as a prefill of 8 x 1024, a prefill of 1 x 4096, chunks of 512
  (one sequence over its 4096-slot cache) and of 256 (8 sequences), and a decode batch of
  B = 64 over 4096-slot caches at many positions (also left-padded, and over caches holding
  NaN / inf past the keys): 0 rows differing for ours (asserted); the counts of plain XLA
  (`backend="xla"`) and of cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`,
  where it expresses the case) over the clean caches are recorded, not asserted;
* the launch configs give the same bytes (asserted); auto takes the kernel.
At the end a table: one line per check, `rows_differing / rows` and max_abs_diff (a row is one
(sequence, query, head), Dh values).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detlogp_jax import body
from detlogp_jax.body import backends as body_backends
from tests.helpers import rel_err, row_mismatches

pytestmark = pytest.mark.gpu

pa = pytest.importorskip("pallas_kernels.body.attention")
from pallas_kernels.body import attention_config as ac  # noqa: E402

HQ, HKV, DH = 32, 8, 128
N_SEQ, S_LONG, T_SHORT, B_DECODE = 8, 4096, 1024, 64
CHUNK = S_LONG // 8  # chunks of one sequence over its whole cache
_TABLE: list[tuple[str, str, str, str]] = []  # (check, lane, rows differing / rows, max_abs_diff)


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    print("\n=== body attention on the GPU: rows differing in bytes (ours must be 0; xla, cudnn recorded) ===")
    print(f"{'check':58s} {'lane':6s} {'rows differing':>18s} {'max_abs_diff':>13s}")
    for check, lane, rows, mad in _TABLE:
        print(f"{check:58s} {lane:6s} {rows:>18s} {mad:>13s}")


def _np(y):
    return np.asarray(jnp.asarray(y, jnp.float32))


def _record(check, lane, got, want):
    """Records (and returns) the query rows of got vs want whose bytes differ."""
    got, want = _np(got), _np(want)
    rows, mad = row_mismatches(got.reshape(-1, DH), want.reshape(-1, DH))
    _TABLE.append((check, lane, f"{rows} / {got.size // DH}", f"{mad:.3g}"))
    return rows


def _note(check, lane, text):
    _TABLE.append((check, lane, text, "-"))


@pytest.fixture(scope="module")
def seqs():
    """8 sequences: q [8, 4096, 32, 128], k / v [8, 4096, 8, 128], bf16 (a sequence's cache is
    its keys at slots = positions)."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (N_SEQ, S_LONG, HQ, DH), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (N_SEQ, S_LONG, HKV, DH), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (N_SEQ, S_LONG, HKV, DH), jnp.float32).astype(jnp.bfloat16)
    return q, k, v


@functools.lru_cache(maxsize=None)
def _lane(lane, out_dtype=jnp.bfloat16, config=None):
    """lane(q, k, v, pos, kv_start) -> [B, T, Hq, Dh]: ours (pallas_sm90) or xla."""
    if lane == "ours" and config is not None:
        return jax.jit(
            lambda q, k, v, p, ks: pa.attention(
                q, k, v, q_positions=p, kv_start=ks, scale=DH**-0.5, out_dtype=out_dtype, config=config
            )
        )
    backend = "pallas_sm90" if lane == "ours" else "xla"
    return jax.jit(
        lambda q, k, v, p, ks: body.attention(q, k, v, q_positions=p, kv_start=ks, out_dtype=out_dtype, backend=backend)
    )


def _cudnn(q, k, v, pos, *, causal):
    """cuDNN's attention where it expresses the case (kv_start 0): a whole prefill (causal, T == S)
    or a decode step (one query at position p sees slots 0 .. p), else a boolean mask."""
    if causal:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if q.shape[1] == 1:
        lengths = pos[:, 0] + 1
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")
    mask = jnp.arange(k.shape[1])[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, T, S]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


def _run_cudnn(check, want, *args, **kw):
    """cuDNN's rows of a check vs want, recorded (or why it did not run)."""
    try:
        got = jax.jit(functools.partial(_cudnn, **kw))(*args)
        jax.block_until_ready(got)
    except Exception as e:  # cuDNN refuses some shapes / masks: recorded, not a failure
        _note(check, "cudnn", f"n/a ({type(e).__name__})")
        return
    _record(check, "cudnn", got, want)


def _pos(b, t, start=0):
    return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))


def _zeros(b):
    return jnp.zeros((b,), jnp.int32)


def _f64_rows(q, k, v, pos, kv_start, rows):
    """float64 attention of the (b, t) query rows listed, all heads: [len(rows), Hq, Dh]."""
    g = HQ // HKV
    out = []
    for b, t in rows:
        p, s0 = int(pos[b, t]), int(kv_start[b])
        kk = np.asarray(k[b, s0 : s0 + p + 1], np.float64)  # [p + 1, Hkv, Dh]
        vv = np.asarray(v[b, s0 : s0 + p + 1], np.float64)
        qq = np.asarray(q[b, t], np.float64)  # [Hq, Dh]
        heads = []
        for h in range(HQ):
            s = kk[:, h // g] @ qq[h] * DH**-0.5
            w = np.exp(s - s.max())
            heads.append((w / w.sum()) @ vv[:, h // g])
        out.append(heads)
    return np.asarray(out)


def _decode_batch(seqs, b=B_DECODE, padded=False, garbage=False):
    """A decode step of b rows: row i is sequence i % 8 at a position spread over its keys (sequence
    0 over all 4096, the others over the first 1024, so each row has a prefill twin); its cache
    [b, 4096, 8, 128] holds that sequence's keys from slot kv_start (padded: 0 .. 12, the slots
    before it NaN), and past the position NaN keys / inf values (garbage) or the real keys.
    Returns (q [b, 1, 32, 128], k, v, pos [b, 1], kv_start [b], seq ids, positions)."""
    q, k, v = seqs
    i = np.arange(b)
    sid = i % N_SEQ
    pad = (i * 5) % 13 if padded else np.zeros(b, int)
    limit = np.where(sid == 0, S_LONG - 13, T_SHORT)
    p = (i * 977 + 31) % limit
    pos = jnp.asarray(p[:, None], jnp.int32)
    qd = q[sid, p][:, None]
    slots = np.arange(S_LONG)[None, :] - pad[:, None]  # the position each slot holds
    src = np.clip(slots, 0, S_LONG - 1)
    kd, vd = k[sid[:, None], src], v[sid[:, None], src]
    before = jnp.asarray(slots < 0)[:, :, None, None]
    kd, vd = jnp.where(before, jnp.nan, kd), jnp.where(before, jnp.nan, vd)
    if garbage:
        past = jnp.asarray(slots > p[:, None])[:, :, None, None]
        kd, vd = jnp.where(past, jnp.nan, kd), jnp.where(past, jnp.inf, vd)
    return qd, kd.astype(jnp.bfloat16), vd.astype(jnp.bfloat16), pos, jnp.asarray(pad, jnp.int32), sid, p


# --- values -------------------------------------------------------------------------------------


def test_correct_vs_float64(seqs):
    """A prefill of 1 x 1024 and a decode batch of 64 over 4096-slot caches vs float64 at 48 query
    rows (all heads); f32 output; the bf16 output is the f32 output rounded."""
    q, k, v = seqs
    got = _lane("ours", jnp.float32)(q[:1, :T_SHORT], k[:1, :T_SHORT], v[:1, :T_SHORT], _pos(1, T_SHORT), _zeros(1))
    ts = (0, 1, 2, 63, 64, 65, 127, 128, T_SHORT // 2 - 12, T_SHORT // 2 + 265, T_SHORT - 2, T_SHORT - 1)
    rows = [(0, t) for t in sorted(set(ts)) if t < T_SHORT]
    want = _f64_rows(q, k, v, np.asarray(_pos(1, T_SHORT)), np.zeros(1, int), rows)
    err = rel_err(_np(got)[0, [t for _, t in rows]], want)
    assert err < 4e-3, f"prefill: relative error {err}"
    y16 = _lane("ours")(q[:1, :T_SHORT], k[:1, :T_SHORT], v[:1, :T_SHORT], _pos(1, T_SHORT), _zeros(1))
    rounded = jnp.asarray(got).astype(jnp.bfloat16)
    assert _record(f"prefill 1x{T_SHORT} bf16 out == rounded f32 out", "ours", y16, rounded) == 0
    qd, kd, vd, pos, pad, sid, p = _decode_batch(seqs, padded=True)
    got = _np(_lane("ours", jnp.float32)(qd, kd, vd, pos, pad))
    picks = list(range(0, B_DECODE, 2))
    want = np.concatenate([_f64_rows(qd, kd, vd, np.asarray(pos), np.asarray(pad), [(i, 0)]) for i in picks])
    err = rel_err(got[picks, 0], want)
    assert err < 4e-3, f"decode: relative error {err}"


# --- row bytes ----------------------------------------------------------------------------------


def test_rows_identical_across_prefill_chunks_and_decode(seqs):
    """Ours: 0 rows differing between every pair of computations of the same query rows; XLA and
    cuDNN: recorded over clean caches."""
    q, k, v = seqs
    bad = []

    def check(name, lane, got, want):
        rows = _record(name, lane, got, want)
        if lane == "ours" and rows:
            bad.append((name, rows))

    short = (q[:, :T_SHORT], k[:, :T_SHORT], v[:, :T_SHORT], _pos(N_SEQ, T_SHORT), _zeros(N_SEQ))
    long1 = (q[:1], k[:1], v[:1], _pos(1, S_LONG), _zeros(1))
    for lane in ("ours", "xla", "cudnn"):
        if lane == "cudnn":
            try:
                p8 = jax.jit(functools.partial(_cudnn, causal=True))(*short[:4])
                p1 = jax.jit(functools.partial(_cudnn, causal=True))(*long1[:4])
            except Exception as e:
                _note(f"prefill 1x{S_LONG} / {N_SEQ}x{T_SHORT}", lane, f"n/a ({type(e).__name__})")
                continue
        else:
            p8, p1 = _lane(lane)(*short), _lane(lane)(*long1)
        check(f"prefill 1x{S_LONG} rows 0..{T_SHORT - 1} vs prefill {N_SEQ}x{T_SHORT}", lane, p1[:, :T_SHORT], p8[:1])
        # Chunks of sequence 0 over its 4096-slot cache (garbage past the chunk for ours).
        for c0 in range(0, S_LONG, CHUNK):
            sl = slice(c0, c0 + CHUNK)
            args = (q[:1, sl], k[:1], v[:1], _pos(1, CHUNK, c0), _zeros(1))
            name = f"chunk {c0}:{c0 + CHUNK} of 1x{S_LONG} vs prefill 1x{S_LONG}"
            if lane == "cudnn":
                _run_cudnn(name, p1[:, sl], *args[:4], causal=False)
                continue
            check(name, lane, _lane(lane)(*args), p1[:, sl])
            if lane == "ours":
                past = (jnp.arange(S_LONG) >= c0 + CHUNK)[None, :, None, None]
                kg, vg = jnp.where(past, jnp.nan, k[:1]), jnp.where(past, jnp.inf, v[:1])
                check(name + " (NaN/inf past)", lane, _lane(lane)(q[:1, sl], kg, vg, *args[3:]), p1[:, sl])
        # Chunk [T/4, T/2) of all 8 sequences over their 4096-slot caches.
        c0, c1 = T_SHORT // 4, T_SHORT // 2
        args = (q[:, c0:c1], k, v, _pos(N_SEQ, c1 - c0, c0), _zeros(N_SEQ))
        name = f"chunk {c0}:{c1} of {N_SEQ} over {S_LONG} slots vs prefill {N_SEQ}x{T_SHORT}"
        if lane == "cudnn":
            _run_cudnn(name, p8[:, c0:c1], *args[:4], causal=False)
        else:
            check(name, lane, _lane(lane)(*args), p8[:, c0:c1])
        # Decode: 64 rows at many positions, twins in the prefills.
        qd, kd, vd, pos, pad, sid, p = _decode_batch(seqs)
        twin = jnp.where(
            jnp.asarray(sid == 0)[:, None, None],
            jnp.asarray(p1)[0, jnp.asarray(p)],
            jnp.asarray(p8)[jnp.asarray(sid), jnp.asarray(np.minimum(p, T_SHORT - 1))],
        )[:, None]
        name = f"decode B={B_DECODE} over {S_LONG} slots vs prefill twins"
        if lane == "cudnn":
            _run_cudnn(name, twin, qd, kd, vd, pos, causal=False)
            continue
        check(name, lane, _lane(lane)(qd, kd, vd, pos, pad), twin)
        if lane == "ours":
            for padded, garbage in ((True, False), (False, True), (True, True)):
                qd, kd, vd, pos, pad, _, _ = _decode_batch(seqs, padded=padded, garbage=garbage)
                what = ", ".join(w for w, on in (("left-padded", padded), ("NaN/inf past", garbage)) if on)
                check(f"{name} ({what})", lane, _lane(lane)(qd, kd, vd, pos, pad), twin)
            # The same rows in a decode batch of 8 (its first rows) and alone (row 5).
            qd, kd, vd, pos, pad, _, _ = _decode_batch(seqs)
            check("decode B=8 vs prefill twins", lane, _lane(lane)(qd[:8], kd[:8], vd[:8], pos[:8], pad[:8]), twin[:8])
            check(
                "decode B=1 (row 5) vs prefill twin",
                lane,
                _lane(lane)(qd[5:6], kd[5:6], vd[5:6], pos[5:6], pad[5:6]),
                twin[5:6],
            )
    assert not bad, bad


def test_launch_configs_give_the_same_bytes(seqs):
    """Every launch config (two consumer warpgroups on consecutive row tiles or KV heads, or one;
    2- to 4-slot rings; tiles last-to-first or first-to-last) gives the default's bytes for a
    prefill with an odd number of row tiles and a decode batch."""
    q, k, v = seqs
    t = T_SHORT // 2 + 40  # 4 t rows: 35 row tiles per (sequence, KV head), an odd number
    prefill = (q[:2, :t], k[:2, :t], v[:2, :t], _pos(2, t), _zeros(2))
    qd, kd, vd, pos, pad, _, _ = _decode_batch(seqs, padded=True)
    decode = (qd, kd, vd, pos, pad)
    base = {"prefill": _lane("ours")(*prefill), "decode": _lane("ours")(*decode)}
    configs = [*ac.CONFIGS, ac.AttentionConfig("gpu_test", stages=2, heavy_first=False)]
    bad = []
    for config in configs:
        name = getattr(config, "name", config)
        for case, args in (("prefill", prefill), ("decode", decode)):
            rows = _record(
                f"{case} config {name} vs default", "ours", _lane("ours", jnp.bfloat16, config)(*args), base[case]
            )
            bad += [(case, name, rows)] if rows else []
    assert not bad, bad


def test_auto_resolution_on_the_gpu(seqs):
    """ "auto" takes the kernel; an operand the kernel cannot take (f32) falls back to the
    reference with a warning, and the kernel named explicitly refuses it with its reason."""
    q, k, v = seqs
    assert body_backends.resolve("attention", "auto", q[:1, :4], k[:1], v[:1]).name == "pallas_sm90"
    assert body_backends.resolve("attention", "pallas_sm90", q[:1, :4], k[:1], v[:1]).name == "pallas_sm90"
    qf, kf = q[:1, :4].astype(jnp.float32), k[:1, :64].astype(jnp.float32)
    with pytest.warns(UserWarning, match="falls back to the reference"):
        body.attention(qf, kf, kf, q_positions=_pos(1, 4))
    with pytest.raises(body.BackendUnavailableError, match="bfloat16"):
        body.attention(qf, kf, kf, q_positions=_pos(1, 4), backend="pallas_sm90")
