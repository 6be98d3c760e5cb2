"""Text <-> padded id arrays: the one place prompts, completions and answers are encoded,
and responses decoded, for any `Tokenizer`.

Shapes: the package legend (docs/shapes.md): B examples (a row per prompt: its
prompt, completion or answer), R responses.
Every array is right-padded with `tok.pad_id` (the sampler's prompt layout: tokens at
0 .. len-1), int32 ids.

Prompts get the tokenizer's own special tokens by default (`add_special_tokens=True`: BOS
for Llama and the task tokenizer, nothing for Qwen), as transformers' `tokenizer.encode`
does. A prompt already rendered by the tokenizer's chat template must be encoded with
`add_special_tokens=False`, as transformers' `apply_chat_template` does: the template
writes the BOS itself, and adding it again would double it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _texts(fn: str, texts: Sequence[str]) -> list[str]:
  # One str is a sequence of characters: it would encode as a batch of one-letter rows.
  if isinstance(texts, str):
    raise ValueError(f"{fn}: expected a sequence of str, not one str; wrap it as [text]")
  return list(texts)


def encode_prompts(tok, prompts: Sequence[str], max_len: int | None = None, *,
                   field: str = "rollout.max_prompt_len",
                   add_special_tokens: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """Prompts as the model sees them: (ids_BxP int32, lens_B int32).

  Args:
    tok: any `Tokenizer`.
    prompts: B strings.
    max_len: P, the width (a fixed width keeps one compiled shape per run); None = the
      longest prompt's length.
    field: the config field `max_len` came from, named when a prompt does not fit.
    add_special_tokens: the tokenizer's BOS (/ EOS) around each prompt; False for prompts
      rendered by a chat template (see the module docstring).
  Returns:
    ids_BxP: row b holds prompt b's tokens at 0 .. lens_B[b]-1, then pad_id.
    lens_B: token counts (special tokens included).
  Raises:
    ValueError: naming the prompt's index when it encodes to no tokens (an empty prompt
      and no BOS), or the index, its token count and `field` when it is longer than max_len.
  """
  prompts = _texts("encode_prompts", prompts)
  rows = [tok.encode(p, add_special_tokens=add_special_tokens) for p in prompts]
  for i, row in enumerate(rows):
    if not row:
      raise ValueError(f"prompt {i} ({prompts[i]!r}) encodes to no tokens (an empty prompt "
                       "and no BOS token): the sampler needs at least one")
    if max_len is not None and len(row) > max_len:
      raise ValueError(f"prompt {i} ({prompts[i][:80]!r}) is {len(row)} tokens, longer than "
                       f"{field}={max_len}")
  width = max(map(len, rows), default=0) if max_len is None else max_len
  ids_BxP = np.full((len(rows), width), tok.pad_id, np.int32)
  for i, row in enumerate(rows):
    ids_BxP[i, :len(row)] = row
  return ids_BxP, np.array([len(r) for r in rows], np.int32)


def encode_completions(tok, texts: Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Demonstrations to teacher-force: plain ids + [eos], cut to max_len (T), right-padded.

  Returns:
    ids_BxT int32, pad_id after the tokens; mask_BxT float32, 1.0 on the tokens (EOS
    included unless cut off).
  """
  texts = _texts("encode_completions", texts)
  ids_BxT = np.full((len(texts), max_len), tok.pad_id, np.int32)
  mask_BxT = np.zeros((len(texts), max_len), np.float32)
  for i, text in enumerate(texts):
    row = (tok.encode(text) + [tok.eos_id])[:max_len]
    ids_BxT[i, :len(row)], mask_BxT[i, :len(row)] = row, 1.0
  return ids_BxT, mask_BxT


def encode_segments(tok, demos: Sequence[Sequence[tuple[str, bool]]], max_len: int
                    ) -> tuple[np.ndarray, np.ndarray]:
  """Multi-turn demonstrations to teacher-force: each a list of (text, is_observation)
  segments, encoded one by one (as the sampler meets them: model tokens, then an
  observation tokenized on its own) + [eos], cut to max_len, right-padded.

  Returns:
    ids_BxT int32; mask_BxT float32, 1.0 on model tokens and EOS, 0.0 on observation
    tokens (they condition what follows but are not the model's to learn) and padding.
  """
  ids_BxT = np.full((len(demos), max_len), tok.pad_id, np.int32)
  mask_BxT = np.zeros((len(demos), max_len), np.float32)
  for i, segments in enumerate(demos):
    row, counted = [], []
    for segment, is_obs in segments:
      ids = tok.encode(segment)
      row += ids
      counted += [0.0 if is_obs else 1.0] * len(ids)
    row, counted = (row + [tok.eos_id])[:max_len], (counted + [1.0])[:max_len]
    ids_BxT[i, :len(row)], mask_BxT[i, :len(row)] = row, counted
  return ids_BxT, mask_BxT


def encode_answers(tok, answers: Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Canonical answer ids (plain, no EOS), cut to max_len (A), right-padded with pad_id:
  (ids_BxA int32, lens_B int32). An exact-match reward compares responses against these."""
  answers = _texts("encode_answers", answers)
  ids_BxA = np.full((len(answers), max_len), tok.pad_id, np.int32)
  lens_B = np.zeros(len(answers), np.int32)
  for i, answer in enumerate(answers):
    row = tok.encode(answer)[:max_len]
    ids_BxA[i, :len(row)], lens_B[i] = row, len(row)
  return ids_BxA, lens_B


def decode_completions(tok, tokens_RxT, mask_RxT) -> list[str]:
  """Text of each response: its counted tokens (mask_RxT > 0), without the EOS.

  Other special ids (pad, bos, unk) become U+FFFD: sentencepiece decodes them to "", which
  would let "1<s>22" pass for "122", so such a response can never match an answer."""
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
