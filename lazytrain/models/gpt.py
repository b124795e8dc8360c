"""A plain pre-norm GPT: token + learned position embedding (or, with ``rope``, rotary position
embeddings on queries and keys instead), decoder blocks with causal SDPA, final LayerNorm and an
(optionally tied) LM head.  Deterministic (no dropout), so a schedule's loss can be compared bit
for bit with eager training."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50257
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    d_ff: int = 3072
    max_seq: int = 1024
    tie_weights: bool = True
    rope: bool = False          # rotary positions in attention instead of a learned position table
    rope_theta: float = 10000.0


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = None if cfg.rope else nn.Embedding(cfg.max_seq, cfg.d_model)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.pos is None:
            return self.tok(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.tok(input_ids) + self.pos(pos)


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` [B, H, T, D] (D even), the half-split (GPT-NeoX / Llama)
    layout: pair ``i`` is ``(x[..., i], x[..., i + D/2])``, turned by ``t * theta ** (-2i / D)``.
    The angles are computed from the shape on every call (no buffer), so the block stays a plain
    function of its parameters and input for tracing and for the schedule."""
    t, d = x.shape[-2], x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)      # [T, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Block(nn.Module):
    """x + attn(ln1(x)); then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.rope_theta = cfg.rope_theta if cfg.rope else None
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.rope_theta is not None:
            q, k = rotate(q, self.rope_theta), rotate(k, self.rope_theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by n_head {cfg.n_head}")
        if cfg.rope and (cfg.d_model // cfg.n_head) % 2:
            raise ValueError(f"rope needs an even head size, got {cfg.d_model // cfg.n_head}")
        self.config = cfg
        self.embed = Embedding(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.embed.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.device.type != "meta":
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy over non-ignored labels (-100) if labels are given, else logits."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                               labels[:, 1:].reshape(-1), ignore_index=-100)
