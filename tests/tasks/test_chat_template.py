"""Chat templates: rendered exactly as the model's jinja2 template says, sandboxed, BOS
never doubled, and applied only to a pretrained tokenizer's dataset prompts."""

import json

import jinja2
import pytest

from gspo_jax.config import TaskConfig, TrainConfig
from gspo_jax.tasks import DataConfig, DatasetTask, chat, text
from gspo_jax.train.run import with_chat_template
from tests.helpers import FakeTok

# SmolLM2-135M-Instruct's template (tokenizer_config.json), ChatML with a default system turn.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_chatml_rendering_is_exact():
  render = chat.prompt_renderer(SMOLLM2)
  assert render("What is 2+3?") == (
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
      "Face<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
  # A system prompt replaces the template's default one.
  assert chat.prompt_renderer(SMOLLM2, system_prompt="Be brief.")("hi") == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
      "<|im_start|>assistant\n")


def test_bos_is_not_doubled():
  tok = FakeTok()
  rendered = chat.tokenizer_renderer(tok)("hi")
  assert rendered == "<s>[user] hi\n[assistant] "  # as transformers renders it
  # Encoded as apply_chat_template does (no special tokens added): the template's BOS only.
  ids, lens = text.encode_prompts(tok, [rendered], 32, add_special_tokens=False)
  assert ids[0, :lens[0]].tolist().count(tok.bos_id) == 1 and ids[0, 0] == tok.bos_id
  doubled, _ = text.encode_prompts(tok, [rendered], 32)  # what add_special_tokens=True would do
  assert doubled[0, :2].tolist() == [tok.bos_id, tok.bos_id]


def test_templates_are_sandboxed_and_may_raise():
  with pytest.raises(jinja2.exceptions.SecurityError):
    chat.prompt_renderer("{{ ''.__class__.__mro__[1].__subclasses__() }}")("x")
  with pytest.raises(jinja2.exceptions.TemplateError, match="only user turns"):
    chat.prompt_renderer("{{ raise_exception('only user turns') }}")("x")


def test_applied_only_to_pretrained_dataset_prompts(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"prompt": "2+3?", "answer": "5"}) + "\n")
  task = DatasetTask(DataConfig(train_file=str(path)), ["exact_match"])
  tok = FakeTok()
  task_of = lambda data: TaskConfig(name="dataset", reward=("exact_match",), data=data)
  on = TrainConfig(task=task_of(DataConfig(train_file=str(path))), pretrained="some/dir")
  off = TrainConfig(task=task_of(DataConfig(train_file=str(path), chat_template=False)),
                    pretrained="some/dir")
  shown = with_chat_template(task, tok, on).train_batch(0, 0, 1)[0]
  assert shown.prompt == "<s>[user] 2+3?\n[assistant] " and shown.meta["prompt"] == "2+3?"
  assert with_chat_template(task, tok, off).train_batch(0, 0, 1)[0].prompt == "2+3?"
  tok.chat_template = None
  assert with_chat_template(task, tok, on) is task
  # Rewards see the user's text, not the rendered prompt.
  rendered = with_chat_template(task, FakeTok(), on)
  r, correct, parts = rendered.score_batch(rendered.train_batch(0, 0, 1), ["5"])
  assert r.tolist() == [1.0] and correct.tolist() == [True]
