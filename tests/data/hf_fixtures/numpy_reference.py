"""Pure-numpy forward pass for the fixtures in this directory (no torch needed).

It documents, executably, the exact math a loader has to reproduce, reading only
config.json + *.safetensors; `python tests/data/hf_fixtures/numpy_reference.py`
checks it against every case's logits.npy.  Needs numpy and safetensors only.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from safetensors import safe_open

HERE = os.path.dirname(os.path.abspath(__file__))


def load_case(case_dir):
    with open(os.path.join(case_dir, "config.json")) as f:
        cfg = json.load(f)
    w = {}
    for fn in sorted(os.listdir(case_dir)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(case_dir, fn), framework="np") as f:
                for k in f.keys():
                    w[k] = f.get_tensor(k)
    return cfg, w


def rms_norm(x, weight, eps):
    x = x.astype(np.float32)
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope_theta(cfg):
    # transformers 5.x: nested rope_parameters; 4.x checkpoints: top-level rope_theta.
    if "rope_parameters" in cfg and cfg["rope_parameters"]:
        return float(cfg["rope_parameters"]["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def apply_rope(x, positions, theta):
    # x: (B, T, H, D). Non-interleaved ("rotate_half"): pairs are (i, i + D/2).
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float32) / d)
    freqs = positions[:, None].astype(np.float32) * inv_freq[None, :]  # (T, D/2)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = np.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(cfg, w, ids):
    eps = cfg["rms_norm_eps"]
    n_h, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // n_h
    theta = rope_theta(cfg)
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    B, T = ids.shape
    pos = np.arange(T)
    causal = np.tril(np.ones((T, T), dtype=bool))

    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, T, n_h, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(B, T, n_kv, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(B, T, n_kv, d)
        if p + "self_attn.q_norm.weight" in w:  # Qwen3: per-head RMSNorm over head_dim, before RoPE
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = apply_rope(q, pos, theta), apply_rope(k, pos, theta)
        # GQA: query head j uses kv head j // (n_h // n_kv)  (torch repeat_kv semantics).
        k = np.repeat(k, n_h // n_kv, axis=2)
        v = np.repeat(v, n_h // n_kv, axis=2)
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        s = np.where(causal[None, None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = s / s.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, T, n_h * d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T

        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        is_moe = (
            n_experts > 0
            and i not in cfg.get("mlp_only_layers", [])
            and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
        )
        if is_moe:
            assert p + "mlp.gate.weight" in w
            flat = h.reshape(B * T, -1)
            logits = flat @ w[p + "mlp.gate.weight"].T  # (N, E)
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            k_top = cfg["num_experts_per_tok"]
            top = np.argsort(-probs, axis=-1)[:, :k_top]
            top_w = np.take_along_axis(probs, top, axis=-1)
            if cfg.get("norm_topk_prob", False):
                top_w = top_w / top_w.sum(-1, keepdims=True)
            out = np.zeros_like(flat)
            for e in range(n_experts):
                ep = p + f"mlp.experts.{e}."
                y = (silu(flat @ w[ep + "gate_proj.weight"].T) * (flat @ w[ep + "up_proj.weight"].T)) @ w[
                    ep + "down_proj.weight"
                ].T
                weight_e = (top_w * (top == e)).sum(-1, keepdims=True)
                out += weight_e * y
            mlp = out.reshape(B, T, -1)
        else:
            mlp = (silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[
                p + "mlp.down_proj.weight"
            ].T
        x = x + mlp
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]  # tied
    return x @ head.T


def main():
    worst = 0.0
    for name in sorted(os.listdir(HERE)):
        case_dir = os.path.join(HERE, name)
        if not os.path.isfile(os.path.join(case_dir, "config.json")):
            continue
        cfg, w = load_case(case_dir)
        ids = np.load(os.path.join(case_dir, "inputs.npy"))
        ref = np.load(os.path.join(case_dir, "logits.npy"))
        got = forward(cfg, w, ids)
        err = float(np.abs(got - ref).max())
        worst = max(worst, err)
        print(f"{name:18s} max|numpy - torch| = {err:.3g}")
    sys.exit(0 if worst < 1e-4 else 1)


if __name__ == "__main__":
    main()
