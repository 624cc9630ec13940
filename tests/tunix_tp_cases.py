"""Vocab-parallel `per_token_logps` of tiny Tunix models for `tests/test_tunix.py`, on 2 host devices.

Run as `python tests/tunix_tp_cases.py OUT.json` with
XLA_FLAGS=--xla_force_host_platform_device_count=2 (set before JAX starts, hence a subprocess).
The model's parameters are placed by their own sharding metadata on a ('fsdp', 'tp') = (1, 2) mesh,
so the lm_head is sharded over its vocabulary axis; `per_token_logps` under `with mesh:` must route
through `sharding.linear_logp_tp` (tp_axis="auto" reads the head Param's metadata) and give Tunix's
own values within rounding; on one set of hidden states the sharded op must give the bytes of the
unsharded one (tp_axis=None). (End to end the bytes may differ: XLA partitions the model body's
matmuls over the sharded parameters.) Writes one JSON
object per case.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def run() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tunix.rl import common

    import sharding
    from detlogp_jax.integrations import tunix as dt
    from tests.tunix_models import PAD, batch, make_model

    assert len(jax.devices()) == 2, jax.devices()
    mesh = jax.make_mesh((1, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    calls = []
    real_tp = sharding.linear_logp_tp

    def spy(*a, **k):
        calls.append((k.get("tp_axis"), k.get("weight_layout")))
        return real_tp(*a, **k)

    sharding.linear_logp_tp = spy
    prompt, comp = batch(seed=3, vocab=256)
    mask = comp != PAD
    out = {}
    for tied in (False, True):
        model = make_model("qwen3", tied, vocab=256)  # 2 shards of 128 columns: split edges
        with mesh:
            state = nnx.state(model)
            state = jax.device_put(state, nnx.get_named_sharding(state, mesh))
            nnx.update(model, state)
            w, layout = dt.head_weight(model)
            calls.clear()
            f = jax.jit(lambda p, c: dt.per_token_logps(model, p, c, pad_id=PAD, eos_id=2, temperature=0.7))
            tp_e2e = np.asarray(f(prompt, comp))
            routed = list(calls)
            gd, st = nnx.split(model)
            ref = np.asarray(
                common.compute_per_token_logps(gd, st, jnp.asarray(prompt), jnp.asarray(comp), 0, 2, temperature=0.7)
            )
            # the op alone, on one set of hidden states: vocab-sharded vs unsharded bytes
            rng = np.random.default_rng(0)
            h = jnp.asarray(rng.standard_normal((3, 4, 32)).astype(np.float32))
            t = jnp.asarray(rng.integers(0, 256, (3, 4)).astype(np.int32))
            op_tp = np.asarray(jax.jit(lambda h, t: dt.token_logps(model, h, t, temperature=0.7))(h, t))
            op_plain = np.asarray(
                jax.jit(lambda h, t: dt.token_logps(model, h, t, temperature=0.7, tp_axis=None))(h, t)
            )
        calls.clear()
        with jax.set_mesh(mesh):  # the other way to give an ambient mesh
            op_set_mesh = np.asarray(jax.jit(lambda h, t: dt.token_logps(model, h, t, temperature=0.7))(h, t))
        routed_set_mesh = list(calls)
        out["tied" if tied else "untied"] = {
            "routed_set_mesh": routed_set_mesh,
            "set_mesh_bits_equal": bool((op_set_mesh.view(np.uint32) == op_plain.view(np.uint32)).all()),
            "layout": layout,
            "weight_sharding": str(w.sharding.spec),
            "routed": routed,
            "op_bits_equal_unsharded": bool((op_tp.view(np.uint32) == op_plain.view(np.uint32)).all()),
            "max_diff_vs_tunix": float(np.max(np.abs(tp_e2e - ref)[mask])),
        }
    return out


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(run(), f)
