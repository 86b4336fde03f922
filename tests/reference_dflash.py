"""An independent numpy reference of the DFlash v1 drafter forward (z-lab ``dflash/model.py``).

Written from the published architecture, not from llama.cpp, and computed in float64:

* context features: ``concat(hidden_states[t + 1] for t in target_layer_ids)`` of the HF target
  (the OUTPUT of HF layer t), then ``ctx = rms_norm(fc(features)) * hidden_norm``;
* noise block ``[anchor, mask x (B-1)]`` embedded with the TARGET's embedding table;
* per layer: ``x = input_layernorm(h)``; Q from x only; K/V from ``concat[ctx, x]`` (no input
  norm on the context); q_norm / k_norm per head; NeoX RoPE at true positions (context at
  0..P-1, block at P..P+B-1); non-causal attention over every key with GQA; o_proj;
  residual; ``post_attention_layernorm``; SwiGLU MLP; residual;
* final ``norm``, then the TARGET's LM head (tied to the embeddings for the tiny Qwen3 target).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_neox(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """NeoX ("rotate half") RoPE; ``x`` is [T, heads, head_dim], ``pos`` [T]."""
    hd = x.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None].astype(np.float64) * inv[None, :]           # [T, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class TargetHF:
    """The HF target through transformers: hidden states and the embedding / LM head weights."""

    def __init__(self, path: Path):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
        self.embed = self.model.get_input_embeddings().weight.detach().double().numpy()
        self.lm_head = self.model.get_output_embeddings().weight.detach().double().numpy()

    def hidden_states(self, tokens: list[int]) -> list[np.ndarray]:
        """``hidden_states[i]``: input of HF layer i (0 = embeddings), each [T, H]."""
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([tokens]), output_hidden_states=True)
        return [h[0].double().numpy() for h in out.hidden_states]


class DFlashReference:
    """DFlash v1 drafter weights from the HF folder, and its block forward."""

    def __init__(self, path: Path, kv_dtype=None):
        """``kv_dtype=np.float16`` rounds K and V as llama.cpp's default F16 KV cache stores them."""
        from safetensors.numpy import load_file

        self.kv_dtype = kv_dtype

        self.cfg = json.loads((path / "config.json").read_text())
        dc = self.cfg.get("dflash_config", {})
        self.layer_ids = dc.get("target_layer_ids", self.cfg.get("target_layer_ids"))
        self.mask = dc["mask_token_id"]
        self.w = {k.removeprefix("model."): v.astype(np.float64) for k, v in load_file(str(path / "model.safetensors")).items()}
        self.eps = self.cfg.get("rms_norm_eps", 1e-6)
        self.theta = self.cfg.get("rope_theta", 10000.0)
        self.n_head = self.cfg["num_attention_heads"]
        self.n_kv = self.cfg["num_key_value_heads"]
        self.hd = self.cfg.get("head_dim") or self.cfg["hidden_size"] // self.n_head

    def context(self, hidden_states: list[np.ndarray]) -> np.ndarray:
        feats = np.concatenate([hidden_states[t + 1] for t in self.layer_ids], axis=-1)
        return rms_norm(feats @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.eps)

    def block_logits(self, ctx: np.ndarray, block: list[int], embed: np.ndarray, lm_head: np.ndarray) -> np.ndarray:
        """Logits [B, V] of the noise block placed right after the P context positions."""
        P, B = len(ctx), len(block)
        pos = np.arange(P + B)
        h = embed[np.asarray(block)]
        for i in range(self.cfg["num_hidden_layers"]):
            h = self._layer(i, h, ctx, pos)
        return rms_norm(h, self.w["norm.weight"], self.eps) @ lm_head.T

    def _layer(self, i: int, h: np.ndarray, ctx: np.ndarray, pos: np.ndarray) -> np.ndarray:
        w, p, hd = self.w, f"layers.{i}.", self.hd
        P, B = len(ctx), len(h)
        x = rms_norm(h, w[p + "input_layernorm.weight"], self.eps)
        kv_in = np.concatenate([ctx, x], axis=0)                               # [P+B, H]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(B, self.n_head, hd)
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).reshape(P + B, self.n_kv, hd)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).reshape(P + B, self.n_kv, hd)
        q = rope_neox(rms_norm(q, w[p + "self_attn.q_norm.weight"], self.eps), pos[P:], self.theta)
        k = rope_neox(rms_norm(k, w[p + "self_attn.k_norm.weight"], self.eps), pos, self.theta)
        if self.kv_dtype is not None:
            k, v, q = (a.astype(self.kv_dtype).astype(np.float64) for a in (k, v, q))
        group = self.n_head // self.n_kv
        out = np.empty((B, self.n_head, hd))
        for head in range(self.n_head):
            kh, vh = k[:, head // group], v[:, head // group]
            att = softmax(q[:, head] @ kh.T / np.sqrt(hd))                     # non-causal: all P+B keys
            if self.kv_dtype is not None:
                att = att.astype(self.kv_dtype).astype(np.float64)
            out[:, head] = att @ vh
        h = h + out.reshape(B, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], self.eps)
        mlp = (silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return h + mlp
