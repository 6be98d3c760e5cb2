"""Hugging Face `tokenizer.json` tokenizers (Qwen3, SmolLM2, Llama 3, ...) behind the
`Tokenizer` interface, with the `tokenizers` package (Rust, no torch).

Special tokens come from `tokenizer_config.json` (`eos_token`, `pad_token`, `bos_token`,
each a string or {"content": ...}), falling back to the ids in `generation_config.json` /
`config.json`. A missing pad token means pad = eos (as most chat models do).

BOS / EOS on `encode(text, add_special_tokens=True)` are decided, as in transformers 5, by
tokenizer.json's own post-processor alone (Llama 3 and Llama 2 prepend BOS there; Qwen3
and SmolLM2 add nothing). `add_bos_token` / `add_eos_token` in tokenizer_config.json are
ignored: transformers 5 drops them whenever a tokenizer.json exists. transformers 4 rebuilt
the post-processor from them only in its Llama, CodeLlama, Gemma, Cohere and GPT-NeoX
classes, and its own `save_pretrained` writes that post-processor into tokenizer.json, so
the two versions differ only for a config edited by hand (tests/data/tokenizer_fixtures
records both). `bos_id` is the token that post-processor puts first, or None;
`bos_token` is the config's BOS text, which chat templates may write.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np
import tokenizers

from gspo_jax.tasks.tokenizer import Tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def _read_json(directory: str, name: str) -> dict:
  path = os.path.join(directory, name)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _content(token) -> str | None:
  return token.get("content") if isinstance(token, dict) else token


class HFTokenizer(Tokenizer):

  def __init__(self, tok: tokenizers.Tokenizer, *, eos: str | int, pad: str | int | None = None,
               bos_token: str | None = None, chat_template: str | None = None,
               source: str = "tokenizer"):
    self._tok = tok
    self.chat_template = chat_template
    self.bos_token = bos_token
    self._eos = self._id(eos, "eos_token", source)
    self._pad = self._eos if pad is None else self._id(pad, "pad_token", source)
    self._prefix = _added_ids(tok)[0]

  def _id(self, token: str | int, field: str, source: str) -> int:
    if isinstance(token, int):
      if not 0 <= token < self.vocab_size:
        raise ValueError(f"{source}: {field} id {token} is outside the vocabulary "
                         f"[0, {self.vocab_size})")
      return token
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f"{source}: {field} {token!r} is not in the vocabulary")
    return i

  @classmethod
  def load(cls, directory: str | os.PathLike) -> HFTokenizer:
    directory = os.fspath(directory)
    path = os.path.join(directory, TOKENIZER_JSON)
    if not os.path.exists(path):
      raise ValueError(f"{directory}: no {TOKENIZER_JSON}")
    try:
      tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust error type is not exported
      raise ValueError(f"{path}: cannot be read as a tokenizer ({e})") from None
    cfg = _read_json(directory, TOKENIZER_CONFIG)
    gen = {**_read_json(directory, "config.json"), **_read_json(directory, "generation_config.json")}
    eos = _content(cfg.get("eos_token")) or gen.get("eos_token_id")
    if isinstance(eos, list):
      eos = eos[0]
    if eos is None:
      raise ValueError(f"{directory}: no eos_token in {TOKENIZER_CONFIG} and no eos_token_id in "
                       "generation_config.json / config.json")
    return cls(tok, eos=eos, pad=_content(cfg.get("pad_token")),
               bos_token=_content(cfg.get("bos_token")), chat_template=cfg.get("chat_template"),
               source=directory)

  def save(self, directory: str | os.PathLike) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TOKENIZER_JSON)
    self._tok.save(path)
    # BOS / EOS live in tokenizer.json's post-processor, which both transformers 4 and 5 apply
    # for this class (add_bos_token here would be ignored by both).
    cfg = {"eos_token": self._tok.id_to_token(self._eos),
           "pad_token": self._tok.id_to_token(self._pad), "bos_token": self.bos_token,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    if self.chat_template:
      cfg["chat_template"] = self.chat_template
    with open(os.path.join(directory, TOKENIZER_CONFIG), "w") as f:
      json.dump(cfg, f, indent=2)
    return path

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Plain pieces, or with `add_special_tokens` what tokenizer.json's post-processor wraps
    them in (transformers' `tokenizer.encode(text)`). Special tokens' text inside `text`
    (e.g. "<|im_end|>") encodes to their single id either way."""
    if not isinstance(text, str):
      raise ValueError(f"encode: text must be a str; got {type(text).__name__}")
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int]) -> str:
    values = np.asarray(ids)
    if values.ndim != 1:
      raise ValueError(f"decode: ids must be 1-D; got shape {values.shape}")
    return self._tok.decode([int(i) for i in values], skip_special_tokens=False)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def bos_id(self) -> int | None:
    return self._prefix[0] if self._prefix else None

  @property
  def eos_id(self) -> int:
    return self._eos

  def __repr__(self) -> str:
    return f"HFTokenizer(vocab_size={self.vocab_size}, eos={self._eos}, bos={self.bos_id})"


def _added_ids(tok: tokenizers.Tokenizer) -> tuple[list[int], list[int]]:
  """(ids the post-processor puts before a text, ids after it): ([bos], []) for Llama 3,
  ([], []) for Qwen3. Read off one encoding, so any post-processor type works (Template,
  Roberta, Bert, Sequence, ...): the tokens of the text itself have a sequence id, added
  ones have None."""
  for probe in ("a", "0", " ", "A"):
    enc = tok.encode(probe, add_special_tokens=True)
    own = [i for i, s in enumerate(enc.sequence_ids) if s is not None]
    if own:
      return enc.ids[:own[0]], enc.ids[own[-1] + 1:]
  # No probe has a token of its own (a vocabulary without these characters): all added ids
  # then count as the prefix, the usual place of what a post-processor adds.
  return tok.encode("", add_special_tokens=True).ids, []


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
  """The tokenizer of a model directory: tokenizer.json (Hugging Face) or tokenizer.model
  (SentencePiece, e.g. this project's task tokenizers)."""
  from gspo_jax.tasks.tokenizer import MODEL_FILE, SentencePieceTokenizer
  directory = os.fspath(directory)
  if os.path.exists(os.path.join(directory, TOKENIZER_JSON)):
    return HFTokenizer.load(directory)
  if os.path.exists(os.path.join(directory, MODEL_FILE)):
    return SentencePieceTokenizer.load(directory)
  raise ValueError(f"{directory}: no {TOKENIZER_JSON} or {MODEL_FILE}")
