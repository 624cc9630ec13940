"""The rank-ordered merge of a vocab-parallel call: `TPShards`.

Rank r of `tp` holds the vocabulary columns [r * shard, (r + 1) * shard), which are exactly
splits [r * n_local, (r + 1) * n_local) of the one-device split structure (the geometry is
checked by `sharding.geometry.check_tp_geometry`). The op pipeline
(`detlogp_jax.pipeline`) computes this rank's split partials and hands them here:

* the per-split (m, S) partials (and the entropy statistic A) travel by a tiled
  `all_gather` in rank order: no arithmetic happens in transit, and every rank then holds
  exactly the one-device [N, n_split] arrays, which the backend's own fold merges;
* the raw target logit z_t is all-gathered with its ownership flag and the owner's value
  is selected, never summed;
* sums over the ranks (d_hidden, the temperature's row sums) are formed after an
  all_gather, in ascending rank order, so every rank holds the same bytes.

No vocabulary statistic is ever reduced with psum / logsumexp / sum across ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax

from detlogp_jax import vma
from detlogp_jax.pipeline import VocabShards

__all__ = ["TPShards"]


def _gather_invariant(x, axis_name, *, axis, tiled):
    """all_gather in rank order, output typed as replicated over `axis_name`."""
    try:
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")
    except (TypeError, ValueError):  # no manual-axis typing (check_vma=False)
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


@dataclasses.dataclass(frozen=True)
class TPShards(VocabShards):
    """This rank's columns of a vocabulary sharded over the mesh axis `axis_name` (bound by
    the enclosing shard_map): `tp` ranks of `shard` columns; `static_offset` is this rank's
    first column when the program is not shared by several ranks (e.g. TP = 1)."""

    axis_name: Any
    tp: int
    shard: int
    static_offset: int | None = None

    def offset(self):
        """This rank's first global column (traced int32)."""
        if self.static_offset is not None:
            return jnp.int32(self.static_offset)
        return (lax.axis_index(self.axis_name) * self.shard).astype(jnp.int32)

    def gather_splits(self, x):
        """[N, n_local] -> [N, tp * n_local]: rank r's splits at [r * n_local, (r + 1) * n_local)."""
        return _gather_invariant(x, self.axis_name, axis=1, tiled=True)

    def select_owner(self, z_t, owned):
        """The owner rank's raw target logit per row (exactly one rank owns a real target)."""
        zt_all = _gather_invariant(z_t, self.axis_name, axis=0, tiled=False)  # [tp, N]
        own_all = _gather_invariant(owned, self.axis_name, axis=0, tiled=False)
        z_sel = jnp.zeros_like(zt_all[0])
        for r in range(self.tp):
            z_sel = jnp.where(own_all[r], zt_all[r], z_sel)
        return z_sel

    def rank_sum(self, x):
        """The sum over the ranks in ascending rank order (the same bytes on every rank)."""
        return vma.ordered_sum(x, self.axis_name)
