"""Fingerprints of the Mosaic GPU modules of every pallas_sm90 kernel, on any machine.

    python -m benchmarks.mosaic_ir_hashes > before.txt   # edit the kernels ...
    python -m benchmarks.mosaic_ir_hashes > after.txt && diff before.txt after.txt
    python -m benchmarks.mosaic_ir_hashes base      # only the variants without the entropy
    python -m benchmarks.mosaic_ir_hashes entropy   # only the entropy variants

Lowers each kernel variant for CUDA (the whole Python half of Mosaic GPU runs on a
CPU-only machine) and prints the sha256 of its Mosaic module printed without debug
locations, i.e. the program Mosaic hands to its compiler. Identical lines before and
after a refactor mean the GPU runs the same kernels (so the H200 validation still
holds); a changed line names the variant that a GPU run must check again. Variants:
the forward kernel of every bucket, trainer and serving entries, with and without bias,
at the Qwen3-8B shape and a small one; the same forward variants reading a [D, V] weight
in place (weight_layout="dv", Qwen3-8B shape; their lines say `dv`, the [V, D] lines
carry no layout); the backward's dz kernel; the fold. Each kernel is built through its
module's public `build` with the static arguments `pallas_kernels.wrapper.partials` (or
`sm90_dz.dz_chunk`, `pk.fold`) would pass.

After those (the "base" set) come the kernels built with the entropy statistic
(`linear-logp-entropy-v1`: `return_entropy=True`, `pk.fold(..., a=)`), lines marked
`entropy`: the same forward variants at the Qwen3-8B [V, D] shape and the small
shape, the [D, V] variants at the Qwen3-8B shape without bias, and the fold.
A kernel built without the statistic must not change when the statistic changes. Last
(with "base") come the backward's in-place chunk walk kernels (`walk_hashes`: lines
`backward dz in_place`, `backward dh gemm`, `backward dw gemm`), after every older line so
that the older lines keep their places; `python -m benchmarks.mosaic_ir_hashes walk` prints
those lines alone. After them (also with "base") the fused forward's lines (`fused_hashes`:
the fold forming z_t from the split captures, a decode call's forward and fold with its rows
unpadded); `... fused` prints them alone. `python -m benchmarks.mosaic_ir_hashes fold` prints
the fold lines of "base" and "entropy" alone (with `fused`: every fold module, the guard of a
change to `sm90_fold` only). `python -m benchmarks.mosaic_ir_hashes body` prints the batch-invariant
body's kernels alone (`body_hashes`; never part of the default output).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core as mosaic_core

import pallas_kernels as pk
from pallas_kernels import sm90_dz, sm90_forward_wgmma, sm90_forward_ws, tuning

_captured: list[str] = []


def _capture_modules():
    """Records each Mosaic module (no locations) as it is serialized into the custom call (once
    per module however often it is called: the patch is installed once)."""
    original = mosaic_core._run_serde_pass
    if getattr(original, "_records_modules", False):
        return

    def run_serde_pass(module, *args, **kwargs):
        if kwargs.get("serialize"):
            _captured.append(module.operation.get_asm(enable_debug_info=False))
        return original(module, *args, **kwargs)

    run_serde_pass._records_modules = True
    mosaic_core._run_serde_pass = run_serde_pass


def _digest(module_text: str) -> str:
    # The dump file name counts the modules lowered so far in the process; drop it so a
    # hash does not depend on which variants were lowered before.
    text = re.sub(r'mosaic_gpu.dump_basename = "[^"]*"', "", module_text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _take() -> str:
    """The hash of the module lowered last (the others captured since the last take are dropped)."""
    digest = _digest(_captured.pop())
    _captured.clear()
    return digest


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _lower(build, args, **static):
    """Lowers build(**static)(*args) for CUDA (the Mosaic module is captured on the way)."""
    jax.jit(lambda *a: build(**static)(*a)).trace(*args).lower(lowering_platforms=("cuda",))


def _forward_build(cfg):
    return (sm90_forward_ws if isinstance(cfg, tuning.WsForwardConfig) else sm90_forward_wgmma).build


def _forward_configs():
    return dict(tuning.BUCKETS)


SHAPES = [("vd", 4096, 4096, 151936, 152064), ("vd", 72, 192, 1000, 1024), ("dv", 4096, 4096, 151936, 152064)]


def forward_hashes(entropy: bool = False):
    configs = _forward_configs()
    for layout, m, d, v, v_rows in SHAPES:
        geom = pk.shard_geometry(v, v_rows)
        w_shape = (d, v_rows) if layout == "dv" else (v_rows, d)
        # The [V, D] variants keep their names (and build without the layout argument).
        tag, layout_kw = (" dv", {"weight_layout": "dv"}) if layout == "dv" else ("", {})
        # The entropy variants build with return_entropy=True (the base ones without the argument).
        ent_kw = {"return_entropy": True} if entropy else {}
        tag = (" entropy" if entropy else "") + tag
        for name, cfg in configs.items():
            n_pad = tuning.padded_rows(m, cfg)
            for logits in (False, True):
                for bias in (False, True) if not (entropy and layout == "dv") else (False,):
                    args = [_sds((n_pad, d), jnp.bfloat16), _sds(w_shape, jnp.bfloat16)]
                    if bias:
                        args.append(_sds((v_rows + 64 * geom.tiles_per_group * (geom.n_groups + 1),), jnp.float32))
                    args += [_sds((n_pad,), jnp.int32), _sds((n_pad,), jnp.float32)]
                    _lower(
                        _forward_build(cfg),
                        args,
                        n_pad=n_pad,
                        d=d,
                        lg_cols=tuning.logits_width(cfg, v, v_rows, logits),  # as for logits_cols=v
                        geom=geom,
                        cfg=cfg,
                        has_bias=bias,
                        return_logits=logits,
                        num_ctas=132,
                        interpret=False,
                        interpret_params=None,
                        lg_rows=m,
                        **layout_kw,
                        **ent_kw,
                    )
                    yield f"forward{tag} M={m} {name} logits={logits} bias={bias}", _take()


def _lower_dz(n, d, chunk, w_shape, bias_shape, entropy, layout, in_place=False):
    """Lowers the dz kernel as `sm90_dz.dz_chunk` (or `dz_in_place`) builds it for these shapes."""
    args = [_sds((n, d), jnp.bfloat16), _sds(w_shape, jnp.bfloat16)]
    args += [_sds(bias_shape, jnp.float32)] if bias_shape else []
    args += [_sds((n,), jnp.int32)] + [_sds((n,), jnp.float32)] * (6 if entropy else 4)
    args += [_sds((3 if in_place else 2,), jnp.int32)]
    _lower(
        sm90_dz.build,
        args,
        n_pad=n,
        d=d,
        chunk=chunk,
        has_bias=bias_shape is not None,
        num_ctas=132,
        interpret=False,
        interpret_params=None,
        has_entropy=entropy,
        weight_layout=layout,
        in_place=in_place,
    )


def backward_hashes(entropy: bool = False):
    """The dz kernel: the base set builds the [V, D] kernel without the entropy term
    (bias off/on); the entropy set the entropy term in both layouts and the [D, V]
    kernel without it."""
    n, d, chunk = 256, 192, 512
    variants = [(False, "vd", b) for b in (False, True)]
    if entropy:
        variants = [(True, "vd", b) for b in (False, True)] + [
            (e, "dv", b) for e in (False, True) for b in (False, True)
        ]
    for ent, layout, bias in variants:
        w_shape = (chunk, d) if layout == "vd" else (d, chunk)
        _lower_dz(n, d, chunk, w_shape, (chunk,) if bias else None, ent, layout)
        tag = (" entropy" if ent else "") + (" dv" if layout == "dv" else "")
        yield f"backward dz{tag} bias={bias}", _take()


def walk_hashes():
    """The backward's in-place chunk walk (appended after the base set's older lines): the dz kernel reading the whole weight at a traced offset ([V, D] with and without a
    bias, [D, V]) and the two gradient GEMMs of `sm90_grad_gemm` in both layouts (dW also for a
    last chunk's column range), with the shipped configs and the calls `grad` makes."""
    from pallas_kernels import sm90_grad_gemm as gg

    n, d, chunk, v = 256, 512, 512, 1536
    for layout, bias in (("vd", False), ("vd", True), ("dv", False)):
        _lower_dz(n, d, chunk, (v, d) if layout == "vd" else (d, v), (v,) if bias else None, False, layout, True)
        yield f"backward dz in_place{' dv' if layout == 'dv' else ''} bias={bias}", _take()
    start = _sds((), jnp.int32)
    dz, h = _sds((n, chunk), jnp.bfloat16), _sds((n, d), jnp.bfloat16)
    for layout in ("vd", "dv"):
        w = _sds((v, d) if layout == "vd" else (d, v), jnp.bfloat16)
        fn = lambda dh, dz, w, s, lay=layout: gg.dh_accumulate(dh, dz, w, s, weight_layout=lay)  # noqa: E731
        jax.jit(fn).trace(_sds((n, d), jnp.float32), dz, w, start).lower(lowering_platforms=("cuda",))
        yield f"backward dh gemm {layout}", _take()
        for col0 in (0, 256):
            fn = lambda dw, dz, h, s, lay=layout, c=col0: gg.dw_write(dw, dz, h, s, col0=c, weight_layout=lay)  # noqa: E731
            jax.jit(fn).trace(w, dz, h, start).lower(lowering_platforms=("cuda",))
            yield f"backward dw gemm {layout} col0={col0}", _take()


def fold_hashes(entropy: bool = False):
    """The fold of 300 rows of 264 splits given z_t (`pk.fold`), without / with the entropy."""
    n, n_split = 300, 264
    a, v, t = _sds((n, n_split), jnp.float32), _sds((n,), jnp.float32), _sds((n,), jnp.int32)
    if entropy:
        fn = lambda m, s, st, z, tt, it: pk.fold(m, s, z, tt, it, 151936, a=st)  # noqa: E731
        jax.jit(fn).trace(a, a, a, v, t, v).lower(lowering_platforms=("cuda",))
        yield "fold entropy staged", _take()
    else:
        jax.jit(lambda *x: pk.fold(*x, 151936)).trace(a, a, v, t, v).lower(lowering_platforms=("cuda",))
        yield "fold staged", _take()


def fused_hashes():
    """The fused forward's modules (appended after the walk lines): the fold forming z_t from
    the forward's split captures (`sm90_fold.fold_transposed(ztT=)`, without and with the
    entropy: the fold of the shipped fused forward, `pk.forward`), and `pk.forward` at M=8 in
    the decode bucket: the ws forward kernel reading the rows' targets / inv_t by scalar loads
    and hidden with an 8-row box (`row_loads`, `h_box_rows`) and the fold writing [N] outputs
    (the decode fold, `tuning.DECODE_FOLD`); then M=1, whose fold also moves its row inputs and
    outputs by scalar loads and stores (`scalar_rows`)."""
    from pallas_kernels import sm90_fold

    n, n_split = 300, 264
    parts, t, v = _sds((n_split, n), jnp.float32), _sds((n,), jnp.int32), _sds((n,), jnp.float32)
    for ent in (False, True):

        def fn(m, s, st, zt, tt, it, ent=ent):
            return sm90_fold.fold_transposed(m, s, None, tt, it, 151936, aT=st if ent else None, ztT=zt)

        jax.jit(fn).trace(parts, parts, parts, parts, t, v).lower(lowering_platforms=("cuda",))
        yield f"fold staged zt_splits{' entropy' if ent else ''}", _take()
    d, v_real, v_rows = 4096, 151936, 152064

    def fwd(h, w, tt, it):
        return pk.forward(h, w, None, tt, it, vocab_size=v_real, padded_vocab_size=v_rows)[:2]

    for m in (8, 1):
        args = (_sds((m, d), jnp.bfloat16), _sds((v_rows, d), jnp.bfloat16), _sds((m,), jnp.int32))
        args += (_sds((m,), jnp.float32),)
        jax.jit(fwd).trace(*args).lower(lowering_platforms=("cuda",))
        forward_module, fold_module = _captured[-2:]
        _captured.clear()
        yield f"forward M={m} decode row_loads (unpadded)", _digest(forward_module)
        yield f"fold staged zt_splits n_out={m}{' scalar_rows' if m % 8 else ''} (unpadded)", _digest(fold_module)


def body_hashes():
    """The batch-invariant body's kernels (printed only when asked, `... body`, after any other
    set asked for; reference: benchmarks/results/cpu/mosaic_ir_hashes_body.txt): the GEMM (`pallas_kernels.body.matmul`) at the Qwen3-8B projections, both weight
    layouts, every M bucket forced (M = 1, 65, 130, 512 by bucket), bf16 output, 132 CTAs; the
    attention (`pallas_kernels.body.attention`) at the Qwen3-8B heads in every launch config,
    for a decode step (B=64 over 4096 slots) and a prefill (8 x 1024), bf16 output."""
    from pallas_kernels.body import attention as pa
    from pallas_kernels.body import attention_config as ac
    from pallas_kernels.body import matmul as pm
    from pallas_kernels.body import matmul_config as mc

    projections = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 12288), "down": (12288, 4096)}
    rows = {"decode": 1, "mid": 65, "mid_wide": 130, "prefill": 512}
    for proj, (k, n) in projections.items():
        for layout in ("kn", "nk"):
            w = _sds((k, n) if layout == "kn" else (n, k), jnp.bfloat16)
            for bucket in sorted(mc.BUCKETS):
                m = rows[bucket]

                def gemm(x, w, layout=layout, bucket=bucket):
                    return pm.matmul(x, w, w_layout=layout, out_dtype=jnp.bfloat16, bucket=bucket, num_ctas=132)

                jax.jit(gemm).trace(_sds((m, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",))
                yield f"body gemm {proj} {layout} M={m} {bucket}", _take()
    hq, hkv, dh = 32, 8, 128
    for case, (b, t, s) in {"decode": (64, 1, 4096), "prefill": (8, 1024, 1024)}.items():
        for config in sorted(ac.CONFIGS):

            def attn(q, k, v, pos, ks, config=config):
                return pa.attention(
                    q, k, v, q_positions=pos, kv_start=ks, scale=dh**-0.5, out_dtype=jnp.bfloat16, config=config
                )

            args = (_sds((b, t, hq, dh), jnp.bfloat16),) + (_sds((b, s, hkv, dh), jnp.bfloat16),) * 2
            args += (_sds((b, t), jnp.int32), _sds((b,), jnp.int32))
            jax.jit(attn).trace(*args).lower(lowering_platforms=("cuda",))
            yield f"body attention {case} B={b} T={t} S={s} {config}", _take()


def main(argv=None):
    which = (sys.argv[1:] if argv is None else argv) or ["base", "entropy"]
    bad = set(which) - {"base", "entropy", "walk", "fused", "fold", "body"}
    if bad:
        raise SystemExit(
            "usage: python -m benchmarks.mosaic_ir_hashes [base] [entropy] [walk] [fused] [fold] [body]; "
            f"unknown {sorted(bad)}"
        )
    _capture_modules()
    gens = []
    if "base" in which:
        gens += [forward_hashes, backward_hashes, fold_hashes]
    if "entropy" in which:
        gens += [
            lambda: forward_hashes(entropy=True),
            lambda: fold_hashes(entropy=True),
            lambda: backward_hashes(entropy=True),
        ]
    if "fold" in which and not {"base", "entropy"} & set(which):  # the fold lines of both sets alone
        gens += [fold_hashes, lambda: fold_hashes(entropy=True)]
    if "base" in which or "walk" in which:  # "walk" alone: the in-place walk's lines only
        gens.append(walk_hashes)
    if "base" in which or "fused" in which:  # "fused" alone: the fused forward's lines only
        gens.append(fused_hashes)
    if "body" in which:  # only when asked: its reference is a file of its own
        gens.append(body_hashes)
    for gen in gens:
        for name, digest in gen():
            print(f"{digest}  {name}", flush=True)


if __name__ == "__main__":
    main()
