"""lm_head shapes of the models we benchmark.

`v_rows` is the number of weight rows allocated (the canonical padded vocab,
`detlogp_jax.contract.canonical_padded_vocab`, unless stated), `v_real` the
real vocabulary passed as `vocab_size`. Rows at or beyond `v_real` are padding.
"""

from __future__ import annotations

import dataclasses

from detlogp_jax.contract import canonical_padded_vocab


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    d: int  # hidden size
    v_real: int  # real vocabulary (vocab_size)
    v_rows: int  # weight rows = padded_vocab_size
    note: str = ""

    def __post_init__(self):
        if not (1 <= self.v_real <= self.v_rows) or self.d < 1:
            raise ValueError(f"bad shape {self}")


def _canonical(name: str, d: int, v_real: int, note: str = "") -> Shape:
    return Shape(name, d, v_real, canonical_padded_vocab(v_real), note)


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        _canonical("qwen3_8b", 4096, 151936, "Qwen3-8B; 151936 -> 152064 padded"),
        _canonical("llama3_8b", 4096, 128256, "Llama-3-8B; 128256 -> 128512 padded"),
        _canonical(
            "gemma3",
            3840,
            262144,
            "Gemma-3-12B hidden size 3840, tokenizer vocab 262144 (already canonical); the HF "
            "checkpoint's embedding has 262208 rows: use --shape custom --d 3840 --v_real 262208 for that",
        ),
        _canonical("gpt_oss", 2880, 201088, "gpt-oss-20b/120b; 201088 -> 201216 padded"),
        _canonical("tiny", 64, 1000, "CPU smoke test; 1000 -> 1024 padded"),
    )
}


def get(name: str, *, d: int | None = None, v: int | None = None, v_real: int | None = None) -> Shape:
    """A named shape, or `custom` built from d / v (weight rows) / v_real.

    For `custom`, v defaults to the canonical padding of v_real and v_real to v.
    """
    if name != "custom":
        if name not in SHAPES:
            raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)} or 'custom'")
        return SHAPES[name]
    if d is None or (v is None and v_real is None):
        raise ValueError("--shape custom needs --d and --v and/or --v_real")
    v_real = v if v_real is None else v_real
    v = canonical_padded_vocab(v_real) if v is None else v
    return Shape(f"custom_d{d}_v{v}_r{v_real}", d, v_real, v, "custom")
