"""QuaRot (pipeline/quant/transforms/quarot.py, pipeline/quant/transforms/hadamard.py): the rotations, msModelSlim's output
reproduced bit for bit, and the float model's function kept."""

from __future__ import annotations

import logging

import pytest
import torch

from pinned_isa import TESTS, run_pinned
from pipeline import layout
from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.config import DeepseekV3Config
from pipeline.io.checkpoint import CheckpointReader
from pipeline.model import build_model
from pipeline.quant.transforms.hadamard import (
    Piece, Rotation, block_hadamard, identity, random_hadamard, random_signs, shifted_block_hadamard, sylvester)
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.transforms.quarot import build_rotations, description_entry, optional_tensors, rotate_globals, rotate_layer
from tiny import TINY_FIXTURE, random_tensors, tiny_config

CHECK = TESTS / "quarot_fixture_check.py"

# Rotation is exact in real arithmetic: in float32 the logits move by float32 rounding only (measured
# <= 9e-7 of the largest logit on both checkpoints).
F32_REL = 1e-5
# Rotated weights are rounded to bf16 (after the fold and after each rotation): per token, the largest
# logit error over the largest logit has median 0.23% on the embedded model (0.1% on the tiny one); a
# token whose router choice flips moves more (3% for one of 48). The top-1 token agrees for 98% / 100%.
BF16_MEDIAN_TOKEN_REL = 0.01
BF16_TOP1_AGREEMENT = 0.95
# msModelSlim's draw (torch CPU generator, seed 1234, randint(0, 2) per sign): the signs of the rows of
# the fixture's global_rotation.
SIGNS_16 = [1, 1, -1, 1, -1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, -1]


# ----- the rotation matrices -------------------------------------------------------------------------
def test_sylvester_and_random_hadamard():
    for n in (1, 2, 16, 32):
        h = sylvester(n)
        assert torch.equal(h @ h.T, n * torch.eye(n)) and torch.equal(h, h.T)
        i = torch.arange(n)
        assert torch.equal(h[3 % n], torch.tensor([(-1.0) ** bin(int(3 % n) & int(j)).count("1") for j in i]))
    assert random_signs(16).tolist() == SIGNS_16
    r = random_hadamard(32)
    assert torch.allclose(r @ r.T, torch.eye(32), atol=1e-6)
    assert torch.equal(r.abs(), torch.full((32, 32), 1 / 32 ** 0.5))
    assert torch.equal(random_hadamard(16) * 4, torch.tensor(SIGNS_16, dtype=torch.float32)[:, None] * sylvester(16))
    with pytest.raises(QuantError, match="order 12 is not a power of two"):
        sylvester(12)


def test_rotations_are_orthogonal_and_products_match_their_matrix():
    g = torch.Generator().manual_seed(0)
    rotations = [block_hadamard(64, 16, "hidden"), shifted_block_hadamard(64, 16, "q_lora"),
                 shifted_block_hadamard(96, 32, "q_lora"),
                 Rotation(block_hadamard(48, 16, "kv").pieces + (identity(16),)),
                 Rotation((identity(16),) + block_hadamard(16, 16, "v").pieces, repeat=4)]
    for r in rotations:
        m = r.matrix()
        assert m.shape == (r.dim, r.dim) and torch.allclose(m @ m.T, torch.eye(r.dim), atol=1e-6)
        w = torch.randn(8, r.dim, generator=g)
        assert torch.allclose(r.input_side(w), w @ m, atol=1e-6)
        assert torch.allclose(r.output_side(w.T), m.T @ w.T, atol=1e-6)
    # the shifted block-Hadamard R P R mixes neighbouring blocks (P rolls columns by 16)
    r = block_hadamard(64, 16, "q").matrix()
    p = torch.roll(torch.eye(64), 16, dims=1)
    shifted = shifted_block_hadamard(64, 16, "q").matrix()
    assert torch.equal(shifted, r @ p @ r) and shifted[:16, 16:32].abs().sum() > 0
    assert Piece(32).matrix().equal(torch.eye(32))


def test_block_size_must_divide_every_rotated_dimension(caplog):
    cfg = CheckpointReader(str(TINY_FIXTURE)).config  # hidden 128, q_lora 64, kv_lora 48, v 16
    with pytest.raises(QuantError) as e:
        build_rotations(cfg, 32)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("quarot block_size 32 does not divide kv_lora_rank 48, v_head_dim 16 ")
    for bad, what in ((24, "got 24"), (0, "got 0")):
        with pytest.raises(QuantError, match=f"block_size must be -1 or a positive power of two, {what}"):
            build_rotations(cfg, bad)
    with pytest.raises(QuantError, match="block_size -1 needs a Hadamard matrix of order kv_lora_rank 48"):
        build_rotations(cfg, -1)
    with caplog.at_level(logging.WARNING, logger="pipeline.quant.transforms.hadamard"):
        rot = build_rotations(cfg, 32, shrink=True)
    assert "block_size 32 does not divide kv_lora_rank 48; using block size 16 there" in caplog.text
    assert "v_head_dim 16; using block size 16" in caplog.text
    assert rot.hidden.pieces[0].block.shape == (32, 32) and rot.kv_lora.pieces[0].block.shape == (16, 16)
    _assert_function_kept(cfg, _read_all(CheckpointReader(str(TINY_FIXTURE)), torch.float32), rot)


# ----- msModelSlim's output ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["reference", "blocked"])
def test_matches_msmodelslim_quarot_c8(mode):
    """Every tensor of msModelSlim's quarot-c8 output that QuaRot alone determines, bit for bit (AVX2 kernels,
    as the fixture was made): 200 tensors (see quarot_fixture_check.py)."""
    result = run_pinned(CHECK, mode)
    differing = {k: v for k, v in result.items() if not v[0]}
    assert not differing, differing
    expected = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                "model.layers.1.mlp.gate.weight", "model.layers.0.post_attention_layernorm.weight",
                "model.layers.2.self_attn.kv_a_layernorm.weight",
                "model.layers.0.self_attn.kv_b_proj.weight[nope rows]",
                "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale",
                "model.layers.2.mlp.experts.7.up_proj.weight_scale",
                "model.layers.1.mlp.shared_experts.gate_proj.weight",
                "model.layers.3.embed_tokens.weight", "model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight",
                "model.layers.3.hnorm.weight", "model.layers.3.shared_head.norm.weight",
                "model.layers.3.shared_head.head.weight", "model.layers.3.self_attn.kv_b_proj.weight",
                "model.layers.3.self_attn.q_a_proj.weight", "model.layers.3.self_attn.q_b_proj.weight",
                "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.layers.3.self_attn.o_proj.weight",
                "optional/quarot.safetensors:global_rotation", "description:optional"}
    assert expected <= set(result) and len(result) == 200


def test_blocked_products_equal_full_products():
    """The default (block by block) and msModelSlim's full-matrix products give the same bits, on weights
    whose float32 sums are inexact (AVX2 kernels)."""
    result = run_pinned(CHECK, "products")
    assert len(result) == 16 and all(v[0] for v in result.values()), result


def test_optional_export():
    rot = build_rotations(CheckpointReader(str(TINY_FIXTURE)).config, 16)
    (name, g), = optional_tensors(rot).items()
    assert name == "global_rotation" and g.dtype == torch.float32 and g.shape == (128, 128)
    assert torch.equal(g, torch.block_diag(*[random_hadamard(16)] * 8))
    assert torch.equal(g[g != 0].abs(), torch.full((8 * 16 * 16,), 0.25))
    rotation_map = {"global_rotation": "optional/quarot.safetensors"}
    assert description_entry() == {"optional": {"quarot": {"rotation_map": rotation_map}}}


# ----- the float model's function ----------------------------------------------------------------------
def _read_all(reader: CheckpointReader, dtype) -> dict[str, torch.Tensor]:
    out = dict(reader.read_globals(dtype=dtype))
    for i in layout.all_layer_ids(reader.config):
        out.update(reader.read_layer(i, dtype=dtype))
    return out


def _rotate_all(cfg: DeepseekV3Config, tensors, rot) -> dict[str, torch.Tensor]:
    out = rotate_globals({k: v for k, v in tensors.items() if layout.layer_of(k) is None}, cfg, rot)
    for i in layout.all_layer_ids(cfg):
        out.update(rotate_layer({k: v for k, v in tensors.items() if layout.layer_of(k) == i}, i, cfg, rot))
    return out


def _run(cfg: DeepseekV3Config, tensors, ids):
    """(main logits, MTP logits fed the pre-norm final hidden state, as msModelSlim's MTP is calibrated)."""
    m = build_model(cfg, tensors, dtype=torch.float32)
    with torch.no_grad():
        h = m.run_layers(m.embed(ids), range(cfg.num_hidden_layers))
        mtp = m.mtp(h, torch.roll(ids, -1, 1))[0] if cfg.num_nextn_predict_layers else None
        return m.head(h), mtp


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _assert_function_kept(cfg, tensors32, rot):
    ids = torch.randint(2, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    (lo, mo), (lr, mr) = _run(cfg, tensors32, ids), _run(cfg, _rotate_all(cfg, tensors32, rot), ids)
    assert _rel(lr, lo) < F32_REL
    if mo is not None:
        assert _rel(mr, mo) < F32_REL


@pytest.mark.parametrize("path,block", [(str(TINY_FIXTURE), 16), (EMBEDDED_MODEL_DIR, 32)], ids=["tiny", "embedded"])
def test_rotation_keeps_the_float_models_function(path, block):
    reader = CheckpointReader(path)
    cfg = reader.config
    rot = build_rotations(cfg, block)
    _assert_function_kept(cfg, _read_all(reader, torch.float32), rot)
    # as written: bf16 weights (MTP modules float32), run in float32
    ids = torch.randint(2, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    bf16 = _read_all(reader, torch.bfloat16)
    rotated = _rotate_all(cfg, bf16, rot)
    assert rotated["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    assert rotated[f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"].dtype == torch.float32
    (lo, _), (lr, _) = _run(cfg, bf16, ids), _run(cfg, rotated, ids)
    per_token = (lr - lo).abs().amax(-1) / lo.abs().amax()
    assert float(per_token.median()) < BF16_MEDIAN_TOKEN_REL
    assert float((lr.argmax(-1) == lo.argmax(-1)).float().mean()) >= BF16_TOP1_AGREEMENT


@pytest.mark.parametrize("overrides", [{"q_lora_rank": None}, {"tie_word_embeddings": True}], ids=["q_proj", "tied"])
def test_variants_keep_the_function(overrides):
    """No q_lora (q_proj reads the stream; msModelSlim's adapter assumes q_lora) and tied embeddings (the
    head comes out as its own lm_head.weight), with norm weights that are not one."""
    cfg = DeepseekV3Config.from_dict(tiny_config(**overrides))
    tensors = random_tensors(cfg, dtype=torch.float32)
    rot = build_rotations(cfg, 16)
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in tensors and "lm_head.weight" in _rotate_all(cfg, tensors, rot)
    _assert_function_kept(cfg, tensors, rot)


# ----- streaming and bad input ---------------------------------------------------------------------------
def test_a_layer_may_come_in_pieces():
    cfg = DeepseekV3Config.from_dict(tiny_config())
    rot = build_rotations(cfg, 16)
    layer = {k: v for k, v in random_tensors(cfg).items() if layout.layer_of(k) == 1}
    whole = rotate_layer(layer, 1, cfg, rot)
    norm = "model.layers.1.post_attention_layernorm.weight"
    for group in (range(0, 4), range(4, 8)):
        part = {k: v for k, v in layer.items() if any(f".experts.{e}." in k for e in group) or k == norm}
        for k, v in rotate_layer(part, 1, cfg, rot).items():
            assert torch.equal(v, whole[k]), k
    assert torch.equal(whole[norm], torch.ones(cfg.hidden_size, dtype=torch.bfloat16))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert whole[bias] is layer[bias]


def test_bad_input_is_a_one_line_error():
    cfg = DeepseekV3Config.from_dict(tiny_config())
    rot = build_rotations(cfg, 16)
    t = {k: v for k, v in random_tensors(cfg).items() if layout.layer_of(k) == 0}
    up = "model.layers.0.mlp.up_proj.weight"
    cases = [
        ({up: t[up]}, 0, "model.layers.0.mlp.up_proj.weight: quarot needs "
                         "model.layers.0.post_attention_layernorm.weight in the same call to fold it"),
        ({"model.layers.0.mlp.up_proj.bias": torch.zeros(3)}, 0,
         "model.layers.0.mlp.up_proj.bias: quarot does not know"),
        ({up: t[up]}, 1, "model.layers.0.mlp.up_proj.weight: not a tensor of model.layers.1"),
        ({"model.layers.0.self_attn.o_proj.weight": t["model.layers.0.self_attn.o_proj.weight"].to(torch.int8)}, 0,
         "model.layers.0.self_attn.o_proj.weight: quarot needs a float weight, got torch.int8"),
        ({"model.layers.0.self_attn.o_proj.weight": t["model.layers.0.self_attn.o_proj.weight"][:, :32]}, 0,
         r"model.layers.0.self_attn.o_proj.weight: shape \[64, 32\] does not match the o_in rotation of size 64"),
    ]
    for tensors, lid, msg in cases:
        with pytest.raises(QuantError, match=msg):
            rotate_layer(tensors, lid, cfg, rot)
    with pytest.raises(QuantError, match="lm_head.weight: quarot needs model.norm.weight"):
        rotate_globals({"lm_head.weight": torch.zeros(512, 64)}, cfg, rot)
