#!/usr/bin/env python
"""Tiny tokenizer.json fixtures and what transformers' own tokenizer does with them.

CI has no transformers, so its outputs are recorded here and committed. Two steps:

    # 1. the fixture directories (needs only `tokenizers`, as the project's venv has):
    python tests/data/tokenizer_fixtures/make_fixtures.py build
    # 2. the recordings, once per transformers version (torch is not needed):
    python3 -m venv /tmp/tf5 && /tmp/tf5/bin/pip install transformers==5.24.0 jinja2
    python3 -m venv /tmp/tf4 && /tmp/tf4/bin/pip install transformers==4.57.6 jinja2
    /tmp/tf5/bin/python tests/data/tokenizer_fixtures/make_fixtures.py record
    /tmp/tf4/bin/python tests/data/tokenizer_fixtures/make_fixtures.py record

`record` replaces this transformers version's entry in recorded.json:
    {"<version>": {"transformers": v, "tokenizers": v, "cases": {case: {
        "class": the class AutoTokenizer picked, "bos_token": str|null, "bos_token_id": int|null,
        "encode": [{"text", "ids" (= encode(text)), "plain_ids" (add_special_tokens=False),
                    "decoded" (= decode(ids))}],
        "chat": {"messages", "rendered", "ids"} (apply_chat_template(add_generation_prompt=True,
                 tokenize=False / True); only for cases with a chat template)}}}}

Cases (each a tokenizer.json + tokenizer_config.json; the pipelines are exactly what
transformers 5 rebuilds for the declared class, so the only thing that can differ is BOS/EOS):
    llama3        byte-level BPE whose post-processor prepends <|begin_of_text|> (Llama 3:
                  Sequence[ByteLevel, TemplateProcessing]); no add_bos_token in the config.
    llama2        Metaspace BPE, TemplateProcessing("<s> $A") and add_bos_token=true in the
                  config (LlamaTokenizerFast): the Llama 2 / Mistral / TinyLlama layout.
    llama2_flags  the same tokenizer with no post-processor but add_bos_token=add_eos_token=true
                  (a hand-edited config): transformers 4 adds both, transformers 5 neither.
    smollm_flags  byte-level, post-processor ByteLevel only, add_bos_token=true with the generic
                  PreTrainedTokenizerFast class (what a GGUF conversion writes): neither adds.
    qwen          Qwen2's pipeline (NFC, split regex, ByteLevel), no BOS token at all.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDED = os.path.join(HERE, "recorded.json")

TEXTS = ["Hello there", "hello world, hello again", " The capital of France is Paris.\n",
         "2 + 2 = 4", "", "ünïcode ✓"]
# Every character of the texts and templates is in the corpus, so no text hits <unk> (which
# transformers 5's LlamaTokenizer, rebuilt without an unk_token, drops instead).
CORPUS = TEXTS + ["What is 2+3?", "[INST] user assistant system [/INST]"] * 20
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]

# Llama 3's and Qwen2's pre-tokenizer regexes (tokenizer.json / transformers qwen2).
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                   "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
                   "{% endif %}")
LLAMA2_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]"
                   "{% endfor %}")
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                   "{% endif %}")


def _byte_level(specials, regex, *, nfc=False):
  import tokenizers
  from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  if nfc:
    tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def _metaspace():
  """Llama 2's pipeline as transformers 5's LlamaTokenizer builds it (legacy=False)."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
  return tok


def _template(bos: str, bos_id: int):
  from tokenizers import processors
  return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                       special_tokens=[(bos, bos_id)])


def cases():
  """{case: (tokenizers.Tokenizer, tokenizer_config dict)}."""
  from tokenizers import processors
  llama3 = _byte_level(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"], LLAMA3_REGEX)
  llama3.post_processor = processors.Sequence([
      processors.ByteLevel(trim_offsets=False),
      _template("<|begin_of_text|>", llama3.token_to_id("<|begin_of_text|>"))])
  llama2 = _metaspace()
  llama2.post_processor = _template("<s>", llama2.token_to_id("<s>"))
  smollm = _byte_level(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], LLAMA3_REGEX)
  smollm.post_processor = processors.ByteLevel(trim_offsets=False)
  qwen = _byte_level(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN2_REGEX, nfc=True)
  qwen.post_processor = processors.ByteLevel(trim_offsets=False, use_regex=False)
  llama2_cfg = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                "unk_token": "<unk>", "legacy": False, "clean_up_tokenization_spaces": False}
  return {
      "llama3": (llama3, {"tokenizer_class": "PreTrainedTokenizerFast",
                          "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                          "clean_up_tokenization_spaces": False, "chat_template": LLAMA3_TEMPLATE}),
      "llama2": (llama2, {**llama2_cfg, "add_bos_token": True, "add_eos_token": False,
                          "chat_template": LLAMA2_TEMPLATE}),
      "llama2_flags": (_metaspace(), {**llama2_cfg, "add_bos_token": True, "add_eos_token": True}),
      "smollm_flags": (smollm, {"tokenizer_class": "PreTrainedTokenizerFast",
                                "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                "add_bos_token": True, "clean_up_tokenization_spaces": False,
                                "chat_template": CHATML_TEMPLATE}),
      "qwen": (qwen, {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None,
                      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                      "clean_up_tokenization_spaces": False, "chat_template": CHATML_TEMPLATE}),
  }


def build():
  for name, (tok, cfg) in cases().items():
    d = os.path.join(HERE, name)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
      json.dump(cfg, f, indent=2)
    print("wrote", d)


def _ids(out):
  """apply_chat_template(tokenize=True) returns ids (4.x) or a BatchEncoding (5.x)."""
  return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def record():
  import tokenizers
  import transformers
  from transformers import AutoTokenizer
  entry = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
           "cases": {}}
  for name in cases():
    tok = AutoTokenizer.from_pretrained(os.path.join(HERE, name))
    texts = TEXTS + [f"{tok.eos_token} after"]  # a special token's text stays one id
    rec = {"class": type(tok).__name__, "bos_token": tok.bos_token,
           "bos_token_id": tok.bos_token_id, "encode": []}
    for text in texts:
      ids = tok.encode(text)
      rec["encode"].append({"text": text, "ids": ids,
                            "plain_ids": tok.encode(text, add_special_tokens=False),
                            "decoded": tok.decode(ids)})
    if tok.chat_template:
      rec["chat"] = {"messages": MESSAGES,
                     "rendered": tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                         tokenize=False),
                     "ids": _ids(tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                         tokenize=True))}
    entry["cases"][name] = rec
  recorded = {}
  if os.path.exists(RECORDED):
    with open(RECORDED) as f:
      recorded = json.load(f)
  recorded[transformers.__version__] = entry
  with open(RECORDED, "w") as f:
    json.dump(dict(sorted(recorded.items(), reverse=True)), f, indent=1, ensure_ascii=False)
    f.write("\n")
  print("recorded transformers", transformers.__version__, "in", RECORDED)


if __name__ == "__main__":
  if sys.argv[1:] not in (["build"], ["record"]):
    sys.exit(__doc__)
  build() if sys.argv[1] == "build" else record()
