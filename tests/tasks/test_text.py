"""gspo_jax.tasks.text: prompts, completions and answers to padded ids and responses back to
text; prompt ids equal to transformers' own `encode` / `apply_chat_template`, recorded in
tests/data/tokenizer_fixtures/ (make_fixtures.py; CI has no transformers)."""

import json
import os
import types

import numpy as np
import pytest

from gspo_jax import generate
from gspo_jax.tasks import Addition, chat, text
from gspo_jax.tasks.hf_tokenizer import load_tokenizer
from gspo_jax.tasks.tokenizer import SentencePieceTokenizer, Tokenizer

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tokenizer_fixtures")
with open(os.path.join(FIXTURES, "recorded.json")) as f:
  RECORDED = json.load(f)
FOLLOWED = "5.24.0"  # the transformers version whose encode we reproduce
CASES = sorted(RECORDED[FOLLOWED]["cases"])


@pytest.fixture(scope="module")
def tok():
  """The task tokenizer: one piece per character, pad 0, unk 1, bos 2, eos 3."""
  return SentencePieceTokenizer.train(Addition().corpus(np.random.default_rng(0), 500))


def recorded(case, version=FOLLOWED):
  return RECORDED[version]["cases"][case]


# ------------------------------------------------------------------------------ prompts


def test_prompts_start_with_the_bos_and_are_right_padded(tok):
  ids, lens = text.encode_prompts(tok, ["1+2=", "37+85="], 8)
  assert ids.dtype == np.int32 and lens.dtype == np.int32 and ids.shape == (2, 8)
  assert lens.tolist() == [5, 7]  # bos + 4, bos + 6
  for row, n, prompt in zip(ids, lens, ["1+2=", "37+85="]):
    assert row[:n].tolist() == [tok.bos_id] + tok.encode(prompt)
    assert np.all(row[n:] == tok.pad_id)
  tight, tight_lens = text.encode_prompts(tok, ["1+2=", "37+85="])  # max_len None: the longest
  assert tight.shape == (2, 7) and np.array_equal(tight, ids[:, :7]) and tight_lens.tolist() == [5, 7]
  plain, plain_lens = text.encode_prompts(tok, ["1+2="], 8, add_special_tokens=False)
  assert plain[0, :4].tolist() == tok.encode("1+2=") and plain_lens.tolist() == [4]
  # An empty prompt is just the BOS for a tokenizer that has one.
  assert text.encode_prompts(tok, [""])[0].tolist() == [[tok.bos_id]]


def test_prompt_errors_name_the_prompt(tok):
  with pytest.raises(ValueError, match=r"prompt 1 \('12345\+6789='\) is 12 tokens, longer than "
                                       r"rollout\.max_prompt_len=8"):
    text.encode_prompts(tok, ["1+2=", "12345+6789="], 8)
  with pytest.raises(ValueError, match=r"is 5 tokens, longer than eval\.max_len=4"):
    text.encode_prompts(tok, ["1+2="], 4, field="eval.max_len")
  with pytest.raises(ValueError, match=r"prompt 0 \(''\) encodes to no tokens"):
    text.encode_prompts(tok, [""], add_special_tokens=False)
  with pytest.raises(ValueError, match="not one str"):
    text.encode_prompts(tok, "1+2=")
  with pytest.raises(ValueError, match="does not round-trip"):  # the tokenizer's own check
    text.encode_prompts(tok, ["x"])


# ------------------------------------------------------------------------------ completions, answers


def test_completions_end_with_eos_and_are_cut_to_max_len(tok):
  d = {c: tok.encode(c)[0] for c in "12345"}
  eos, pad = tok.eos_id, tok.pad_id
  ids, mask = text.encode_completions(tok, ["12", "345"], 4)
  assert ids.dtype == np.int32 and mask.dtype == np.float32
  assert ids.tolist() == [[d["1"], d["2"], eos, pad], [d["3"], d["4"], d["5"], eos]]
  assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
  cut, cut_mask = text.encode_completions(tok, ["345"], 2)  # the EOS is cut off too
  assert cut.tolist() == [[d["3"], d["4"]]] and cut_mask.tolist() == [[1, 1]]


def test_answers_are_plain_ids(tok):
  d = {c: tok.encode(c)[0] for c in "12345"}
  ids, lens = text.encode_answers(tok, ["12", "345"], 4)
  assert ids.tolist() == [[d["1"], d["2"], 0, 0], [d["3"], d["4"], d["5"], 0]]
  assert lens.dtype == np.int32 and lens.tolist() == [2, 3]
  cut, cut_lens = text.encode_answers(tok, ["345"], 2)
  assert cut.tolist() == [[d["3"], d["4"]]] and cut_lens.tolist() == [2]


def test_decode_keeps_counted_tokens_and_marks_special_ones(tok):
  one, two = tok.encode("1"), tok.encode("22")
  ids = np.asarray([one + [tok.bos_id] + two + [tok.eos_id],
                    one + two + [tok.eos_id, tok.pad_id],
                    one + [tok.pad_id] + two + [tok.eos_id]])
  mask = np.ones_like(ids, np.float32)
  mask[1, 4:] = 0  # padding after the EOS is not counted
  # "1<s>22" would decode to "122" in sentencepiece and pass for the answer 122.
  assert text.decode_completions(tok, ids, mask) == ["1\ufffd22", "122", "1\ufffd22"]
  mask[0, 1:] = 0
  assert text.decode_completions(tok, ids[:1], mask[:1]) == ["1"]


class _CharTokenizer(Tokenizer):
  """The smallest replacement: what a pretrained model's tokenizer must provide."""
  chars = "0123456789+*="
  vocab_size, pad_id, bos_id, eos_id = 16, 0, 1, 2

  def encode(self, text, *, add_special_tokens=False):
    return [self.bos_id] * add_special_tokens + [3 + self.chars.index(c) for c in text]

  def decode(self, ids):
    return "".join(self.chars[i - 3] for i in ids if i >= 3)

  def save(self, directory):
    return str(directory)


def test_interface_is_replaceable():
  tok = _CharTokenizer()
  ids, lens = text.encode_prompts(tok, ["1+2=", "3"], 5)
  assert ids.tolist() == [[1, 4, 13, 5, 15], [1, 6, 0, 0, 0]] and lens.tolist() == [5, 2]
  ids, mask = text.encode_completions(tok, ["3"], 3)
  assert ids.tolist() == [[6, 2, 0]] and mask.tolist() == [[1, 1, 0]]
  assert text.decode_completions(tok, ids, mask) == ["3"]


# ------------------------------------------------------------------------------ vs transformers


@pytest.mark.parametrize("case", CASES)
def test_encode_equals_transformers(case):
  tok, rec = load_tokenizer(os.path.join(FIXTURES, case)), recorded(case)
  for r in rec["encode"]:
    assert tok.encode(r["text"], add_special_tokens=True) == r["ids"], r["text"]
    assert tok.encode(r["text"]) == r["plain_ids"], r["text"]
    assert tok.decode(r["ids"]) == r["decoded"], r["text"]
  # bos_id is what transformers puts before every text (encode("") is just that).
  [empty] = [r for r in rec["encode"] if r["text"] == ""]
  assert empty["ids"] == ([] if tok.bos_id is None else [tok.bos_id])


@pytest.mark.parametrize("case", CASES)
def test_encode_prompts_equals_transformers(case):
  tok, rec = load_tokenizer(os.path.join(FIXTURES, case)), recorded(case)
  rows = [r for r in rec["encode"] if r["ids"]]
  ids, lens = text.encode_prompts(tok, [r["text"] for r in rows], 40)
  for row, n, r in zip(ids, lens, rows):
    assert row[:n].tolist() == r["ids"] and np.all(row[n:] == tok.pad_id), r["text"]
  if tok.bos_id is None:  # the empty prompt has no token at all
    with pytest.raises(ValueError, match="encodes to no tokens"):
      text.encode_prompts(tok, [""])


@pytest.mark.parametrize("case", [c for c in CASES if "chat" in recorded(c)])
def test_rendered_prompts_equal_apply_chat_template(case):
  tok, rec = load_tokenizer(os.path.join(FIXTURES, case)), recorded(case)["chat"]
  [message] = rec["messages"]
  rendered = chat.tokenizer_renderer(tok)(message["content"])
  assert rendered == rec["rendered"]
  ids, lens = text.encode_prompts(tok, [rendered], add_special_tokens=False)
  assert ids[0, :lens[0]].tolist() == rec["ids"]
  if tok.bos_id is not None:  # the template wrote the BOS: adding it again doubles it
    doubled, _ = text.encode_prompts(tok, [rendered])
    assert doubled[0, :2].tolist() == [tok.bos_id, tok.bos_id] and rec["ids"][1] != tok.bos_id


def test_transformers_4_differs_only_for_a_hand_edited_config():
  """transformers 4's LlamaTokenizerFast rebuilt the post-processor from add_bos_token /
  add_eos_token; transformers 5 drops them and keeps tokenizer.json's. They disagree only
  where the two say different things, which 4's own save_pretrained never writes."""
  v4 = RECORDED["4.57.6"]["cases"]
  for case in CASES:
    for old, new in zip(v4[case]["encode"], recorded(case)["encode"]):
      assert old["plain_ids"] == new["plain_ids"]
      wrap = [1] * (case == "llama2_flags"), [2] * (case == "llama2_flags")  # <s> ... </s>
      assert old["ids"] == wrap[0] + new["ids"] + wrap[1], (case, new["text"])
  assert all(v["transformers"] == k for k, v in RECORDED.items())


def test_generate_feeds_transformers_prompt_ids(monkeypatch):
  """`generate.generate` on a post-processor-BOS tokenizer (Llama 3 style) samples from
  exactly the ids transformers' encode gives, and decodes the counted tokens."""
  tok, rec = load_tokenizer(os.path.join(FIXTURES, "llama3")), recorded("llama3")
  rows = [r for r in rec["encode"] if r["text"].strip()][:3]
  fed = {}

  def sample_groups(model, ids_BxP, lens_B, key, cfg):
    fed.update(ids=np.asarray(ids_BxP), lens=np.asarray(lens_B), cfg=cfg)
    B, G = ids_BxP.shape[0], cfg.group_size
    # Every response: the first prompt's plain ids, a BOS, "2", EOS, then padding.
    resp = rows[0]["plain_ids"] + [tok.bos_id] + tok.encode("2") + [tok.eos_id, tok.pad_id]
    tokens = np.tile(np.asarray(resp, np.int32), (B, G, 1))
    mask = np.ones_like(tokens, np.float32)
    mask[..., -1] = 0
    return types.SimpleNamespace(tokens_BxGxT=tokens, mask_BxGxT=mask)

  monkeypatch.setattr(generate.sampling, "sample_groups", sample_groups)
  out = generate.generate(None, tok, [r["text"] for r in rows], max_new_tokens=5, num_samples=2)
  width = max(len(r["ids"]) for r in rows)
  assert fed["ids"].shape == (3, width) and fed["cfg"].max_prompt_len == width
  for row, n, r in zip(fed["ids"], fed["lens"], rows):
    assert row[:n].tolist() == r["ids"] and row[0] == tok.bos_id and np.all(row[n:] == tok.pad_id)
  assert out == [[rows[0]["text"] + "\ufffd2"] * 2] * 3
