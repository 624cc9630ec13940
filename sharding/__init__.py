"""Tensor (vocab) and context/data (row) parallelism for `linear_logp`.

See `docs/TENSOR_PARALLEL.md`. Entry points:

* `linear_logp_tp(hidden, weight, targets, *, mesh, tp_axis="tp", row_axes=(), **options)`
  - global arrays in, global arrays out (runs its own `jax.shard_map`); `options` are
  `linear_logp`'s keywords;
* `linear_logp_local(...)` - differentiable, inside the caller's shard_map;
* `tp_partials_and_fold(...)` - the non-differentiable forward, inside shard_map;
* `check_tp_geometry(V_pad, tp, vocab_size)` and `assemble_shards(...)` (`sharding.geometry`);
* `TPShards`: a rank's vocabulary shard and the rank-ordered merge (`sharding.merge`).
"""

from sharding.geometry import assemble_shards, check_tp_geometry
from sharding.merge import TPShards
from sharding.tp import linear_logp_local, linear_logp_tp, tp_partials_and_fold

# This package's mark: `detlogp_jax.plugins.tensor_parallel()` checks it, so that another
# module named `sharding` earlier on sys.path is refused instead of used.
DISTRIBUTION = "detlogp-jax"

__all__ = [
    "DISTRIBUTION",
    "TPShards",
    "assemble_shards",
    "check_tp_geometry",
    "linear_logp_local",
    "linear_logp_tp",
    "tp_partials_and_fold",
]
