"""Tokenizers: a small interface and a SentencePiece implementation.

The training loop only needs `encode`, `decode`, the special ids and `vocab_size`, so a
pretrained model's tokenizer can replace the tiny one trained here by implementing
`Tokenizer`. Batches of text become padded id arrays in `gspo_jax.tasks.text`.

The SentencePiece model is configured for exact round trips of short task texts:
  * whitespace kept as is: add_dummy_prefix=False, remove_extra_whitespaces=False;
  * normalization_rule_name="identity": the default NFKC rule silently rewrites text
    (a tab becomes a space, "１２" becomes "12"), so decode(encode(t)) != t;
  * split_digits=True: every digit is its own piece, never merged with its neighbours,
    which keeps arithmetic learnable and the answer parser trivial;
  * the space is always in the vocabulary (`ensure_chars`), because a corpus without
    spaces leaves "▁" out and spaces would then decode as " ⁇ ";
  * no byte_fallback: it needs vocab_size >= ~260 and the tiny models use ~32. Instead,
    `encode` raises on any text it cannot round-trip rather than emitting <unk>.
"""

from __future__ import annotations

import abc
import io
import numbers
import os
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

MODEL_FILE = "tokenizer.model"
MODEL_TYPES = ("bpe", "char")
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer(abc.ABC):
  """Text <-> token ids."""

  @abc.abstractmethod
  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`. Plain pieces by default (no bos / eos / pad); with
    `add_special_tokens=True`, what transformers' `tokenizer.encode(text)` returns: the
    tokens the tokenizer itself wraps a text in (e.g. bos first), `bos_id` among them."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`. Does not stop at eos: the caller cuts there first."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids; every id lies in [0, vocab_size). A model may pad its embedding above it."""

  @property
  @abc.abstractmethod
  def pad_id(self) -> int: ...

  @property
  @abc.abstractmethod
  def bos_id(self) -> int | None:
    """The id `encode(text, add_special_tokens=True)` starts with, or None when it adds none."""

  @property
  @abc.abstractmethod
  def eos_id(self) -> int: ...

  @abc.abstractmethod
  def save(self, directory: str | os.PathLike) -> str:
    """Writes the tokenizer under `directory` (created if needed); returns the file path."""


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model held in memory as its serialized proto.

  Special ids of models trained by `train`: pad 0, unk 1, bos 2, eos 3. These decode
  to "" (pad, bos, eos) or " ⁇ " (unk); `encode` produces none of them, except the bos
  that `add_special_tokens=True` prepends.
  """

  def __init__(self, model_proto: bytes):
    fn = "SentencePieceTokenizer"
    if not isinstance(model_proto, (bytes, bytearray)):
      raise ValueError(f"{fn}: model_proto must be bytes (a serialized SentencePiece model); "
                       f"got {type(model_proto).__name__}")
    try:
      self._sp = spm.SentencePieceProcessor(model_proto=bytes(model_proto))
    except RuntimeError as e:
      raise ValueError(f"{fn}: model_proto is not a valid SentencePiece model: {e}") from e
    for special in ("pad", "unk", "bos", "eos"):
      if getattr(self._sp, f"{special}_id")() < 0:
        # SentencePiece disables pad by default; the sampler and batching need it.
        raise ValueError(f"{fn}: model_proto defines no {special} id; train it with "
                         f"{special}_id set (SentencePieceTokenizer.train does)")
    self._proto = bytes(model_proto)

  # --- construction -------------------------------------------------------------------

  @classmethod
  def train(cls, texts: Iterable[str], *, vocab_size: int = 32, model_type: str = "bpe",
            ensure_chars: str = " ") -> SentencePieceTokenizer:
    """Trains in memory (nothing touches the disk) on `texts`, e.g. `task.corpus(rng, n)`.

    Args:
      texts: training lines; each character in them gets a piece (character_coverage=1).
      vocab_size: an upper bound: SentencePiece stops early when no merge is left, e.g.
        17 pieces (+1 for the space) for digits-split arithmetic. Must cover the 4
        specials and every distinct character (ValueError otherwise).
      model_type: "bpe" or "char".
      ensure_chars: characters given a piece even if `texts` lacks them. Each becomes a
        training line of its own, so a newline cannot be one (a line holding only a newline is
        dropped as empty); a newline inside `texts` is learned normally.
    Returns:
      the tokenizer; `vocab_size` tells the size actually reached.
    """
    fn = "SentencePieceTokenizer.train"
    if isinstance(texts, str):
      raise ValueError(f"{fn}: texts must be an iterable of str, not one str")
    texts = list(texts)
    for i, t in enumerate(texts):
      if not isinstance(t, str):
        raise ValueError(f"{fn}: texts[{i}] must be a str; got {type(t).__name__}")
    if not any(texts):
      raise ValueError(f"{fn}: texts holds no non-empty text to train on")
    if model_type not in MODEL_TYPES:
      raise ValueError(f"{fn}: model_type must be one of {MODEL_TYPES}; got {model_type!r}")
    if _not_int_at_least(vocab_size, 5):
      raise ValueError(f"{fn}: vocab_size must be an int >= 5 (4 specials + 1 piece); "
                       f"got {vocab_size!r}")
    if "\n" in ensure_chars:
      raise ValueError(f"{fn}: ensure_chars cannot hold a newline")
    # One line per character: a character seen anywhere gets a piece at coverage 1.0.
    lines = texts + list(ensure_chars)
    buf = io.BytesIO()
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(lines), model_writer=buf, vocab_size=int(vocab_size),
          model_type=model_type, split_digits=True, add_dummy_prefix=False,
          remove_extra_whitespaces=False, normalization_rule_name="identity",
          pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
          character_coverage=1.0, hard_vocab_limit=False, num_threads=2, minloglevel=2)
    except RuntimeError as e:
      raise ValueError(f"{fn}: SentencePiece training failed (vocab_size={vocab_size}, "
                       f"model_type={model_type!r}, {len(texts)} texts): {e}") from e
    tok = cls(buf.getvalue())
    # The char model does not fail when vocab_size is too small: it silently drops the
    # rarest characters, which would then encode as <unk>.
    missing = tok._unencodable("".join(texts) + ensure_chars)
    if missing:
      raise ValueError(f"{fn}: vocab_size={vocab_size} leaves the characters {missing} out of the "
                       f"vocabulary ({tok.vocab_size} pieces); increase vocab_size")
    return tok

  @classmethod
  def load(cls, directory: str | os.PathLike) -> SentencePieceTokenizer:
    """The tokenizer written by `save(directory)`."""
    with open(os.path.join(directory, MODEL_FILE), "rb") as f:
      return cls(f.read())

  def save(self, directory: str | os.PathLike) -> str:
    """Writes `directory/tokenizer.model` (the serialized proto); returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MODEL_FILE)
    with open(path, "wb") as f:
      f.write(self._proto)
    return path

  # --- the Tokenizer interface ----------------------------------------------------------

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Ids of `text`; bos first when `add_special_tokens` (never eos). Guarantees
    decode(encode(text)) == text.

    Raises:
      ValueError: naming `text` when it holds characters outside the vocabulary (they
        would become <unk>) or anything else that would not round-trip exactly.
    """
    if not isinstance(text, str):
      raise ValueError(f"encode: text must be a str; got {type(text).__name__}")
    ids = self._sp.encode(text, out_type=int)
    # A decode per encode costs microseconds and catches every lossy case at once:
    # <unk>, a literal "▁" (decodes as a space), a newline.
    if self._sp.decode(ids) != text:
      raise ValueError(f"encode: text {text[:200]!r} does not round-trip through this tokenizer; "
                       f"characters outside its vocabulary: {self._unencodable(text)}")
    return [self.bos_id] + ids if add_special_tokens else ids

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids` (a list or 1-D integer array); pad, bos and eos decode to ""."""
    values = np.asarray(ids)
    if values.ndim != 1 or not (values.size == 0 or np.issubdtype(values.dtype, np.integer)):
      raise ValueError(f"decode: ids must be a 1-D sequence of ints; got shape {values.shape}, "
                       f"dtype {values.dtype}")
    if values.size and (values.min() < 0 or values.max() >= self.vocab_size):
      raise ValueError(f"decode: ids must lie in [0, {self.vocab_size}); got min {values.min()}, "
                       f"max {values.max()}")
    return self._sp.decode([int(i) for i in values])

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def pad_id(self) -> int:
    return self._sp.pad_id()

  @property
  def unk_id(self) -> int:
    return self._sp.unk_id()

  @property
  def bos_id(self) -> int:
    return self._sp.bos_id()

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  # --- inspection -----------------------------------------------------------------------

  @property
  def model_proto(self) -> bytes:
    return self._proto

  @property
  def pieces(self) -> list[str]:
    """Piece strings by id ("▁" is the space)."""
    return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

  def _unencodable(self, text: str) -> list[str]:
    """Sorted distinct characters of `text` that do not round-trip on their own."""
    return sorted(c for c in set(text) if self._sp.decode(self._sp.encode(c, out_type=int)) != c)

  def __repr__(self) -> str:
    return f"SentencePieceTokenizer(vocab_size={self.vocab_size})"


def _not_int_at_least(value, low: int) -> bool:
  return isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low
