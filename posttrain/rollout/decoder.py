"""A decode path for Llama-family HF models (Qwen2, Qwen3, Llama, Mistral and the Qwen2-MoE / Qwen3-MoE
mixtures of experts) over a slotted, preallocated KV cache.

It calls the HF model's own submodules (embeddings, norms, projections, MLPs, rotary embedding), so the
weights are the model's and `load_weights` into the HF model updates it too. What it replaces is the
cache and the attention bookkeeping: keys/values are written in place into per-sequence slots, and one
decode step attends each active sequence to its own slot, so sequences of different lengths (continuous
batching) share one batched step with no padding recompute and no cache copies.

A Qwen2-VL or Qwen2.5-VL model (`qwen2_vl`, `qwen2_5_vl`: the same text decoder, different vision towers)
decodes through its text model (`model.model.language_model`): the caller passes the prompt's input embeddings
(image features already in place of the image-pad tokens) and its multimodal rotary positions (M-RoPE,
(3, B, P) from the model's `get_rope_index`; Qwen2.5-VL's needs `second_per_grid_ts` for videos only); the
model's own rotary embedding turns them into cos/sin, and the KV cache stays indexed by token position.

A layer's MLP is called as a module, so a sparse mixture-of-experts block (router, fused 3-D experts,
shared expert) runs as transformers wrote it: each token is routed on its own, and padding rows of a
prefill are routed too but never reach a kept position. Qwen3's per-head q/k RMS norms are applied before
the rotary embedding, as its attention does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = ("qwen2", "qwen3", "llama", "mistral", "qwen2_moe", "qwen3_moe", "qwen2_vl", "qwen2_5_vl")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (B, T, D)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


# RMS norms computing x * rsqrt(mean(x^2) + eps) * weight (in float32, then cast back: equal in float32)
_PLAIN_RMS_NORMS = frozenset(
    f"{name}RMSNorm"
    for name in ("Qwen2", "Qwen3", "Llama", "Mistral", "Qwen2Moe", "Qwen3Moe", "Qwen2VL", "Qwen2_5_VL")
)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)`, through torch's fused `F.rms_norm` for a float32 input to one of the plain RMS norms above
    (one kernel instead of the module's six element-wise ops: ~10% of a small model's decoding step, the
    same values); any other norm or dtype runs the module itself."""
    if x.dtype == torch.float32 and type(norm).__name__ in _PLAIN_RMS_NORMS:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm(x)


def text_model(model: nn.Module) -> nn.Module | None:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a causal LM or of a vision-language model."""
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)  # Qwen2-VL: model.model.language_model
    return inner if inner is not None and hasattr(inner, "rotary_emb") else None


def supports(model: nn.Module) -> bool:
    """Whether the decoder runs `model` (a sliding window bounds the requests it takes: `sliding_window`)."""
    return getattr(model.config, "model_type", None) in SUPPORTED and text_model(model) is not None


class SlotKVCache:
    """K and V of shape (layers, slots, kv_heads, max_len, head_dim), allocated once and reused."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape_tail = (kv_heads, head_dim)
        self.layers, self.dtype, self.device = layers, dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def max_len(self) -> int:
        return 0 if self.k is None else self.k.shape[3]

    def ensure(self, slots: int, max_len: int) -> None:
        """(Re)allocate only when the current cache is too small: steps of the same size reuse it."""
        if self.k is not None and self.slots >= slots and self.max_len >= max_len:
            return
        kv_heads, head_dim = self.shape_tail
        shape = (self.layers, max(slots, self.slots), kv_heads, max(max_len, self.max_len), head_dim)
        self.k = self.v = None  # free the old one first
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def free(self) -> None:
        self.k = self.v = None

    def move(self, src: int, dst: int, length: int) -> None:
        """Slot `src`'s first `length` positions into slot `dst` (every layer), keeping slots compact."""
        assert self.k is not None and self.v is not None
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


@dataclass
class DecoderRunner:
    """Prefill and decode steps of `model` against a `SlotKVCache`."""

    model: nn.Module

    def __post_init__(self) -> None:
        config = getattr(self.model.config, "text_config", None) or self.model.config
        base = text_model(self.model)
        assert base is not None, "supports(model) is checked before a runner is built"
        self.base = base
        self.n_heads = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.scaling = self.head_dim**-0.5
        self.qk_norm = hasattr(self.base.layers[0].self_attn, "q_norm")

    def new_cache(self, dtype: torch.dtype, device: torch.device) -> SlotKVCache:
        return SlotKVCache(len(self.base.layers), self.n_kv, self.head_dim, dtype, device)

    def _qkv(self, attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        batch, width, _ = h.shape
        q = attn.q_proj(h).view(batch, width, self.n_heads, self.head_dim)
        k = attn.k_proj(h).view(batch, width, self.n_kv, self.head_dim)
        v = attn.v_proj(h).view(batch, width, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm:  # Qwen3: RMS norm over each head's dimensions, before the rotation
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Grouped-query attention without materialising repeated keys/values; `mask` None: causal (SDPA's
        own causal kernel, which never builds a (T, T) mask or score matrix)."""
        gqa = self.n_kv != self.n_heads
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scaling, enable_gqa=gqa
        )

    @torch.no_grad()
    def prefill(
        self,
        cache: SlotKVCache,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Right-padded prompts (B, P) into the cache; returns the logits after each prompt's last token.

        Prompt `rows[j]` is written to slot `slots[j]` (default: row j to slot j), so the n samples of one
        prompt share its single prefill without a later copy. `embeds` (B, P, hidden) replaces the token
        embeddings (a vision-language prompt's, image features included) and `rope_positions` the rotary
        positions ((3, B, P) M-RoPE); the cache is indexed by token position either way.
        """
        rows = torch.arange(tokens.shape[0], device=tokens.device) if rows is None else rows
        batch, width = tokens.shape
        device = tokens.device
        positions = torch.arange(width, device=device).expand(batch, width)
        # Causal attention is exact for right-padded prompts: a prompt token attends only to positions up to
        # its own, all of them the prompt's; padding attends to what precedes it, is never read (its logits
        # are not taken; its cache positions are overwritten by the decode steps before any query reaches
        # them). So no (B, 1, P, P) mask: SDPA's causal kernel, O(P) memory (a 16k-token prompt took 1.5 GB
        # and 3x the time with an explicit mask).
        h = self.base.embed_tokens(tokens) if embeds is None else embeds
        cos, sin = self.base.rotary_emb(h, positions if rope_positions is None else rope_positions)
        for i, layer in enumerate(self.base.layers):
            residual = h
            x = rms_norm(layer.input_layernorm, h)
            q, k, v = self._qkv(layer.self_attn, x, cos, sin)
            cache.k[i, slots, :, :width] = k[rows]  # type: ignore[index]
            cache.v[i, slots, :, :width] = v[rows]  # type: ignore[index]
            out = self._attend(q, k, v, None).transpose(1, 2).reshape(batch, width, -1)
            h = residual + layer.self_attn.o_proj(out)
            h = h + layer.mlp(rms_norm(layer.post_attention_layernorm, h))
        last = rms_norm(self.base.norm, h[torch.arange(batch, device=device), lengths - 1])
        return self.model.lm_head(last)

    @torch.no_grad()
    def decode(
        self,
        cache: SlotKVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per active sequence: `tokens` (B,) at `positions` (B,) in `slots` (B,); returns logits.

        `slots` None: sequence j is in slot j (the engine keeps its running sequences in the first B slots).
        Attention then reads the cache through a view; any other slots are gathered, a copy of every active
        sequence's keys and values per layer and step (measured ~1.2-1.4x slower decoding on the ~1M preset).
        `rope_positions` (B,): the rotary positions when they differ from the cache positions (a
        vision-language prompt's text continues at its cache position + the model's rope delta)."""
        batch = tokens.shape[0]
        prefix = slots is None
        if slots is None:
            slots = torch.arange(batch, device=tokens.device)
        span = int(positions.max()) + 1  # attend over the longest active sequence only
        keys_pos = torch.arange(span, device=tokens.device)
        mask = (keys_pos[None, :] <= positions[:, None])[:, None, None, :]
        h = self.base.embed_tokens(tokens[:, None])
        rope = positions if rope_positions is None else rope_positions
        cos, sin = self.base.rotary_emb(h, rope[:, None])
        for i, layer in enumerate(self.base.layers):
            residual = h
            x = rms_norm(layer.input_layernorm, h)
            q, k, v = self._qkv(layer.self_attn, x, cos, sin)
            cache.k[i, slots, :, positions] = k[:, :, 0]  # type: ignore[index]
            cache.v[i, slots, :, positions] = v[:, :, 0]  # type: ignore[index]
            if prefix:  # a view of the first `batch` slots
                keys, values = cache.k[i, :batch, :, :span], cache.v[i, :batch, :, :span]  # type: ignore[index]
            else:
                keys, values = cache.k[i, slots, :, :span], cache.v[i, slots, :, :span]  # type: ignore[index]
            out = self._attend(q, keys, values, mask).transpose(1, 2).reshape(batch, 1, -1)
            h = residual + layer.self_attn.o_proj(out)
            h = h + layer.mlp(rms_norm(layer.post_attention_layernorm, h))
        return self.model.lm_head(rms_norm(self.base.norm, h[:, 0]))
