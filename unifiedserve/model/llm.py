"""The Qwen2 language model of Qwen2.5-VL, written for a flattened, paged-KV runtime.

A step's tokens from all sequences are one flat batch of ``N`` rows; attention is delegated to an
:class:`~unifiedserve.attention.AttentionBackend`, which writes each layer's K/V to the paged cache
and attends over every sequence's cached prefix. Positions are M-RoPE positions ``[3, N]``
(temporal, height, width), see :mod:`unifiedserve.model.rope`.

Two visible performance choices: Q/K/V are one fused projection (``qkv_proj``) and gate/up are one
fused projection (``gate_up_proj``); the loader concatenates the checkpoint's separate tensors. The decoder's
projections and the LM head go through :mod:`unifiedserve.ops.skinny`, which runs a decode-sized GEMM (with the
bias, or SwiGLU, in its epilogue, and for Q/K/V and gate/up the residual add and RMSNorm before them in its
prologue) where the runner's start-up timing found it faster than cuBLAS (and the norm kernel), and ``F.linear``
after the fused add + RMSNorm kernel everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from unifiedserve import ops
from unifiedserve.attention import AttentionBackend
from unifiedserve.model.config import TextConfig
from unifiedserve.ops import reference, skinny

__all__ = ["LanguageModel", "RMSNorm", "activation", "mrope_cos_sin", "rotate_half"]


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalised in float32 and cast back before the scale (as Qwen2).

    One fused kernel when the native ops are built (:func:`unifiedserve.ops.rms_norm`); :meth:`add` also
    folds in the residual add that precedes it.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = x + residual``; returns ``(norm(h), h)``. May reuse the inputs' memory: use the results."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The ``hidden_act`` of a Hugging Face config, applied to ``x``."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unsupported activation {name!r}")


rotate_half = reference.rotate_half  # ``[x1, x2] -> [-x2, x1]`` over the last dim (Qwen's rotary pairing)


def mrope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, mrope_section: tuple[int, ...],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary tables: frequency pair ``i`` turns with the position of axis ``section(i)``.

    Args:
        positions: int64 ``[3, N]`` (temporal, height, width) positions.
    Returns:
        ``(cos, sin)``, each ``[N, head_dim]`` in ``dtype`` (computed in float32).
    """
    device = positions.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))  # [D/2]
    axis = torch.repeat_interleave(torch.arange(3, device=device),
                                   torch.tensor(mrope_section, device=device))  # [D/2]: 0..0 1..1 2..2
    pos = positions[axis].T.float()  # [N, D/2]: the position each frequency pair turns with
    freqs = pos * inv_freq  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """Grouped-query attention with biased Q/K/V (Qwen2), M-RoPE, paged KV via the backend."""

    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_q_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        return self.attend(skinny.linear(x, self.qkv_proj.weight, self.qkv_proj.bias), cos, sin, attn)

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Everything after the Q/K/V projection ``qkv [N, Hq * D + 2 * Hkv * D]``: rotary, the K/V write,
        attention, the output projection."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_q_heads, self.head_dim)  # q: [N, Hq, D]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # k: [N, Hkv, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)  # v: [N, Hkv, D]
        # rotary in the model dtype, and the K/V write, in one pass when fused
        out = attn.forward_rope(self.layer_idx, q, k, v, cos, sin)  # [N, Hq, D]
        return skinny.linear(out.reshape(n, self.q_size), self.o_proj.weight)  # [N, hidden]

    def attend_rotated(self, q: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """:meth:`attend` where the projection has rotated ``q [N, Hq * D]`` and written K/V itself."""
        n = q.shape[0]
        out = attn.forward_rotated(self.layer_idx, q.view(n, self.num_q_heads, self.head_dim))  # [N, Hq, D]
        return skinny.linear(out.reshape(n, self.q_size), self.o_proj.weight)  # [N, hidden]


class MLP(nn.Module):
    """SwiGLU: ``down(act(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    @torch.no_grad()
    def pad_intermediate(self, multiple: int) -> int:
        """Zero-pad the intermediate width up to a multiple of ``multiple``; the output is unchanged.

        The padded gate and up rows (weights and bias) are zero, so each padded unit is
        ``act(0) * 0 = 0`` (every supported activation is finite at 0), and the padded columns of
        ``down`` are zero too. What it buys is alignment: Qwen2.5-VL's vision MLP is 3420 wide, which is not a
        multiple of 8, so its ``[N, 3420]`` activations and ``down`` weight have rows of 6840
        bytes, off the 16-byte alignment that Hopper's tensor-memory-accelerated GEMM kernels need
        (NVIDIA's cuBLAS documentation, "Tensor Core usage": leading dimensions that are multiples
        of 16 bytes). Returns the new width.
        """
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple}")
        old = self.intermediate_size
        new = -(-old // multiple) * multiple
        if new == old:
            return old
        gate_up, down = self.gate_up_proj, self.down_proj
        w = gate_up.weight.new_zeros(2 * new, gate_up.in_features)  # [2I', H]: gate rows, then up rows
        w[:old], w[new:new + old] = gate_up.weight[:old], gate_up.weight[old:]
        gate_up.weight = nn.Parameter(w, requires_grad=gate_up.weight.requires_grad)
        if gate_up.bias is not None:
            b = gate_up.bias.new_zeros(2 * new)
            b[:old], b[new:new + old] = gate_up.bias[:old], gate_up.bias[old:]
            gate_up.bias = nn.Parameter(b, requires_grad=gate_up.bias.requires_grad)
        gate_up.out_features = 2 * new
        d = down.weight.new_zeros(down.out_features, new)  # [H, I']
        d[:, :old] = down.weight
        down.weight = nn.Parameter(d, requires_grad=down.weight.requires_grad)
        down.in_features = new
        self.intermediate_size = new
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden_act == "silu":  # one fused pass after the GEMM, or in its epilogue (skinny)
            act = skinny.gate_up_silu(x, self.gate_up_proj.weight, self.gate_up_proj.bias, ops.silu_and_mul)  # [N, I]
            return self.down(act)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [N, I] each
        return self.down(activation(self.hidden_act, gate) * up)

    def down(self, act: torch.Tensor) -> torch.Tensor:
        """The down projection of the activations ``[N, I]``."""
        return skinny.linear(act, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the split residual stream: the stream is ``residual + x`` (``x`` alone for the first
        layer, ``residual=None``). Returns the MLP's output and the stream before it, so that each residual
        add is fused into the RMSNorm that follows it (the next layer's, or the final norm), and each of those
        norms into the projection after it where :func:`~unifiedserve.ops.skinny.norm_linear` found that faster (for
        Q/K/V, with the rotary and the K/V write too where :func:`~unifiedserve.ops.skinny.norm_qkv_rope` did)."""
        ln1, ln2, attention, mlp = self.input_layernorm, self.post_attention_layernorm, self.self_attn, self.mlp
        qkv_w, qkv_b = attention.qkv_proj.weight, attention.qkv_proj.bias
        write = attn.rope_write(attention.layer_idx, cos, sin) if skinny.rope_chosen(x, qkv_w, qkv_b) else None
        if write is not None:  # Q/K/V with rotary and the K/V write in its kernel (the add and norm too, or before)
            q, residual = skinny.norm_qkv_rope(x, residual, ln1.weight, ln1.eps, qkv_w, qkv_b, write)
            x = attention.attend_rotated(q, attn)
        else:
            qkv, residual = skinny.norm_linear(x, residual, ln1.weight, ln1.eps, qkv_w, qkv_b)
            x = attention.attend(qkv, cos, sin, attn)
        if mlp.hidden_act != "silu":
            x, residual = ln2.add(x, residual)
            return mlp(x), residual
        act, residual = skinny.norm_linear(x, residual, ln2.weight, ln2.eps, mlp.gate_up_proj.weight,
                                           mlp.gate_up_proj.bias, ops.silu_and_mul)  # [N, I]
        return mlp.down(act), residual


class LanguageModel(nn.Module):
    """Qwen2 decoder over a flattened batch of tokens.

    Invariant: ``forward`` runs layers ``0..num_hidden_layers-1`` in order and calls
    ``attn.forward(layer_idx, ...)`` once per layer, so the backend's metadata (set with
    ``attn.begin``) must describe exactly the ``N`` rows passed in.
    """

    def __init__(self, config: TextConfig, tie_word_embeddings: bool = False):
        super().__init__()
        self.config = config
        # Random init only off the meta device: normal_ on meta costs ~1.5 s the first time.
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                           _weight=torch.empty(config.vocab_size, config.hidden_size))
        if not self.tok_embeddings.weight.is_meta:
            nn.init.normal_(self.tok_embeddings.weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64 token ids -> ``[N, hidden]`` embeddings."""
        return self.tok_embeddings(token_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Run the decoder.

        Args:
            inputs_embeds: ``[N, hidden]`` (text embeddings with visual tokens scattered in).
            positions: int64 ``[3, N]`` M-RoPE positions.
            attn: the attention backend, already ``begin``-ed with this step's metadata.
        Returns:
            ``[N, hidden]`` final hidden states (final RMSNorm applied).
        """
        if positions.dim() != 2 or positions.shape[0] != 3 or positions.shape[1] != inputs_embeds.shape[0]:
            raise ValueError(f"positions must be [3, {inputs_embeds.shape[0]}], got {list(positions.shape)}")
        cfg = self.config
        cos, sin = mrope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.mrope_section,
                                 inputs_embeds.dtype)  # [N, D] each
        return self.run_layers(inputs_embeds.clone(), cos, sin, attn)  # the caller's tensor stays as it was

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Every layer on ``x [N, hidden]`` with ``cos``/``sin [N, head_dim]``, then the final norm.

        ``x``'s memory is reused for the residual stream (the fused residual adds write in place): pass a
        tensor nobody reads afterwards.
        """
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn)  # [N, hidden] each
        return self.norm(x) if residual is None else self.norm.add(x, residual)[0]

    def skinny_groups(self) -> list[skinny.Weights]:
        """The decoder's projections and the LM head, each kind's weights in the order a step reads them (what
        :func:`unifiedserve.ops.skinny.tune` times)."""
        attn = [layer.self_attn for layer in self.layers]
        mlps = [layer.mlp for layer in self.layers]
        eps = self.config.rms_norm_eps
        groups = [skinny.Weights("qkv_proj", [a.qkv_proj.weight for a in attn], [a.qkv_proj.bias for a in attn],
                                 norms=[layer.input_layernorm.weight for layer in self.layers], eps=eps,
                                 rope_heads=(self.config.num_attention_heads, self.config.num_key_value_heads)),
                  skinny.Weights("o_proj", [a.o_proj.weight for a in attn], [None] * len(attn))]
        if self.config.hidden_act == "silu":
            groups.append(skinny.Weights("gate_up_proj+silu", [m.gate_up_proj.weight for m in mlps],
                                         [m.gate_up_proj.bias for m in mlps], silu_mul=True,
                                         norms=[layer.post_attention_layernorm.weight for layer in self.layers],
                                         eps=eps))
        groups.append(skinny.Weights("down_proj", [m.down_proj.weight for m in mlps], [m.down_proj.bias for m in mlps]))
        head = self.tok_embeddings.weight if self.lm_head is None else self.lm_head.weight
        groups.append(skinny.Weights("lm_head", [head], [None]))
        return groups

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[M, hidden]`` -> ``[M, vocab_size]`` (the tied embedding when there is no lm_head)."""
        weight = self.tok_embeddings.weight if self.lm_head is None else self.lm_head.weight
        return skinny.linear(hidden, weight)
