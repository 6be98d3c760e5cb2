"""Text <-> ids for every caller (train, evaluate, generate, the fused iteration).

(Interim version: the BOS rule of the tokenizer comes in with the tokenization change.)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def encode_prompts(tok, prompts: Sequence[str], max_len: int | None = None, *,
                   field: str = "rollout.max_prompt_len", add_special_tokens: bool = True):
  """[bos] + prompt ids (no bos when the tokenizer has none), right-padded to max_len:
  (ids_BxP int32, lens_B int32)."""
  bos = [] if (tok.bos_id is None or not add_special_tokens) else [tok.bos_id]
  rows = [bos + tok.encode(p) for p in prompts]
  for i, (p, row) in enumerate(zip(prompts, rows)):
    if not row:
      raise ValueError(f"prompt {i} ({p!r}) encodes to no tokens")
    if max_len is not None and len(row) > max_len:
      raise ValueError(f"prompt {i} ({p!r}) needs {len(row)} tokens > {field}={max_len}")
  width = max_len if max_len is not None else max(map(len, rows), default=1)
  ids = np.full((len(rows), width), tok.pad_id, np.int32)
  for i, row in enumerate(rows):
    ids[i, :len(row)] = row
  return ids, np.array([len(r) for r in rows], np.int32)


def encode_completions(tok, texts: Sequence[str], max_len: int):
  """completion ids + [eos], right-padded (truncated to max_len): (ids_BxT, mask_BxT)."""
  ids = np.full((len(texts), max_len), tok.pad_id, np.int32)
  mask = np.zeros((len(texts), max_len), np.float32)
  for i, text in enumerate(texts):
    row = (tok.encode(text) + [tok.eos_id])[:max_len]
    ids[i, :len(row)], mask[i, :len(row)] = row, 1.0
  return ids, mask


def encode_answers(tok, answers: Sequence[str], max_len: int):
  """Canonical answer ids (right-padded with pad_id) and their lengths: (ids_BxA, lens_B)."""
  ids = np.full((len(answers), max_len), tok.pad_id, np.int32)
  lens = np.zeros(len(answers), np.int32)
  for i, answer in enumerate(answers):
    row = tok.encode(answer)[:max_len]
    ids[i, :len(row)], lens[i] = row, len(row)
  return ids, lens


def decode_completions(tok, tokens_RxT, mask_RxT) -> list[str]:
  """Text of each response: counted tokens, without the EOS. Other special ids (pad, bos,
  unk) decode to "" in sentencepiece, which would let "1<s>22" pass for "122": they become
  U+FFFD instead, so such a response can never match an answer."""
  special = {tok.pad_id, tok.bos_id, getattr(tok, "unk_id", -1)}
  out = []
  for ids, m in zip(np.asarray(tokens_RxT), np.asarray(mask_RxT)):
    pieces, run = [], []
    for t in (int(t) for t in ids[m > 0] if t != tok.eos_id):
      if t in special:
        pieces += [tok.decode(run), "\ufffd"]
        run = []
      else:
        run.append(t)
    out.append("".join(pieces) + tok.decode(run))
  return out
