"""Op counts of the chunked backward's compiled HLO: what runs per vocab chunk (the
scan's while body and everything it calls) and what runs once (any platform; compiles,
never runs). Counts dynamic-update-slice, dynamic-slice, broadcast, select, dot, ...
and lists those at least one chunk in size, e.g. the zero fill of dW (once) or a
read-back of dW (per chunk).

    PYTHONPATH=. python3 -m benchmarks.experiments.chunk_walk_hlo                 # small f32 cases
    PYTHONPATH=. python3 -m benchmarks.experiments.chunk_walk_hlo --n 4096 --d 4096 --v 152064 \\
        --vocab 151936 --dtype bf16 --residuals logits                           # a Qwen3-8B head

The program is `jax.jit(grad.backward)` with cotangents of logp and lse, `--chunk` rows per
chunk (default `grad.DEFAULT_CHUNK`); `--residuals logits` passes saved logits [n, v] (the
residual mode: no recompute GEMM). `--json` writes the counts.
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from detlogp_jax import grad

OPS = ("dynamic-update-slice", "dynamic-slice", "broadcast", "select", "dot", "compare", "slice", "gather", "copy")
LARGE = ("broadcast", "dynamic-update-slice", "dynamic-slice", "select", "copy", "slice", "gather")


def _parse(hlo: str):
    """{computation: [(opcode, shape)]} and {computation: callees} of HLO text."""
    comps, calls, cur = {}, {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            cur = m.group(2)
            comps[cur], calls[cur] = [], set()
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is not None and "=" in line:
            mm = re.search(r"=\s*(\S+)\s+([a-z][a-z0-9\-]*)\(", line)
            if mm:
                comps[cur].append((mm.group(2), mm.group(1)))
            for key in ("calls", "body", "condition", "to_apply"):
                calls[cur].update(re.findall(key + r"=%?([\w.\-]+)", line))
    return comps, calls


def _reach(roots, calls):
    out, todo = set(), list(roots)
    while todo:
        c = todo.pop()
        if c not in out:
            out.add(c)
            todo.extend(calls.get(c, ()))
    return out


def count_ops(hlo: str, large_elems: int) -> dict:
    """Per-chunk (reachable from a while body) and once (the rest) op counts of compiled HLO."""
    comps, calls = _parse(hlo)
    in_body = _reach(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo), calls)
    entry = re.search(r"^ENTRY %?([\w.\-]+) ", hlo, re.M).group(1)
    once = _reach([entry], calls) - in_body
    out = {}
    for name, group in (("per_chunk", in_body), ("once", once)):
        counts, large = {op: 0 for op in OPS}, []
        for c in group:
            for op, shape in comps.get(c, ()):
                if op in counts:
                    counts[op] += 1
                    dims = [int(x) for x in re.findall(r"\d+", shape.split("[", 1)[-1].split("]")[0])]
                    if op in LARGE and int(np.prod(dims or [1])) >= large_elems:
                        large.append(f"{op} {shape.split('{')[0]}")
        out[name] = {"counts": counts, "chunk_sized_or_larger": sorted(large)}
    return out


def backward_hlo(n, d, v, vocab, chunk, layout, dtype, bias, residuals) -> str:
    """Compiled HLO text of jit(grad.backward) on abstract operands of these shapes."""
    f32 = jnp.float32
    sds = jax.ShapeDtypeStruct
    args = (
        sds((n, d), dtype),
        sds((v, d) if layout == "vd" else (d, v), dtype),
        sds((v,), f32) if bias else None,
        sds((n,), jnp.int32),
        sds((n,), f32),
        sds((n,), f32),
        sds((n,), f32),
        sds((n,), f32),
        sds((n, v), f32) if residuals == "logits" else None,
    )

    def fn(h, w, b, t, inv_t, lse, g_logp, g_lse, z):
        kw = {} if z is None else {"logits": z}  # (no logits= on commits before the residual mode)
        return grad.backward(
            h, w, b, t, inv_t, lse, g_logp, g_lse, None, vocab_size=vocab, chunk=chunk, weight_layout=layout, **kw
        )

    return jax.jit(fn).lower(*args).compile().as_text()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=9)
    p.add_argument("--d", type=int, default=16)
    p.add_argument("--v", type=int, nargs="*", default=[1000, 960], help="weight rows (one case each)")
    p.add_argument("--vocab", type=int, default=None, help="real vocabulary (default: v - 10)")
    p.add_argument(
        "--chunk", type=int, default=None, help=f"default: 96 for the small cases, else {grad.DEFAULT_CHUNK}"
    )
    p.add_argument("--layouts", nargs="*", default=["vd", "dv"])
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--bias", action="store_true")
    p.add_argument("--residuals", choices=["recompute", "logits"], default="recompute")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[a.dtype]
    chunk = a.chunk or (96 if max(a.v) <= 4096 else grad.DEFAULT_CHUNK)
    res = {}
    for v in a.v:
        for layout in a.layouts:
            vocab = a.vocab or v - 10
            name = f"{layout}_n{a.n}_d{a.d}_v{v}_c{chunk}_{a.dtype}{'_bias' if a.bias else ''}_{a.residuals}"
            hlo = backward_hlo(a.n, a.d, v, vocab, chunk, layout, dtype, a.bias, a.residuals)
            res[name] = count_ops(hlo, large_elems=min(chunk, v) * a.d)
            tail = "clamped last chunk" if v % min(chunk, v) else "chunk divides V"
            print(f"{name} ({tail})")
            for k in ("per_chunk", "once"):
                c = res[name][k]
                print(f"  {k:<10}", " ".join(f"{o}={c['counts'][o]}" for o in OPS))
                print(f"  {'':<10} chunk-sized or larger: {c['chunk_sized_or_larger']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
