"""The contract module: split policy, padded vocab rule, frozen constants."""

import pytest

from detlogp_jax import contract as C

# (V_pad, expected n_split, expected tiles per split)
PRODUCTION = [
    (152064, 264, {9}),  # Qwen3 canonical padded (real 151936)
    (151936, 264, {8, 9}),  # Qwen3 real vocab used as its own padded size
    (128256, 264, {7, 8}),  # Llama-3 real
    (128512, 264, {7, 8}),  # Llama-3 canonical padded for TP <= 8
    (201088, 264, {11, 12}),  # gpt-oss real
    (262144, 264, {15, 16}),  # Gemma-3
]


@pytest.mark.parametrize("v_pad,n_split,sizes", PRODUCTION)
def test_split_policy_production_vocabs(v_pad, n_split, sizes):
    plan = C.split_bounds(v_pad)
    assert plan.n_split == n_split
    assert {e - s for s, e in zip(plan.starts, plan.ends)} == sizes
    # contiguous, ascending, covering all tiles
    assert plan.starts[0] == 0 and plan.ends[-1] == plan.n_tiles
    assert all(e == s for e, s in zip(plan.ends[:-1], plan.starts[1:]))
    assert plan.n_split >= 132  # one decode row keeps 132 SMs busy


def test_tp_shard_edges_are_split_edges():
    for v_pad in (152064, 128512, 262144, C.canonical_padded_vocab(201088)):
        plan = C.split_bounds(v_pad)
        assert plan.aligned_tp_degrees()[:4] == (1, 2, 4, 8)
        edges = set(plan.starts) | {plan.n_tiles}
        for tp in (1, 2, 4, 8):
            shard_tiles = plan.n_tiles // tp
            assert plan.n_tiles % tp == 0
            assert all(r * shard_tiles in edges for r in range(tp + 1)), (v_pad, tp)


def test_unaligned_vocab_reports_fewer_tp_degrees():
    assert C.split_bounds(151936).aligned_tp_degrees() == (1, 2)  # 2374 tiles
    assert C.split_bounds(128256).aligned_tp_degrees() == (1, 2, 4)


def test_canonical_padded_vocab():
    assert C.canonical_padded_vocab(151936) == 152064
    assert C.canonical_padded_vocab(128256) == 128512
    assert C.canonical_padded_vocab(262144) == 262144
    assert C.canonical_padded_vocab(1) == 512
    assert C.canonical_padded_vocab(1000, tp_max=2) == 1024
    with pytest.raises(ValueError):
        C.canonical_padded_vocab(0)
    with pytest.raises(ValueError):
        C.canonical_padded_vocab(100, tp_max=3)


@pytest.mark.parametrize("v", [1, 63, 64, 65, 300, 1000, 1024, 5120])
def test_small_vocabs(v):
    plan = C.split_bounds(v)
    assert plan.n_tiles == -(-v // 64)
    assert plan.starts[0] == 0 and plan.ends[-1] == plan.n_tiles
    assert all(e > s for s, e in zip(plan.starts, plan.ends))
    assert plan.n_split == min(plan.n_tiles, plan.groups * -(-264 // plan.groups))


def test_split_count_depends_only_on_padded_vocab():
    assert C.split_bounds(152064) == C.split_bounds(152064)
    assert C.n_split(152064) == 264


def test_overrides_raise():
    with pytest.raises(C.ContractError, match="TILE_V"):
        C.check_no_overrides({"TILE_V": 128})
    with pytest.raises(C.ContractError, match="tile_v"):
        C.check_no_overrides({"tile_v": 128})
    with pytest.raises(C.ContractError, match="unknown tuning option"):
        C.check_no_overrides({"n_split": 8})
    with pytest.raises(C.ContractError, match="DETLOGP_TILE_V"):
        C.check_no_overrides(environ={"DETLOGP_TILE_V": "128"})
    C.check_no_overrides({"bucket": "decode", "row_block": 8}, environ={"DETLOGP_STRICT": "1"})
    with pytest.raises(C.ContractError, match="unknown tuning option"):
        C.check_no_overrides({"block_m": 128})  # not a knob any backend applies


def test_provenance_constants_complete():
    consts = C.contract_constants()
    for key in (
        "TILE_V",
        "K_WALK",
        "SPLIT_POLICY",
        "TILE_TREE",
        "CHAIN",
        "FOLD_ORDER",
        "EXP",
        "LOG",
        "FTZ",
        "BIAS",
        "TEMPERATURE",
        "PADDING",
        "CLAMP",
    ):
        assert key in consts
    C._self_check()


def test_contract_doc_matches_code():
    """docs/CONTRACT.md states every f32 constant's bits; a silent change of either fails."""
    import os
    import re

    import numpy as np

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "CONTRACT.md")).read()
    assert f"`{C.CONTRACT_ID}`" in doc
    for name, values in (("EXP_POLY", C.EXP_POLY), ("LOG_POLY", C.LOG_POLY)):
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}`"))
        hexes = re.findall(r"0x[0-9A-F]{8}", row)
        assert hexes == [f"0x{int(np.float32(v).view(np.uint32)):08X}" for v in values], name
    for name in ("EXP_LOG2E", "EXP_LN2_HI", "EXP_LN2_LO", "LOG_SQRT2", "EXP_ROUND_MAGIC"):
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}`"))
        assert f"0x{int(np.float32(getattr(C, name)).view(np.uint32)):08X}" in row, name
    for name in ("TILE_V", "TP_MAX", "TARGET_SPLITS", "IGNORE_INDEX", "EXP_CLAMP_LO", "EXP_K_MIN"):
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}`"))
        assert f"| {getattr(C, name):g} |".replace(".0 |", " |") in row.replace(".0 |", " |"), name


def test_bad_target_predicate_numpy_and_jax_agree():
    import jax.numpy as jnp
    import numpy as np

    t = np.array([-101, -100, -99, -1, 0, 5, 999, 1000, 1001], np.int32)
    want = np.array([True, False, True, True, False, False, False, True, True])
    assert np.array_equal(C.bad_target(t, 1000), want)
    assert np.array_equal(np.asarray(C.bad_target(jnp.asarray(t), 1000)), want)


def test_local_splits_are_the_splits_inside_a_shard():
    v_pad = 152064
    plan = C.split_bounds(v_pad)
    assert list(C.local_splits(v_pad, 0, v_pad)) == list(range(plan.n_split))
    for tp in (2, 4, 8):
        shard = v_pad // tp
        got = [C.local_splits(v_pad, r * shard, shard) for r in range(tp)]
        assert [len(g) for g in got] == [plan.n_split // tp] * tp
        assert [j for g in got for j in g] == list(range(plan.n_split))
    with pytest.raises(C.ContractError, match="tile"):
        C.local_splits(v_pad, 32, 1024)
    with pytest.raises(C.ContractError, match="split edges"):
        C.local_splits(v_pad, 0, 64)  # one tile of a multi-tile split


def test_provenance_prints_its_key_fields_one_per_line():
    import numpy as np

    import detlogp_jax as dl

    out = dl.linear_logp(np.ones((2, 64), np.float32), np.ones((512, 64), np.float32), np.array([1, 2]))
    text = repr(out.provenance)
    lines = text.splitlines()
    assert len(text) < 600 and 5 <= len(lines) <= 10, text
    assert "linear-logp-contract-v1" in text and "backend:   reference" in text and "512 real of 512" in text
    assert str(out.provenance) == text
    full = out.provenance.as_dict()  # the whole record is still there
    assert full["constants"] and full["jax_version"] and full["n_split"] == 8
