"""The decoder layer, the MTP layer and the causal LM, with HF module names.

Block: ``h = h + MLA(input_layernorm(h)); h = h + FFN(post_attention_layernorm(h))``; then ``model.norm``
and ``lm_head``. The MTP layer (``model.layers.{num_hidden_layers}``) predicts token t+2 from the main
model's final (normed) hidden state at t and the embedding of token t+1::

    x = eh_proj(cat([enorm(embed(tok[t+1])), hnorm(hidden[t])], -1));  x = DecoderLayer(x)
    logits = shared_head.head(shared_head.norm(x))

(the hidden state fed to MTP is the main model's output after ``model.norm``, as vLLM and SGLang pass it.)
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from pipeline.config import DeepseekV3Config
from pipeline.model.cache import ModelCache
from pipeline.model.ffn import MLP, MoE
from pipeline.model.mla import MLA
from pipeline.model.norm import RMSNorm
from pipeline.model.rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, layer_id: int, device=None, dtype=None):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.self_attn = MLA(cfg, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = MoE(cfg, device, dtype) if cfg.is_moe_layer(layer_id) else MLP(
            cfg.hidden_size, cfg.intermediate_size, device, dtype)

    def forward(self, h, cos, sin, cache=None, absorb=False) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, absorb)
        return h + self.mlp(self.post_attention_layernorm(h))


class SharedHead(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, device=None, dtype=None):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)


def embedding(num: int, dim: int, device=None, dtype=None) -> nn.Embedding:
    """``nn.Embedding``; on the meta device (the device argument's or the one in force) without its random
    init, which means nothing there and which torch runs on meta through reference ops whose first call
    imports torch._dynamo, the slowest part of torch to import, in every process that builds a model."""
    if torch.empty(0, device=device).is_meta:
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim, device=device, dtype=dtype))
    return nn.Embedding(num, dim, device=device, dtype=dtype)


class MTPLayer(DecoderLayer):
    """A full (MoE) decoder layer plus its own embedding, input norms, projection and head."""

    def __init__(self, cfg: DeepseekV3Config, layer_id: int, device=None, dtype=None):
        super().__init__(cfg, layer_id, device, dtype)
        h = cfg.hidden_size
        self.embed_tokens = embedding(cfg.vocab_size, h, device, dtype)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, device=device, dtype=dtype)
        self.shared_head = SharedHead(cfg, device, dtype)

    def predict(self, hidden, next_ids, cos, sin, cache=None, absorb=False) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, S, h] (main model output at t), next_ids [B, S] (tokens t+1) -> (logits for t+2
        [B, S, V], this layer's hidden [B, S, h])."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(next_ids)), self.hnorm(hidden)], dim=-1))
        x = DecoderLayer.forward(self, x, cos, sin, cache, absorb)
        return self.shared_head.head(self.shared_head.norm(x)), x


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, device=None, dtype=None, with_mtp: bool = True):
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, device, dtype)
        layers: list[nn.Module] = [DecoderLayer(cfg, i, device, dtype) for i in range(cfg.num_hidden_layers)]
        if with_mtp:
            layers += [MTPLayer(cfg, i, device, dtype) for i in cfg.mtp_layer_ids]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)


class DeepseekV3ForCausalLM(nn.Module):
    """The float model. ``forward`` runs the main layers; ``mtp`` runs the MTP layer(s)."""

    def __init__(self, cfg: DeepseekV3Config, device=None, dtype=None, with_mtp: bool = True):
        super().__init__()
        self.config = cfg
        self.model = DeepseekV3Model(cfg, device, dtype, with_mtp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        self.rotary = Rotary(cfg, device=None if device == "meta" else device)

    @property
    def main_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers[: self.config.num_hidden_layers])

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.model.layers[self.config.num_hidden_layers:])

    def _positions(self, input_ids: torch.Tensor, start: int) -> torch.Tensor:
        B, S = input_ids.shape
        return torch.arange(start, start + S, device=input_ids.device).expand(B, S)

    def forward(self, input_ids: torch.Tensor, cache: ModelCache | None = None, absorb: bool = False,
                return_hidden: bool = False):
        """input_ids [B, S] -> logits [B, S, V] (float32); with ``return_hidden`` also the final normed
        hidden state [B, S, h]. With a cache, the tokens continue the cached sequences.

        The same as ``head(run_layers(embed(ids), range(num_hidden_layers)))``: the pieces a pipeline
        stage runs when it owns only some layers."""
        h = self.run_layers(self.embed(input_ids), range(self.config.num_hidden_layers), cache, absorb)
        return self.head(h, return_hidden)

    def final_hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] -> the final normed hidden state [B, S, h] (what the MTP layer reads), without
        the logits: ``forward(input_ids, return_hidden=True)[1]``, the same tensor."""
        return self.model.norm(self.run_layers(self.embed(input_ids), range(self.config.num_hidden_layers)))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] -> hidden [B, S, h] (stage 0's first step)."""
        return self.model.embed_tokens(input_ids)

    def run_layers(self, h: torch.Tensor, layer_ids, cache: ModelCache | None = None,
                   absorb: bool = False, start: int | None = None) -> torch.Tensor:
        """Main decoder layers ``layer_ids`` (ascending) on hidden [B, S, h] at positions start.. (default:
        the cache's length, else 0)."""
        ids = list(layer_ids)
        if start is None:
            start = cache[ids[0]].length if cache is not None and ids else 0
        B, S = h.shape[:2]
        cos, sin = self.rotary.cos_sin(torch.arange(start, start + S, device=h.device).expand(B, S))
        for i in ids:
            if not 0 <= i < self.config.num_hidden_layers:
                raise ValueError(f"layer {i} is not a main layer (0..{self.config.num_hidden_layers - 1})")
            h = self.model.layers[i](h, cos, sin, cache[i] if cache is not None else None, absorb)
        return h

    def head(self, h: torch.Tensor, return_hidden: bool = False):
        """Final norm and lm_head: hidden [B, S, h] -> logits [B, S, V] float32 (and the normed hidden)."""
        h = self.model.norm(h)
        logits = self.lm_head(h).float()
        return (logits, h) if return_hidden else logits

    def mtp(self, hidden: torch.Tensor, next_ids: torch.Tensor, cache: ModelCache | None = None,
            absorb: bool = False, depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer ``depth``: hidden [B, S, h] at positions t, next_ids [B, S] = tokens t+1 ->
        (logits [B, S, V] float32 for tokens t+2, its hidden [B, S, h]). Positions are those of t."""
        layer = self.mtp_layers[depth]
        lc = cache[layer.layer_id] if cache is not None else None
        start = lc.length if lc is not None else 0
        cos, sin = self.rotary.cos_sin(self._positions(next_ids, start))
        logits, x = layer.predict(hidden, next_ids, cos, sin, lc, absorb)
        return logits.float(), x

    def to(self, *args, **kwargs):  # keep the router bias in float32 and move the rotary frequencies
        bias = {n: b.detach().clone() for n, b in self.named_buffers() if n.endswith("e_score_correction_bias")}
        out = super().to(*args, **kwargs)
        for n, b in self.named_buffers():
            if n in bias and b.dtype != torch.float32:   # narrowed: put back the float32 values, not widened ones
                b.data = bias[n].to(device=b.device)
        self.rotary.to(self.lm_head.weight.device)
        return out


def build_model(cfg: DeepseekV3Config, tensors: Mapping[str, torch.Tensor], dtype=torch.float32,
                device=None, with_mtp: bool | None = None, strict: bool = True) -> DeepseekV3ForCausalLM:
    """Build the model on the meta device and assign ``tensors`` (HF names) cast to ``dtype``; the router
    bias stays float32. ``with_mtp`` defaults to whether MTP tensors are present."""
    if with_mtp is None:
        with_mtp = any(k.startswith(f"model.layers.{cfg.num_hidden_layers}.") for k in tensors)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg, dtype=dtype, with_mtp=with_mtp)
    state = {}
    for k, v in tensors.items():
        keep_fp32 = k.endswith("e_score_correction_bias")
        state[k] = v.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    unexpected = [k for k in unexpected if not _assign_bias(model, k, tensors[k], device)]
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    model.rotary = Rotary(cfg, device=device)
    return model.eval()


def _assign_bias(model: nn.Module, name: str, value: torch.Tensor, device) -> bool:
    """A ``.bias`` the model has no parameter for: iter_smooth's shift on a norm, or W·shift on a linear kept
    float. It is attached, in float32 (as msModelSlim stores and adds it); False for any other name."""
    if not name.endswith(".bias"):
        return False
    try:
        module = model.get_submodule(name[: -len(".bias")])
    except AttributeError:
        return False
    if not isinstance(module, (RMSNorm, nn.Linear)) or getattr(module, "bias", None) is not None:
        return False
    dtype = torch.float32 if isinstance(module, RMSNorm) else module.weight.dtype  # F.linear takes one dtype
    module.bias = nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False)
    return True
