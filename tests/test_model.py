"""The float model against transformers' DeepseekV3ForCausalLM (the external oracle), and its own forms
against each other: absorbed vs naive, cached decode vs full forward, MTP vs a composed reference."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import DeepseekV3Config
from pipeline.model import ModelCache, build_model
from pipeline.model.rope import inv_frequencies
from tiny import TINY_FIXTURE, tiny_config, write_checkpoint
from pipeline.io.checkpoint import read_model_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ORACLE_ATOL = 1e-4      # the bound for fp32 logits against transformers
FORMS_ATOL = 2e-5       # naive vs absorbed vs cached: same math, different summation order (fp32)


def load_ours(path, dtype=torch.float32):
    cfg = read_model_config(str(path / "config.json"))
    return build_model(cfg, load_file(str(path / "model.safetensors")), dtype=dtype)


def load_hf(path):
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()


def tokens(vocab: int, shape=(2, 37), seed=0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["fixture", "random_tiny", "q_lora_null", "no_yarn"])
def checkpoint(request, tmp_path_factory):
    if request.param == "fixture":
        return TINY_FIXTURE
    overrides = {"random_tiny": {}, "q_lora_null": {"q_lora_rank": None},
                 "no_yarn": {"rope_scaling": None, "first_k_dense_replace": 2}}[request.param]
    return write_checkpoint(tmp_path_factory.mktemp(request.param), tiny_config(**overrides), seed=7)


@torch.no_grad()
def test_logits_match_transformers(checkpoint):
    ours, hf = load_ours(checkpoint), load_hf(checkpoint)
    ids = tokens(ours.config.vocab_size)
    diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= ORACLE_ATOL, f"max |ours - transformers| = {diff}"


@torch.no_grad()
def test_absorbed_equals_naive(checkpoint):
    model = load_ours(checkpoint)
    ids = tokens(model.config.vocab_size)
    diff = (model(ids, absorb=True) - model(ids)).abs().max().item()
    assert diff <= FORMS_ATOL, diff


@torch.no_grad()
@pytest.mark.parametrize("absorb", [True, False])
def test_cached_decode_equals_full_forward(checkpoint, absorb):
    model = load_ours(checkpoint)
    cfg = model.config
    ids = tokens(cfg.vocab_size, (2, 20))
    full = model(ids)
    cache = ModelCache(cfg, 2, 20, torch.float32)
    steps = [model(ids[:, :7], cache, absorb=absorb)]                 # prefill 7, then chunks of 1 and 3
    steps += [model(ids[:, i:i + 1], cache, absorb=absorb) for i in range(7, 10)]
    steps += [model(ids[:, i:i + 3], cache, absorb=absorb) for i in range(10, 19, 3)]
    steps.append(model(ids[:, 19:], cache, absorb=absorb))
    diff = (torch.cat(steps, 1) - full).abs().max().item()
    assert diff <= FORMS_ATOL, diff
    assert cache[0].length == 20


def test_cache_overflow_is_a_clear_error(checkpoint):
    model = load_ours(checkpoint)
    cache = ModelCache(model.config, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="KV cache full: 0 \\+ 5 tokens exceed its capacity of 4"):
        model(tokens(model.config.vocab_size, (1, 5)), cache, absorb=True)


def rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@torch.no_grad()
def test_mtp_layer_matches_composed_reference(checkpoint):
    """MTP = eh_proj(cat(enorm(embed(t+1)), hnorm(h_t))) -> one decoder layer -> shared_head. The decoder
    layer of the reference is transformers' own DeepseekV3DecoderLayer holding the MTP layer's weights."""
    transformers = pytest.importorskip("transformers")
    path = checkpoint
    ours = load_ours(path)
    cfg = ours.config
    assert len(ours.mtp_layers) == 1
    L = cfg.num_hidden_layers
    raw = load_file(str(path / "model.safetensors"))
    t = {k: v.float() for k, v in raw.items()}
    p = f"model.layers.{L}."

    ids = tokens(cfg.vocab_size, (2, 16), seed=3)
    logits, hidden = ours(ids, return_hidden=True)
    got, _ = ours.mtp(hidden[:, :-1], ids[:, 1:])

    hf_cfg = transformers.AutoConfig.from_pretrained(str(path))
    hf_cfg.num_hidden_layers = L + 1
    hf_cfg._attn_implementation = "eager"
    with torch.device("meta"):
        full = transformers.DeepseekV3ForCausalLM(hf_cfg)
    block = full.model.layers[L]
    sd = {k[len(p):]: v for k, v in t.items() if k.startswith(p)}
    E = cfg.n_routed_experts
    sd["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([sd.pop(f"mlp.experts.{e}.gate_proj.weight"), sd.pop(f"mlp.experts.{e}.up_proj.weight")])
         for e in range(E)])
    sd["mlp.experts.down_proj"] = torch.stack([sd.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    own = {k: sd[k] for k in block.state_dict()}
    block.load_state_dict(own, assign=True)
    block.eval()
    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(hf_cfg)

    eps = cfg.rms_norm_eps
    e = rms(t[p + "embed_tokens.weight"][ids[:, 1:]], t[p + "enorm.weight"], eps)
    h = rms(hidden[:, :-1], t[p + "hnorm.weight"], eps)
    x = torch.cat([e, h], -1) @ t[p + "eh_proj.weight"].T
    pos = torch.arange(x.shape[1]).expand(2, -1)
    S = x.shape[1]
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    x = block(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))
    x = x[0] if isinstance(x, tuple) else x
    want = rms(x, t[p + "shared_head.norm.weight"], eps) @ t[p + "shared_head.head.weight"].T
    diff = (got - want).abs().max().item()
    assert diff <= ORACLE_ATOL, diff


def test_yarn_frequencies_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.AutoConfig.from_pretrained(str(TINY_FIXTURE))
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    got = inv_frequencies(read_model_config(str(TINY_FIXTURE / "config.json")))
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert factor == 1.0


def test_softmax_scale_v3():
    """192^-0.5 * (0.1 ln 40 + 1)^2 = 0.1352338 for V3 (docs/deepseek.md)."""
    cfg = DeepseekV3Config.from_dict(tiny_config(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
    assert cfg.softmax_scale == pytest.approx(0.1352338, abs=5e-8)
    assert DeepseekV3Config.from_dict(tiny_config(rope_scaling=None)).softmax_scale == pytest.approx(32 ** -0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_cuda_matches_cpu():
    cpu = load_ours(TINY_FIXTURE)
    gpu = build_model(cpu.config, load_file(str(TINY_FIXTURE / "model.safetensors")), torch.float32, "cuda")
    ids = tokens(cpu.config.vocab_size)
    diff = (cpu(ids) - gpu(ids.cuda()).cpu()).abs().max().item()
    assert diff <= ORACLE_ATOL, diff
    diff = (gpu(ids.cuda(), absorb=True).cpu() - cpu(ids)).abs().max().item()
    assert diff <= ORACLE_ATOL, diff


@torch.no_grad()
@pytest.mark.parametrize("split", [[], [1], [1, 2], [0, 3]])
def test_layer_ranges_compose_to_the_full_forward(checkpoint, split):
    """A pipeline stage runs embed / a range of layers / head: any split gives the full forward bit for bit."""
    model = load_ours(checkpoint)
    L = model.config.num_hidden_layers
    ids = tokens(model.config.vocab_size, (2, 19))
    bounds = [0] + [b for b in split if 0 < b < L] + [L]
    h = model.embed(ids)
    for a, b in zip(bounds, bounds[1:]):
        h = model.run_layers(h, range(a, b))
    assert torch.equal(model.head(h), model(ids))
    with pytest.raises(ValueError, match="layer 3 is not a main layer"):
        model.run_layers(h, [L])


def test_to_a_narrow_dtype_keeps_the_router_bias_exact():
    from pipeline.model.loading import load_model

    m = load_model(str(TINY_FIXTURE), dtype=torch.float32, device="cpu")
    before = m.model.layers[1].mlp.gate.e_score_correction_bias.clone()
    assert not torch.equal(before, before.bfloat16().float())          # the check below can fail
    m.to(torch.bfloat16)
    after = m.model.layers[1].mlp.gate.e_score_correction_bias
    assert after.dtype == torch.float32 and torch.equal(after, before)
