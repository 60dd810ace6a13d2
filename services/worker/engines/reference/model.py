"""Llama-family transformer (Llama, SmolLM, Mistral, Qwen2 with q/k/v bias) over a paged KV cache.

Plain PyTorch, no nn.Module machinery: weights are tensors (q/k/v and gate/up fused so each layer
is four matmuls). Linear layers run on the flattened, unpadded tokens of the whole batch (varlen)
through kernels.linear (a C kernel for steps of a few tokens, where MKL's sgemm is slow on AVX2
CPUs, such as verifying drafts; F.linear otherwise);
decode and draft queries attend with a C kernel straight over the pages (kernels/attention.py,
float32 CPU); otherwise (prefill, GPU, other dtypes) attention pads queries to [B, q_max] and
gathers each request's keys from the paged cache with one index tensor per step, reused by every
layer. The attention mask is built by the model runner: a
causal mask for the prefix tail, a tree mask (ancestors only) for draft tokens being verified.

Shapes: T = tokens in the step, B = requests, Qm = max queries per request, Km = max keys per
request, H = heads, KV = kv heads, R = H // KV, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.engines.reference.kernels.attention import PagedQueries, paged_attention
from services.worker.engines.reference.kernels.linear import linear, small_gemm_available
from services.worker.model.config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 KV) D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 KV) D]
    o: torch.Tensor  # [hidden, H D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.Tensor  # [hidden, I]


@dataclass
class AttnGroup:
    """Requests whose attention is computed together. A step splits short queries (decode, drafts)
    from long ones (prefill). Short ones on float32 CPU go to the paged kernel (`paged`: no padding,
    keys read in place); otherwise the group is padded to a common [Qm, Km] for SDPA."""

    token_index: torch.Tensor | None  # [Tg] long: the step's tokens of this group; None = all, in order
    paged: PagedQueries | None  # set: the kernel path, and the fields below are unused
    gather_slots: torch.Tensor | None  # [B * Km] long: cache slots of each request's keys (padding -> 0)
    pad_index: torch.Tensor | None  # [Tg] long: token -> row in the padded [B * Qm]; None if Tg == B*Qm
    # [B, 1, R * Qm, Km] bool (True = attend), or additive in the model dtype (0 / -inf) with Km a
    # multiple of model_runner.MASK_ALIGN (GPUs); None = attend to all
    attn_mask: torch.Tensor | None
    batch: int
    q_max: int
    k_max: int


@dataclass
class ForwardBatch:
    """Index tensors of one step (built once, used by every layer)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    write_slots: torch.Tensor  # [T] long: cache slot (page * page_size + offset) of each token's KV
    logits_index: torch.Tensor  # [N] long: tokens whose logits are needed
    groups: list[AttnGroup]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and x.dtype == torch.float32:
        # One fused kernel instead of six launches (pow, mean, add, rsqrt, mul, mul), twice per
        # layer: a GPU step of this model is bound by its host thread launching kernels (session 20).
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    if x.dtype != torch.float32:  # as Hugging Face: normalize in float32, scale in the model dtype
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.layers: list[LayerWeights] = []
        self.embed = torch.empty(0)
        self.norm = torch.empty(0)
        self.lm_head = torch.empty(0)
        # Rotary tables as Hugging Face computes them (float32, rotate-half layout): [P, D].
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def expected_shapes(self, state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
        """Every tensor load reads, with the shape the config implies (Hugging Face names)."""
        cfg = self.cfg
        hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (q_out, hidden),
                p + "self_attn.k_proj.weight": (kv_out, hidden),
                p + "self_attn.v_proj.weight": (kv_out, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_out),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
            if cfg.attention_bias:
                shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)}
        shapes["model.norm.weight"] = (hidden,)
        if not self._tied(state):
            shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
        return shapes

    def _tied(self, state: dict[str, torch.Tensor]) -> bool:
        # An untied config without lm_head.weight falls back to the embeddings (as before).
        return self.cfg.tie_word_embeddings or "lm_head.weight" not in state

    def check(self, state: dict[str, torch.Tensor]) -> None:
        """ValueError naming the first tensor that is missing, not floating point, or not of the
        shape the config implies. A config that matches over tensors that do not would otherwise
        load: a norm of the wrong size broadcasts in rms_norm and gives wrong logits silently."""
        for name, shape in self.expected_shapes(state).items():
            t = state.get(name)
            if t is None:
                raise ValueError(f"weights: tensor {name} missing from the checkpoint")
            if not t.is_floating_point():
                raise ValueError(f"weights: tensor {name} has dtype {t.dtype}, expected a floating point dtype")
            if tuple(t.shape) != shape:
                raise ValueError(f"weights: tensor {name} has shape {list(t.shape)}, expected {list(shape)} "
                                 "(from config.json)")

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Takes weights named as in Hugging Face checkpoints. Every tensor is checked against the
        config (ValueError naming it) and converted before any is swapped in: a refused checkpoint
        (LoadWeights of a bad source) leaves the running weights whole and serving."""
        cfg = self.cfg
        self.check(state)

        def get(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=self.dtype)

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight"),
                             get(p + "self_attn.v_proj.weight")], 0).contiguous()
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([get(p + "self_attn.q_proj.bias"), get(p + "self_attn.k_proj.bias"),
                                  get(p + "self_attn.v_proj.bias")], 0).contiguous()
            layers.append(LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=bias,
                o=get(p + "self_attn.o_proj.weight").contiguous(),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], 0).contiguous(),
                down=get(p + "mlp.down_proj.weight").contiguous(),
            ))
        embed = get("model.embed_tokens.weight")
        norm = get("model.norm.weight")
        lm_head = embed if self._tied(state) else get("lm_head.weight")
        self.layers, self.embed, self.norm, self.lm_head = layers, embed, norm, lm_head
        if self.device.type == "cpu" and self.dtype == torch.float32:
            small_gemm_available()  # build (about a second, cached) now rather than in the first step

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] (float32) of the tokens fb.logits_index; writes the step's KV into
        kv_cache [layers, 2, slots, KV, D]."""
        cfg = self.cfg
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = fb.input_ids.shape[0]
        eps = cfg.rms_norm_eps
        cos = self.cos[fb.positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[fb.positions].unsqueeze(1)
        x = self.embed[fb.input_ids]  # [T, hidden]
        for li, lw in enumerate(self.layers):
            h = rms_norm(x, lw.input_norm, eps)
            qkv = linear(h, lw.qkv, lw.qkv_bias)  # [T, (H + 2 KV) D]
            qk = qkv[:, : (H + KV) * D].view(T, H + KV, D)
            qk = qk * cos + rotate_half(qk) * sin  # rotary on q and k heads at once
            q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, KV, D]
            v = qkv[:, (H + KV) * D :].view(T, KV, D)
            k_cache, v_cache = kv_cache[li, 0], kv_cache[li, 1]  # [slots, KV, D]
            k_cache.index_copy_(0, fb.write_slots, k)
            v_cache.index_copy_(0, fb.write_slots, v)
            # All of the step's KV is written before any attention reads it (siblings admitted in
            # the same step read the prompt pages their first sibling writes here).
            if len(fb.groups) == 1 and fb.groups[0].token_index is None:
                o = self._attend(q, k_cache, v_cache, fb.groups[0])
            else:
                o = q.new_empty(T, H * D)
                for grp in fb.groups:
                    assert grp.token_index is not None
                    o[grp.token_index] = self._attend(q[grp.token_index], k_cache, v_cache, grp)
            x = x + linear(o, lw.o)
            h = rms_norm(x, lw.post_norm, eps)
            gu = linear(h, lw.gate_up)  # [T, 2 I]
            g, u = gu.chunk(2, dim=-1)
            x = x + linear(F.silu(g) * u, lw.down)
        x = rms_norm(x[fb.logits_index], self.norm, eps)
        return linear(x, self.lm_head).float()  # [N, vocab]

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttnGroup) -> torch.Tensor:
        """q [Tg, H, D] -> attention output [Tg, H * D] over each request's keys."""
        if g.paged is not None:
            return paged_attention(q, k_cache, v_cache, g.paged)
        assert g.gather_slots is not None
        H, KV, D = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        R = H // KV
        B, Qm, Km = g.batch, g.q_max, g.k_max
        # Keys of every request, gathered from its pages: [B, KV, Km, D].
        kk = k_cache.index_select(0, g.gather_slots).view(B, Km, KV, D).transpose(1, 2)
        vv = v_cache.index_select(0, g.gather_slots).view(B, Km, KV, D).transpose(1, 2)
        if g.pad_index is None:
            qp = q.reshape(B, Qm, KV, R, D)
        else:
            qp = q.new_zeros(B * Qm, H, D)
            qp[g.pad_index] = q
            qp = qp.view(B, Qm, KV, R, D)
        # GQA without copying K/V: the R query heads of a kv head become extra query rows.
        qp = qp.permute(0, 2, 3, 1, 4).reshape(B, KV, R * Qm, D)
        o = F.scaled_dot_product_attention(qp, kk, vv, attn_mask=g.attn_mask)  # [B, KV, R Qm, D]
        o = o.view(B, KV, R, Qm, D).permute(0, 3, 1, 2, 4).reshape(B * Qm, H * D)
        return o if g.pad_index is None else o[g.pad_index]
