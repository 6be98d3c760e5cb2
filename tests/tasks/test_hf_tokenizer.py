"""tokenizer.json tokenizers (built here with the `tokenizers` package: no downloads) and
the generate command on an exported model directory."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from gspo_jax import config as C
from gspo_jax import generate
from gspo_jax.models import config, hf, transformer
from gspo_jax.rollout import sampling
from gspo_jax.tasks import text
from gspo_jax.tasks.hf_tokenizer import HFTokenizer, load_tokenizer
from gspo_jax.tasks.tokenizer import SentencePieceTokenizer
from gspo_jax.train import run as R
from gspo_jax.utils import configlib

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = ["The capital of France is Paris.", "2 + 2 = 4", "hello world, hello again"] * 20


def byte_level_bpe(vocab_size=300) -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=SPECIALS,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """An exported tiny Qwen3 with a ChatML-style tokenizer (like Qwen3: no BOS token)."""
  d = tmp_path_factory.mktemp("model")
  tok = byte_level_bpe()
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}, "bos_token": None,
       "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"}))
  vocab = tok.get_vocab_size()
  hf.save(transformer.create(config.tiny(vocab_size=vocab + 8), seed=2), str(d))  # padded vocab
  return d


def test_round_trip_and_special_ids(model_dir):
  tok = HFTokenizer.load(model_dir)
  for text in ["The capital of France is Paris.", "hello  world\n", "ünïcode ✓"]:
    assert tok.decode(tok.encode(text)) == text  # byte-level BPE: any text round-trips
  assert tok.eos_id == tok._tok.token_to_id("<|im_end|>")
  assert tok.pad_id == tok._tok.token_to_id("<|endoftext|>") and tok.bos_id is None
  assert tok.eos_id not in tok.encode("hello world") and tok.vocab_size == 300
  assert tok.chat_template.startswith("{% for m in messages %}")
  again = HFTokenizer.load(os.path.dirname(tok.save(model_dir / "copy")))
  assert (again.eos_id, again.pad_id, again.bos_id, again.chat_template) == \
      (tok.eos_id, tok.pad_id, tok.bos_id, tok.chat_template)
  assert again.encode("hello world") == tok.encode("hello world")


def test_load_tokenizer_picks_the_format(model_dir, tmp_path):
  assert isinstance(load_tokenizer(model_dir), HFTokenizer)
  SentencePieceTokenizer.train(["12+34=46"] * 50, vocab_size=20).save(tmp_path)
  assert isinstance(load_tokenizer(tmp_path), SentencePieceTokenizer)
  with pytest.raises(ValueError, match="no tokenizer.json or tokenizer.model"):
    load_tokenizer(tmp_path / "nothing")


def test_bad_tokenizer_directories(tmp_path):
  byte_level_bpe().save(str(tmp_path / "tokenizer.json"))
  with pytest.raises(ValueError, match="no eos_token"):
    HFTokenizer.load(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
  with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>' is not in the vocabulary"):
    HFTokenizer.load(tmp_path)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  (tmp_path / "tokenizer_config.json").write_text("{}")
  assert HFTokenizer.load(tmp_path).eos_id == 2  # the first of several eos ids
  # BOS comes from tokenizer.json's post-processor, never from add_bos_token (transformers 5
  # drops the flag when a tokenizer.json exists; see tests/tasks/test_text.py for the recordings).
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "add_bos_token": True}))
  tok = HFTokenizer.load(tmp_path)
  assert tok.bos_id is None and tok.bos_token == "<|im_start|>"
  assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello")
  with_bos = byte_level_bpe()
  with_bos.post_processor = processors.TemplateProcessing(
      single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
  with_bos.save(str(tmp_path / "tokenizer.json"))
  tok = HFTokenizer.load(tmp_path)
  assert tok.bos_id == 1 and tok.encode("hello", add_special_tokens=True)[0] == 1
  again = HFTokenizer.load(os.path.dirname(tok.save(tmp_path / "copy")))  # kept by save
  assert again.bos_id == 1 and again.bos_token == "<|im_start|>"
  (tmp_path / "tokenizer.json").write_text("{broken")
  with pytest.raises(ValueError, match="cannot be read as a tokenizer"):
    HFTokenizer.load(tmp_path)


def test_generate_command_matches_the_sampler(model_dir, capsys):
  generate.main(["--model", str(model_dir), "--prompt", "hello", "--prompt", "2 + 2 =",
                 "--max-new-tokens", "6"])
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 2 and lines[0].startswith("hello") and lines[1].startswith("2 + 2 =")
  model, tok = hf.load(str(model_dir)), load_tokenizer(model_dir)
  ids, lens = text.encode_prompts(tok, ["hello", "2 + 2 ="])
  assert ids[0, :lens[0]].tolist() == tok.encode("hello")  # no BOS here (Qwen-style)
  cfg = sampling.SamplerConfig(group_size=1, max_new_tokens=6, eos_id=tok.eos_id,
                               pad_id=tok.pad_id, max_prompt_len=ids.shape[1], greedy=True,
                               vocab_limit=tok.vocab_size)
  r = sampling.sample_groups(model, ids, lens, jax.random.key(0), cfg)
  tokens, mask = np.asarray(r.tokens_BxGxT)[:, 0], np.asarray(r.mask_BxGxT)[:, 0]
  assert lines == [p + c for p, c in zip(["hello", "2 + 2 ="],
                                         text.decode_completions(tok, tokens, mask))]
  assert tokens[mask > 0].max() < tok.vocab_size  # ids of the padded vocabulary: never sampled
  with pytest.raises(ValueError, match="prompt 0 .* encodes to no tokens"):
    text.encode_prompts(tok, [""])


def test_a_pretrained_model_runs_with_the_users_execution_settings(model_dir):
  stored = hf.load(str(model_dir)).cfg
  run_as = hf.load(str(model_dir), execution=dict(remat="dots", attention_chunk=8)).cfg
  assert run_as == dataclasses.replace(stored, remat="dots", attention_chunk=8)
  with pytest.raises(ValueError, match=r"execution takes .*\['hidden'\]"):
    hf.load(str(model_dir), execution=dict(hidden=8))
  # scan_layers is the user's too: the checkpoint's layers load stacked (tests/models/test_hf.py).
  cfg = C.TrainConfig(pretrained=str(model_dir), model=config.tiny(vocab_size=32, scan_layers=True))
  assert hf.model_config(str(model_dir), **R.pretrained_load_args(cfg)).scan_layers


def test_training_starts_from_a_pretrained_directory(model_dir, tmp_path):
  from gspo_jax.parallel import sharding
  from gspo_jax.train import loop as T
  cfg = C.TrainConfig(
      # The architecture is replaced by the checkpoint's; how it runs is kept.
      pretrained=str(model_dir), model=config.tiny(vocab_size=32, attention_chunk=4),
      rollout=C.RolloutConfig(prompts_per_iter=2, group_size=2, max_new_tokens=4,
                              max_prompt_len=8),
      sft=C.SFTConfig(steps=2, batch_size=4), iterations=1, eval_every=0, eval_size=4,
      num_minibatches=1, mesh=sharding.MeshConfig(num_devices=1))
  T.train(cfg, str(tmp_path / "run"), progress=False)
  saved = configlib.load_json(C.TrainConfig, str(tmp_path / "run" / "config.json"))
  assert saved.model == dataclasses.replace(hf.load(str(model_dir)).cfg, attention_chunk=4)
  assert saved.pretrained == str(model_dir)
  assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
  assert not (tmp_path / "run" / "tokenizer.model").exists()  # the model's own tokenizer
  run = R.load_run(str(tmp_path / "run"))
  assert isinstance(run.tok, HFTokenizer) and int(run.state.step) == 1
