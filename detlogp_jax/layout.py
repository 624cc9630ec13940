"""The weight layout: which axis of the lm_head weight indexes the vocabulary.

A call names its layout once (`weight_layout="vd"` or `"dv"` at the public API); every
layer below receives a `WeightLayout`, which knows how to read W in that layout, so no
module branches on the name:

* `VD`: [V, D], the lm_head layout (PyTorch, HF checkpoints, a tied embedding table);
* `DV`: [D, V], a Flax/Tunix kernel (`nnx.Linear(D, V).kernel`, Tunix's lm_head Einsum),
  read in place: no transpose or copy of W on any backend.

The layout is never guessed from shapes (a square weight is ambiguous). `WeightLayout` is
frozen and hashable, so it rides in jit-static configs (it is not equal to its name: code
below the API compares layouts, never strings); `as_layout` turns the public names into it.
"""

from __future__ import annotations

import dataclasses

from jax import lax
from jax.sharding import PartitionSpec as P

__all__ = ["DV", "LAYOUTS", "VD", "WeightLayout", "as_layout"]


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """How a 2-D lm_head weight holds its vocabulary rows (see the module docstring)."""

    name: str  # the public name: "vd" or "dv"
    vocab_axis: int  # 0 for [V, D], 1 for [D, V]

    @property
    def d_axis(self) -> int:
        """The weight axis that indexes the hidden size D."""
        return 1 - self.vocab_axis

    @property
    def transposed(self) -> bool:
        """True for [D, V]: the GEMM's B operand is N-major (wgmma reads it as `ref.T`)."""
        return self.vocab_axis == 1

    @property
    def shape_name(self) -> str:
        """The weight's shape in words, for error messages."""
        return (
            f"[V, D] (weight_layout={self.name!r})" if self.vocab_axis == 0 else f"[D, V] (weight_layout={self.name!r})"
        )

    @property
    def einsum(self) -> str:
        """The weight's einsum subscripts: 'vd' or 'dv' (logits are 'nd,<this>->nv')."""
        return self.name

    @property
    def other(self) -> "WeightLayout":
        return DV if self is VD else VD

    def vocab_rows(self, weight) -> int:
        """V: the weight's vocabulary rows (padding included)."""
        return weight.shape[self.vocab_axis]

    def hidden_size(self, weight) -> int:
        """D: the weight's hidden size."""
        return weight.shape[self.d_axis]

    def shape(self, v: int, d: int) -> tuple[int, int]:
        """The shape of a weight of V rows and D columns in this layout."""
        return (v, d) if self.vocab_axis == 0 else (d, v)

    def chunk(self, weight, start, size: int):
        """Vocabulary rows [start, start + size) of the weight, in this layout (a slice, read in place)."""
        return lax.dynamic_slice_in_dim(weight, start, size, axis=self.vocab_axis)

    def put_chunk(self, weight, chunk, start):
        """`weight` with vocabulary rows [start, start + chunk's rows) replaced by `chunk`."""
        return lax.dynamic_update_slice_in_dim(weight, chunk, start, axis=self.vocab_axis)

    def spec(self, vocab_axis_name) -> P:
        """The PartitionSpec that shards the vocabulary over `vocab_axis_name` (None: replicated)."""
        return P(vocab_axis_name, None) if self.vocab_axis == 0 else P(None, vocab_axis_name)

    def __repr__(self) -> str:
        return f"WeightLayout({self.name!r})"


VD = WeightLayout("vd", 0)
DV = WeightLayout("dv", 1)
LAYOUTS = {VD.name: VD, DV.name: DV}


def as_layout(layout) -> WeightLayout:
    """The `WeightLayout` for a public name ("vd", "dv") or a `WeightLayout`; ValueError otherwise."""
    if isinstance(layout, WeightLayout):
        return layout
    if isinstance(layout, str) and layout in LAYOUTS:
        return LAYOUTS[layout]
    raise ValueError(f"weight_layout must be 'vd' ([V, D], lm_head) or 'dv' ([D, V], a Flax kernel), got {layout!r}")
