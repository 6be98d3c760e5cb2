#!/usr/bin/env python
"""Regenerate the tiny Hugging Face checkpoints + reference logits in this directory.

These fixtures let the torch-free test suite check the JAX HF-checkpoint loader
against real `transformers` outputs.  CI has no torch, so the outputs are
committed; this script is only needed to regenerate them:

    python3 -m venv /work/venv-hf
    /work/venv-hf/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /work/venv-hf/bin/pip install transformers safetensors numpy
    /work/venv-hf/bin/python tests/data/hf_fixtures/make_fixtures.py

For every case it writes, into tests/data/hf_fixtures/<case>/:
    config.json, generation_config.json, model.safetensors
        (or model-0000k-of-0000n.safetensors + model.safetensors.index.json)
    inputs.npy   int64 (2, 7) token ids
    logits.npy   float32 (2, 7, vocab) logits of model(input_ids, attention_mask=ones)
and regenerates README.md (versions, tensor listing, config spelling).

Every parameter is randomised (RMSNorm weights ~ 1 + 0.1*randn, router weights
~ 0.3*randn, seed bumped until top-k routing has clear margins, everything else
~ 0.05*randn): the default all-ones norms would hide e.g. swapped q/k norms.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import safetensors
import torch
import transformers
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

HERE = os.path.dirname(os.path.abspath(__file__))

# Fixed token ids, within vocab 128 (include both ends 0 and 127 and a repeat).
INPUT_IDS = np.array(
    [
        [1, 17, 42, 99, 3, 127, 64],
        [5, 0, 88, 23, 23, 110, 7],
    ],
    dtype=np.int64,
)

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    attn_implementation="eager",
)

# Qwen3: head_dim * heads (32*4 = 128) != hidden (64), as in real Qwen3 checkpoints.
QWEN3 = dict(COMMON, head_dim=32, num_hidden_layers=2)
QWEN3_MOE = dict(
    COMMON,
    head_dim=32,
    num_hidden_layers=3,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
)


def case_specs():
    """name -> (config class, model class, config kwargs, save kwargs, seed)."""
    return {
        "qwen3_untied": (Qwen3Config, Qwen3ForCausalLM, dict(QWEN3, tie_word_embeddings=False), {}, 0),
        # Same weights as qwen3_untied (same seed & config), saved in ~100KB shards.
        "qwen3_sharded": (
            Qwen3Config,
            Qwen3ForCausalLM,
            dict(QWEN3, tie_word_embeddings=False),
            {"max_shard_size": "100KB"},
            0,
        ),
        "qwen3_tied": (Qwen3Config, Qwen3ForCausalLM, dict(QWEN3, tie_word_embeddings=True), {}, 1),
        # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse MoE.
        "qwen3_moe": (
            Qwen3MoeConfig,
            Qwen3MoeForCausalLM,
            dict(QWEN3_MOE, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False),
            {},
            2,
        ),
        "qwen3_moe_nonorm": (
            Qwen3MoeConfig,
            Qwen3MoeForCausalLM,
            dict(QWEN3_MOE, norm_topk_prob=False, mlp_only_layers=[], tie_word_embeddings=False),
            {},
            3,
        ),
        "llama": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(COMMON, head_dim=16, num_hidden_layers=2, mlp_bias=False, tie_word_embeddings=False),
            {},
            4,
        ),
    }


ROUTER_STD = 0.3


def randomise_(model: torch.nn.Module) -> None:
    """Overwrite every parameter (shared/tied parameters only once)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # input/post_attention_layernorm, q_norm, k_norm, model.norm
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # MoE router
                p.copy_(ROUTER_STD * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))


def moe_layer_kinds(model) -> list[str]:
    kinds = []
    for layer in model.model.layers:
        kinds.append("moe" if hasattr(layer.mlp, "experts") else "dense")
    return kinds


def routing_margins(model, input_ids, attn):
    """Min gap between the k-th and (k+1)-th router logit per MoE layer (softmax is monotone,
    so this is what decides whether top-k selection is numerically robust)."""
    captured = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):

            def hook(mod, args, out, i=i):
                captured[i] = out[0].detach()  # router_logits (tokens, experts)

            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attn)
    for h in hooks:
        h.remove()
    k = model.config.num_experts_per_tok
    out = {}
    for i, logits in captured.items():
        top = torch.sort(logits.float(), dim=-1, descending=True).values
        out[i] = float((top[:, k - 1] - top[:, k]).min())
    return out


def list_tensors(case_dir: str) -> list[tuple[str, tuple, str, str]]:
    rows = []
    for fn in sorted(os.listdir(case_dir)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(case_dir, fn), framework="np") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    rows.append((key, tuple(t.shape), str(t.dtype), fn))
    return sorted(rows, key=lambda r: _natural_key(r[0]))


def _natural_key(s: str):
    import re

    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)]


# A MoE fixture is only accepted if, for every token and MoE layer, the k-th and
# (k+1)-th router logits differ by at least this much, so that float32
# rounding differences between torch and JAX can never flip the top-k choice.
MIN_ROUTING_MARGIN = 1e-2


class SmallRoutingMargin(Exception):
    pass


def build_case(name, cfg_cls, model_cls, cfg_kwargs, save_kwargs, seed):
    torch.manual_seed(seed)
    config = cfg_cls(**cfg_kwargs)
    model = model_cls(config).to(torch.float32).eval()
    randomise_(model)

    case_dir = os.path.join(HERE, name)
    if os.path.isdir(case_dir):
        shutil.rmtree(case_dir)
    os.makedirs(case_dir)
    model.save_pretrained(case_dir, safe_serialization=True, **save_kwargs)

    input_ids = torch.from_numpy(INPUT_IDS)
    attn = torch.ones_like(input_ids)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attn).logits.float().numpy()
    assert logits.shape == (2, 7, config.vocab_size), logits.shape
    np.save(os.path.join(case_dir, "inputs.npy"), INPUT_IDS)
    np.save(os.path.join(case_dir, "logits.npy"), logits.astype(np.float32))

    # Round trip: the saved checkpoint must reload (no missing/unexpected keys)
    # and reproduce the logits.
    reloaded, info = AutoModelForCausalLM.from_pretrained(
        case_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} if isinstance(info, dict) else {}
    assert not any(bad.values()), f"{name}: loading info {info}"
    with torch.no_grad():
        logits2 = reloaded.eval()(input_ids=input_ids, attention_mask=attn).logits.float().numpy()
    err = float(np.abs(logits2 - logits).max())
    assert err < 1e-5, f"{name}: reload mismatch {err}"

    extra = {"reload_max_abs_err": err, "logits_std": float(logits.std())}
    if hasattr(config, "num_experts"):
        extra["layer_kinds"] = moe_layer_kinds(model)
        extra["routing_margin_min"] = routing_margins(model, input_ids, attn)
        if min(extra["routing_margin_min"].values()) < MIN_ROUTING_MARGIN:
            raise SmallRoutingMargin(f"{name} seed {seed}: {extra['routing_margin_min']}")
    return model, extra


def main():
    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }
    results = {}
    specs = case_specs()
    for name, (cfg_cls, model_cls, cfg_kwargs, save_kwargs, seed) in specs.items():
        # Deterministic retry: seed, seed + 100, ... until the routing margins are clear.
        for attempt in range(50):
            try:
                _, extra = build_case(name, cfg_cls, model_cls, cfg_kwargs, save_kwargs, seed)
                break
            except SmallRoutingMargin as e:
                print("retrying with another seed:", e)
                seed += 100
        else:
            raise RuntimeError(f"{name}: no seed with routing margin >= {MIN_ROUTING_MARGIN}")
        case_dir = os.path.join(HERE, name)
        files = sorted(os.listdir(case_dir))
        tensors = list_tensors(case_dir)
        names = {t[0] for t in tensors}
        if name == "qwen3_tied":
            assert "lm_head.weight" not in names, "tied checkpoint unexpectedly contains lm_head.weight"
        else:
            assert "lm_head.weight" in names, f"{name}: lm_head.weight missing"
        if name == "qwen3_sharded":
            assert "model.safetensors.index.json" in files
            assert sum(f.endswith(".safetensors") for f in files) > 1
        with open(os.path.join(case_dir, "config.json")) as f:
            cfg_json = json.load(f)
        results[name] = dict(extra, files=files, tensors=tensors, config=cfg_json, seed=seed)

    # qwen3_sharded holds the same weights as qwen3_untied.
    a = np.load(os.path.join(HERE, "qwen3_untied", "logits.npy"))
    b = np.load(os.path.join(HERE, "qwen3_sharded", "logits.npy"))
    assert np.array_equal(a, b)

    write_readme(versions, results)
    for name, r in results.items():
        print(f"== {name}: files={r['files']}")
        for key, shape, dtype, fn in r["tensors"]:
            print(f"   {key:55s} {str(shape):16s} {dtype}  [{fn}]")
        print("   extra:", {k: v for k, v in r.items() if k not in ("files", "tensors", "config")})
    print("versions:", versions)


CASE_DOC = {
    "qwen3_untied": "Qwen3Config / Qwen3ForCausalLM, 2 layers, hidden 64, 4 heads, 2 kv heads, "
    "head_dim 32 (so heads*head_dim = 128 != hidden 64), q_norm/k_norm, intermediate 96, "
    "tie_word_embeddings=False.",
    "qwen3_sharded": "Exactly the qwen3_untied model (same seed, same weights, identical logits.npy) "
    'saved with max_shard_size="100KB": several model-0000k-of-0000n.safetensors files + '
    "model.safetensors.index.json.",
    "qwen3_tied": "Like qwen3_untied but tie_word_embeddings=True. The safetensors file contains NO "
    "lm_head.weight: the loader must use model.embed_tokens.weight as the output projection "
    "(logits = h @ embed_tokens.weight.T).",
    "qwen3_moe": "Qwen3MoeConfig / Qwen3MoeForCausalLM, 3 layers, num_experts 4, num_experts_per_tok 2, "
    "moe_intermediate_size 32, intermediate_size 96 (dense layer), norm_topk_prob=True, "
    "decoder_sparse_step=1, mlp_only_layers=[1].",
    "qwen3_moe_nonorm": "Same shapes as qwen3_moe but norm_topk_prob=False and mlp_only_layers=[] "
    "(all 3 layers MoE); the top-2 softmax probabilities are used un-renormalised.",
    "llama": "LlamaConfig / LlamaForCausalLM, 2 layers, hidden 64, 4 heads, 2 kv heads, head_dim 16 "
    "(explicit), no q/k norm, attention_bias=False, mlp_bias=False, tie_word_embeddings=False.",
}


def write_readme(versions, results):
    L = []
    L.append("# Hugging Face loader fixtures")
    L.append("")
    L.append(
        "Tiny randomly-initialised Hugging Face checkpoints plus reference logits, so the JAX "
        "HF-checkpoint loader can be parity-tested without torch (CI has no torch). "
        "**This file is generated by `make_fixtures.py`; edit the script, not this file.**"
    )
    L.append("")
    L.append("## Regenerate")
    L.append("")
    L.append("```bash")
    L.append("python3 -m venv /work/venv-hf   # outside the repo")
    L.append("/work/venv-hf/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu")
    L.append("/work/venv-hf/bin/pip install transformers safetensors numpy")
    L.append("/work/venv-hf/bin/python tests/data/hf_fixtures/make_fixtures.py")
    L.append("```")
    L.append("")
    L.append("Versions used for the committed files:")
    L.append("")
    for k, v in versions.items():
        L.append(f"- {k} {v}")
    L.append("")
    L.append("## Common to all cases")
    L.append("")
    L.append(
        "- float32 everywhere; `attn_implementation=\"eager\"`; vocab 128, hidden 64, "
        "intermediate 96, 4 attention heads, 2 KV heads (GQA), rope_theta 10000 (default rope, "
        "non-interleaved rotate_half), rms_norm_eps 1e-6, max_position_embeddings 64, silu."
    )
    L.append(
        "- Every parameter is randomised (seeded `torch.manual_seed`): RMSNorm weights "
        "(`input_layernorm`, `post_attention_layernorm`, `q_norm`, `k_norm`, `model.norm`) "
        "~ 1 + 0.1*randn, MoE router `mlp.gate.weight` ~ 0.3*randn (the seed is bumped by 100 until every top-k router-logit margin is >= 1e-2, so float32 differences cannot flip expert selection), "
        "all other weights ~ 0.05*randn. No biases anywhere."
    )
    L.append(
        "- `inputs.npy`: int64 (2, 7) token ids (same for all cases). `logits.npy`: float32 "
        "(2, 7, 128) = `model(input_ids, attention_mask=ones).logits` (positions 0..6, no padding)."
    )
    L.append(
        "- The script checks that each saved checkpoint reloads with `from_pretrained` without "
        "missing/unexpected keys and reproduces the logits."
    )
    L.append(
        "- Linear weights are stored torch-style `(out_features, in_features)`; "
        "y = x @ W.T. Transpose when loading into flax `Dense` kernels `(in, out)`."
    )
    rope_spellings = set()
    for r in results.values():
        c = r["config"]
        rope_spellings.add(
            "rope_parameters" if "rope_parameters" in c else ("rope_theta" if "rope_theta" in c else "neither")
        )
    L.append(
        f"- RoPE spelling in config.json (transformers {versions['transformers']}): "
        + ", ".join(sorted(rope_spellings))
        + ". "
        + (
            "The theta is nested: `\"rope_parameters\": {\"rope_theta\": 10000.0, \"rope_type\": \"default\"}`"
            " and there is no top-level `rope_theta`. Older (4.x) checkpoints on the Hub use top-level "
            "`rope_theta` (+ optional `rope_scaling`); a loader should accept both."
            if rope_spellings == {"rope_parameters"}
            else ""
        )
    )
    moe_cfgs = [r["config"] for r in results.values() if r["config"].get("model_type") == "qwen3_moe"]
    if moe_cfgs:
        spell = sorted({k for c in moe_cfgs for k in ("num_experts", "num_local_experts") if k in c})
        L.append(
            f"- Expert-count spelling in the Qwen3-MoE config.json written by this transformers version: "
            f"{', '.join('`' + s + '`' for s in spell)} (Qwen3MoeConfig has "
            "`attribute_map = {\"num_experts\": \"num_local_experts\"}`, so it serialises the mapped "
            "name). Released Qwen3-MoE checkpoints on the Hub write `num_experts`; a loader should accept both."
        )
        L.append(
            "- MoE experts are stored per expert on disk (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, "
            "router `model.layers.N.mlp.gate.weight` of shape (num_experts, hidden)), i.e. the same layout as "
            "released Qwen3-MoE checkpoints. (In memory transformers 5.x fuses them into "
            "`experts.gate_up_proj` (E, 2*I, H) and `experts.down_proj` (E, H, I); `save_pretrained` reverts "
            "that because `save_original_format=True` is the default.)"
        )
    L.append(
        "- Every safetensors header carries `__metadata__ = {\"format\": \"pt\"}`. The sharded case's "
        "`model.safetensors.index.json` has `metadata.total_size` / `metadata.total_parameters` and a "
        "`weight_map` from tensor name to shard file."
    )
    L.append(
        "- `generation_config.json` is written by `save_pretrained`; it carries nothing a loader needs."
    )
    L.append("")
    L.append("## Executable spec: `numpy_reference.py`")
    L.append("")
    L.append(
        "`numpy_reference.py` is an independent numpy-only forward pass (reads config.json + safetensors, "
        "needs only numpy and safetensors). `python tests/data/hf_fixtures/numpy_reference.py` reproduces "
        "every case's `logits.npy` to within ~1e-6. It pins down the details a JAX port must match: "
        "Qwen3 q_norm/k_norm are RMSNorms over head_dim applied per head *before* RoPE; RoPE is the "
        "non-interleaved rotate_half form (pairs i and i + head_dim/2); GQA query head j reads KV head "
        "j // (heads / kv_heads) (torch `repeat_kv`); scores are scaled by head_dim**-0.5; router = softmax "
        "over all experts, then top-k, then (only if `norm_topk_prob`) renormalise the k weights."
    )
    L.append("")
    L.append(
        "Getting any of these wrong moves the logits far more than float32 noise (max |diff| vs logits.npy, "
        "measured with the numpy reference when generating these fixtures): GQA tiling instead of "
        "repeat ~1.3-2.0, interleaved RoPE ~0.2-0.7, rope_theta 1e6 instead of 1e4 ~0.03-0.18, swapped "
        "q_norm/k_norm ~0.06, norm_topk_prob flipped ~0.02-0.05, all-ones norms ~0.26, rms_norm_eps 1e-5 "
        "instead of 1e-6 ~1.4e-3. A parity test with atol ~1e-4 in float32 (use "
        "`jax.default_matmul_precision(\"highest\")` / `precision=HIGHEST` on accelerators) catches all of them."
    )
    L.append("")
    L.append("## Cases")
    L.append("")
    for name, r in results.items():
        L.append(f"### `{name}`")
        L.append("")
        L.append(CASE_DOC[name] + f" Seed {r['seed']}.")
        L.append("")
        if "layer_kinds" in r:
            kinds = ", ".join(f"layer {i}: {k}" for i, k in enumerate(r["layer_kinds"]))
            L.append(
                f"Layer schedule ({kinds}). transformers decides per layer: sparse MoE iff "
                "`layer_idx not in mlp_only_layers and num_experts > 0 and "
                "(layer_idx + 1) % decoder_sparse_step == 0`, otherwise a dense "
                "`Qwen3MoeMLP` with `intermediate_size`."
            )
            L.append("")
            L.append(
                "Min top-k routing margin per MoE layer (router logit of k-th minus (k+1)-th expert, "
                "over the 14 tokens): "
                + ", ".join(f"layer {i}: {m:.3g}" for i, m in r["routing_margin_min"].items())
            )
            L.append("")
        L.append("Files: " + ", ".join(f"`{f}`" for f in r["files"]))
        L.append("")
        L.append("| tensor | shape | dtype | file |")
        L.append("| --- | --- | --- | --- |")
        for key, shape, dtype, fn in r["tensors"]:
            L.append(f"| `{key}` | {list(shape)} | {dtype} | {fn} |")
        L.append("")
        L.append("<details><summary>config.json</summary>")
        L.append("")
        L.append("```json")
        L.append(json.dumps(r["config"], indent=2, sort_keys=True))
        L.append("```")
        L.append("")
        L.append("</details>")
        L.append("")
    with open(os.path.join(HERE, "README.md"), "w") as f:
        f.write("\n".join(L))


if __name__ == "__main__":
    main()
