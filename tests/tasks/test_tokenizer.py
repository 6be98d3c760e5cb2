"""gspo_jax.tasks.tokenizer: exact round trips, special ids, digits, save/load."""

import numpy as np
import pytest

from gspo_jax.tasks import Addition, Multiplication
from gspo_jax.tasks.tokenizer import SentencePieceTokenizer

TASKS = [Addition(), Multiplication(), Addition(digits=3)]


@pytest.fixture(scope="module")
def corpus():
  rng = np.random.default_rng(0)
  return Addition().corpus(rng, 2000) + Multiplication().corpus(rng, 2000)


@pytest.fixture(scope="module", params=["bpe", "char"])
def tok(request, corpus):
  return SentencePieceTokenizer.train(corpus, vocab_size=32, model_type=request.param)


def _texts():
  """Prompts, completions and full texts of every task, both splits."""
  out = []
  for task in TASKS:
    for split in ("train", "heldout"):
      for ex in task.sample(np.random.default_rng(5), 200, split):
        demo = task.demonstration(ex)
        out += [ex.prompt, demo, ex.prompt + demo]
  return out


def test_round_trip_is_exact(tok):
  for text in _texts():
    assert tok.decode(tok.encode(text)) == text


def test_vocabulary_is_small_and_fixed(tok):
  # 4 specials + 10 digits + "+", "*", "=" + the space that `ensure_chars` guarantees.
  # split_digits leaves BPE no merge to make, so bpe and char give the same pieces.
  assert tok.vocab_size == 18
  assert set(tok.pieces[4:]) == set("0123456789+*=") | {"▁"}


def test_special_ids(tok):
  assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
  produced = {i for text in _texts() for i in tok.encode(text)}
  assert not produced & {0, 1, 2, 3}
  assert max(produced) < tok.vocab_size
  five = tok.encode("5")
  assert tok.decode([tok.bos_id] + five + [tok.eos_id, tok.pad_id, tok.pad_id]) == "5"
  # Its own special tokens: a bos first (what prompts start with), never an eos.
  assert tok.encode("5", add_special_tokens=True) == [tok.bos_id] + five
  assert tok.encode("", add_special_tokens=True) == [tok.bos_id] and tok.encode("") == []


def test_digits_are_single_tokens(tok):
  digit_ids = [tok.encode(d) for d in "0123456789"]
  assert all(len(ids) == 1 for ids in digit_ids)
  assert len({ids[0] for ids in digit_ids}) == 10
  assert tok.encode("9876543210") == [tok.encode(d)[0] for d in "9876543210"]
  assert len(tok.encode("12*34=408")) == 9  # one token per character


def test_spaces_round_trip_without_spaces_in_the_corpus(tok, corpus):
  assert not any(" " in t for t in corpus)
  for text in [" ", "12 + 34 = 46", "  7+8=15 ", "1  2"]:
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", ["a", "12\t3", "1\n2", "１２", "1▁2", "12 ⁇"])
def test_unencodable_text_raises_instead_of_unk(tok, text):
  # Fullwidth "１２" would silently become "12" under SentencePiece's default NFKC rule, and
  # a literal "▁" would decode as a space.
  with pytest.raises(ValueError, match="encode: text .* does not round-trip"):
    tok.encode(text)


def test_tabs_and_newlines_learned_from_the_corpus_round_trip():
  # Under SentencePiece's default NFKC rule a tab or newline would decode as a space.
  tok = SentencePieceTokenizer.train(["1\t2=3", "4\n5"], model_type="char")
  for text in ["1\t2=3\n", "\t\t5 4"]:
    assert tok.decode(tok.encode(text)) == text


def test_save_load(tok, tmp_path):
  path = tok.save(tmp_path / "tok")
  assert path.endswith("tokenizer.model")
  loaded = SentencePieceTokenizer.load(tmp_path / "tok")
  assert loaded.model_proto == tok.model_proto and loaded.pieces == tok.pieces
  for text in _texts()[:300]:
    assert loaded.encode(text) == tok.encode(text)


def test_training_is_deterministic(corpus):
  a = SentencePieceTokenizer.train(corpus)
  b = SentencePieceTokenizer.train(iter(corpus))  # any iterable
  assert a.model_proto == b.model_proto


def test_train_errors(corpus):
  with pytest.raises(ValueError, match="model_type must be one of"):
    SentencePieceTokenizer.train(corpus, model_type="unigram")
  with pytest.raises(ValueError, match="no non-empty text"):
    SentencePieceTokenizer.train(["", ""])
  with pytest.raises(ValueError, match="not one str"):
    SentencePieceTokenizer.train("1+2=3")
  with pytest.raises(ValueError, match="vocab_size must be an int >= 5"):
    SentencePieceTokenizer.train(corpus, vocab_size=4)
  letters = ["abcdefghijklmnopqrstuvwxyz"]
  # The char model would silently drop the rarest characters; train() refuses.
  with pytest.raises(ValueError, match="leaves the characters .* out of the vocabulary"):
    SentencePieceTokenizer.train(letters, vocab_size=20, model_type="char")
  with pytest.raises(ValueError, match="SentencePiece training failed"):
    SentencePieceTokenizer.train(letters, vocab_size=20, model_type="bpe")


def test_constructor_and_decode_errors(tok):
  with pytest.raises(ValueError, match="model_proto must be bytes"):
    SentencePieceTokenizer("tokenizer.model")
  with pytest.raises(ValueError, match="not a valid SentencePiece model"):
    SentencePieceTokenizer(b"garbage")
  with pytest.raises(ValueError, match=r"decode: ids must lie in \[0, 18\)"):
    tok.decode([5, 18])
  with pytest.raises(ValueError, match="decode: ids must be a 1-D sequence of ints"):
    tok.decode([[5]])
  assert tok.decode(np.array(tok.encode("12"), np.int32)) == "12"
  assert tok.decode([]) == ""
