"""Setting a run up (gspo_jax/train/run.py): the kind of rollout it chooses, and its dataset
prompts checked at start-up (file and line, as the model sees them, fast on 100k records)."""

import json
import time

import pytest

from gspo_jax import config as C
from gspo_jax.train import run as R
from tests.helpers import FakeTok, dataset_cfg


def test_the_run_chooses_groups_or_episodes_by_its_environment(monkeypatch):
  """Single-turn groups unless multiturn.env is set, then multi-turn episodes (their
  programs built by Episodes.build, stubbed here)."""
  from gspo_jax.multiturn import rollout as multiturn_rollout
  from gspo_jax.train.collect import Groups
  assert isinstance(R.make_rollout(None, C.TrainConfig(), None, None), Groups)
  built = []
  monkeypatch.setattr(multiturn_rollout.Episodes, "build",
                      classmethod(lambda cls, *args: built.append(args) or "episodes"))
  cfg = C.TrainConfig(multiturn=C.MultiTurnConfig(env="calculator"),
                      loss=C.LossConfig("gspo_token"))
  assert R.make_rollout("graphdef", cfg, "layout", "tok") == "episodes"
  assert built == [("graphdef", cfg, "layout", "tok")]


def test_dataset_prompts_are_checked_at_start_up_with_file_and_line(tmp_path):
  from gspo_jax.tasks import DatasetTask
  from gspo_jax.train.run import check_prompts, with_chat_template
  path = tmp_path / "d.jsonl"
  for lines, match in [(['"1+1="', '"  "'], r"d.jsonl:2: the prompt \('prompt'\) is empty"),
                       (['"1+1="', '""'], r"d.jsonl:2: the prompt \('prompt'\) is empty"),
                       (['"1+1="', '"2+2="', '"1234567890"'],
                        r"d.jsonl:3: the prompt is 11 tokens .* rollout.max_prompt_len=8")]:
    path.write_text("".join(f'{{"prompt": {p}, "answer": "2"}}\n' for p in lines))
    task = DatasetTask(dataset_cfg(path).task.data, ["exact_match"])
    with pytest.raises(ValueError, match=match):
      check_prompts(task, FakeTok(), dataset_cfg(path))
  # As the model sees it: "12345" fits (6 tokens with BOS), its chat rendering does not.
  path.write_text('{"prompt": "12345", "answer": "2"}\n')
  task = DatasetTask(dataset_cfg(path).task.data, ["exact_match"])
  check_prompts(task, FakeTok(), dataset_cfg(path))
  pretrained = dataset_cfg(path, pretrained="some/dir")
  rendered = with_chat_template(task, FakeTok(), pretrained)
  with pytest.raises(ValueError, match=r"d.jsonl:1: the prompt is 26 tokens"):
    check_prompts(rendered, FakeTok(), pretrained)
  check_prompts(rendered, FakeTok(), dataset_cfg(path, 26, pretrained="some/dir"))


def test_checking_100k_dataset_prompts_is_fast(tmp_path):
  from gspo_jax.tasks import DatasetTask
  from gspo_jax.tasks.tokenizer import SentencePieceTokenizer
  from gspo_jax.train.run import check_prompts
  n = 100_000
  path = tmp_path / "d.jsonl"
  with open(path, "w") as f:
    for a in range(n - 1):
      f.write(json.dumps({"prompt": f"{a % 997}+{a % 89}=", "answer": str(a % 997 + a % 89)}))
      f.write("\n")
    f.write('{"prompt": "123456789+987654321+123456789=", "answer": "0"}\n')
  t0 = time.perf_counter()
  task = DatasetTask(dataset_cfg(path).task.data, ["exact_match"])
  t1 = time.perf_counter()
  tok = SentencePieceTokenizer.train(task.corpus(None, 2000)[:2000], vocab_size=32)
  t2 = time.perf_counter()
  with pytest.raises(ValueError, match=rf"d.jsonl:{n}: the prompt is \d+ tokens"):
    check_prompts(task, tok, dataset_cfg(path, max_prompt_len=16))
  t3 = time.perf_counter()
  print(f"\n{n} records: read {t1 - t0:.2f} s, tokenized and checked {t3 - t2:.2f} s")
  assert t3 - t2 < 30  # about 1 s on this project's 2-core machine
