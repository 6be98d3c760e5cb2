"""JSONL datasets: records and their errors, the held-out split, the data order, and a
dataset + reward module from outside the package driving training end to end (with an
exact resume mid-epoch)."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from gspo_jax import config as C
from gspo_jax import evaluate
from gspo_jax.models.config import tiny
from gspo_jax.parallel import sharding
from gspo_jax.tasks import dataset as D
from gspo_jax.train import loop as T
from gspo_jax.utils import configlib
from tests.helpers import interrupted_copy


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def problems(lo, hi):
  return [{"prompt": f"{a}+{a % 3}=", "answer": str(a + a % 3), "id": a} for a in range(lo, hi)]


REWARD_MODULE = """
import json, os

def correct(prompts, completions, answer):
  # Logs the prompts of every call, to compare the data order of two runs.
  with open(os.environ["GSPO_TEST_PROMPT_LOG"], "a") as f:
    f.write(json.dumps(prompts) + "\\n")
  return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def short(prompts, completions, **fields):
  return [1.0 if len(c) <= 2 else 0.0 for c in completions]
"""


# ------------------------------------------------------------------------------ records


def test_records_keep_their_fields_and_line(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "a", "answer": "1", "tags": [1, 2]}\n\n{"prompt": "b"}\n')
  records = D.read_jsonl(str(path))
  assert records[0]["tags"] == [1, 2] and records[0][D.SOURCE] == f"{path}:1"
  assert records[1][D.SOURCE] == f"{path}:3"  # the blank line 2 is skipped, not renumbered


@pytest.mark.parametrize("text,match", [
    ('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",}\n', r"d.jsonl:3: not valid JSON"),
    ('{"prompt": "a"}\n["prompt", "b"]\n', r"d.jsonl:2: expected a JSON object, got list"),
    ('{"question": "a"}\n', r"d.jsonl:1: field 'prompt' must be a string \(no such field\)"),
    ('{"prompt": 3}\n', r"d.jsonl:1: field 'prompt' must be a string \(int\)"),
    ('{"prompt": "a", "_source": "x"}\n', r"d.jsonl:1: field names starting with '_'"),
    ("\n\n", r"d.jsonl' holds no records"),
])
def test_malformed_files_name_the_line(tmp_path, text, match):
  (tmp_path / "d.jsonl").write_text(text)
  with pytest.raises(ValueError, match=match):
    D.read_jsonl(str(tmp_path / "d.jsonl"))


def test_missing_file_is_named(tmp_path):
  with pytest.raises(ValueError, match="absent.jsonl' not found"):
    D.read_jsonl(str(tmp_path / "absent.jsonl"))


def test_heldout_fraction_split_is_disjoint_and_order_free(tmp_path):
  records = problems(0, 400)
  cfg = D.DataConfig(train_file=write_jsonl(tmp_path / "a.jsonl", records), heldout_fraction=0.25)
  train, held = D.split_records(cfg)
  ids = lambda rs: {r["id"] for r in rs}
  assert ids(train).isdisjoint(ids(held)) and len(train) + len(held) == 400
  assert 60 < len(held) < 140  # ~100 expected
  # Membership is a function of the record, not of its position in the file.
  cfg2 = dataclasses.replace(cfg, train_file=write_jsonl(tmp_path / "b.jsonl", records[::-1]))
  assert ids(D.split_records(cfg2)[1]) == ids(held)


def test_config_errors_name_the_field(tmp_path):
  with pytest.raises(ValueError, match="data.heldout_fraction"):
    D.DataConfig(heldout_fraction=1.0)
  with pytest.raises(ValueError, match="task.data.heldout_file and task.data.heldout_fraction"):
    D.DataConfig(heldout_file="h.jsonl", heldout_fraction=0.1)
  with pytest.raises(ValueError, match="task.name='dataset' needs task.data.train_file"):
    C.TaskConfig(name="dataset")
  with pytest.raises(ValueError, match="apply to task.name='dataset'"):
    C.TaskConfig(reward=("exact_match",))
  cfg = configlib.apply_overrides(C.TrainConfig(), [
      "task=dataset", "task.data.train_file=x.jsonl", "task.reward=mod:f,path/r.py:g*0.5"])
  assert cfg.task.reward == ("mod:f", "path/r.py:g*0.5")
  assert cfg.task.data.train_file == "x.jsonl"
  assert configlib.from_dict(C.TrainConfig, configlib.to_dict(cfg)) == cfg


def test_a_field_the_reward_needs_is_checked_on_load(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
  with pytest.raises(ValueError, match=r"exact_match .* needs the field 'answer', which the "
                                       rf"record at {path}:2 lacks"):
    D.DatasetTask(D.DataConfig(train_file=str(path)), ["exact_match"])


# ------------------------------------------------------------------------------ data order


def test_epochs_visit_every_record_once_and_cross_boundaries(tmp_path):
  task = D.DatasetTask(D.DataConfig(train_file=write_jsonl(tmp_path / "d.jsonl", problems(0, 10))),
                       ["exact_match"])
  ids = lambda step, n=4, seed=0: [e.meta["id"] for e in task.train_batch(seed, step, n)]
  # B = 4, N = 10: iterations 0, 1 and half of 2 are epoch 0; the rest of 2 starts epoch 1.
  stream = ids(0) + ids(1) + ids(2) + ids(3) + ids(4)
  assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
  assert stream[:10] != stream[10:20]  # a new permutation each epoch
  assert task.position(2, 4) == (0, 8) and task.position(3, 4) == (1, 2)
  assert ids(3) == ids(3) and ids(3, seed=1) != ids(3)


# ------------------------------------------------------------------------------ end to end


def dataset_cfg(tmp_path, reward=None, **kw):
  module = tmp_path / "my_reward.py"
  module.write_text(REWARD_MODULE)
  base = dict(
      task=C.TaskConfig(
          name="dataset",
          data=D.DataConfig(train_file=write_jsonl(tmp_path / "train.jsonl", problems(0, 12)),
                            heldout_file=write_jsonl(tmp_path / "held.jsonl", problems(50, 54))),
          reward=reward or (f"{module}:correct", f"{module}:short*0.1")),
      model=tiny(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16),
      rollout=C.RolloutConfig(prompts_per_iter=4, group_size=2, max_new_tokens=3, max_prompt_len=8),
      sft=C.SFTConfig(steps=0), optim=C.OptimConfig(learning_rate=1e-3),
      iterations=4, eval_every=0, eval_size=4, num_minibatches=2,
      mesh=sharding.MeshConfig(num_devices=1))
  return C.TrainConfig(**{**base, **kw})


def train_prompts(log_path, train_file):
  """Prompt lists of the reward calls on training rollouts (evaluations filtered out)."""
  train = {r["prompt"] for r in D.read_jsonl(train_file)}
  calls = [json.loads(l) for l in pathlib.Path(log_path).read_text().splitlines()]
  return [c for c in calls if set(c) <= train]


def test_jsonl_and_reward_module_train_end_to_end_and_resume_mid_epoch(tmp_path, monkeypatch,
                                                                        capsys):
  cfg = dataset_cfg(tmp_path)
  log = tmp_path / "prompts_full.log"
  monkeypatch.setenv("GSPO_TEST_PROMPT_LOG", str(log))
  T.train(cfg, str(tmp_path / "full"), checkpoint_every=2, progress=False)
  # N = 12, B = 4: iteration 4 starts epoch 1. The run interrupted after iteration 2
  # (mid-epoch, its checkpoint) is a copy of the full run's directory cut back there; resumed.
  part = interrupted_copy(tmp_path / "full", tmp_path / "part", 2)
  part_log = tmp_path / "prompts_part.log"
  monkeypatch.setenv("GSPO_TEST_PROMPT_LOG", str(part_log))
  T.train(cfg, str(part), resume=True, checkpoint_every=2, progress=False)
  full = train_prompts(log, cfg.task.data.train_file)
  assert len(full) == 4 and all(len(c) == 4 * 2 for c in full)  # B * G rows per call
  # The resumed iterations 3 and 4 draw the same prompts as the uninterrupted run, in order.
  assert full[2:] == train_prompts(part_log, cfg.task.data.train_file)
  out = capsys.readouterr().out
  assert "data position at step 2: epoch 0, index 8 of 12" in out
  assert "first prompt as the model sees it: '" in out  # plain text: no chat template
  rows = [json.loads(l) for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
  assert [(r["data_epoch"], r["data_index"]) for r in rows] == [(0, 0), (0, 4), (0, 8), (1, 0)]
  for r in rows:
    assert {"reward/correct", "reward/short"} <= set(r) and np.isfinite(r["loss"])
    # total reward = correct + 0.1 * short, averaged over the same rows
    assert r["reward_mean"] == pytest.approx(r["reward/correct"] + 0.1 * r["reward/short"],
                                             abs=1e-6)
  rows_part = [json.loads(l) for l in (part / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows_part] == [1, 2, 3, 4]
  for ra, rb in zip(rows, rows_part):
    assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5, abs=1e-6)

  # The evaluation command on a JSONL file: greedy accuracy, pass@k, a JSON report.
  report_path = tmp_path / "report.json"
  evaluate.main(["--checkpoint", str(tmp_path / "full" / "checkpoints" / "4"), "--data",
                 cfg.task.data.heldout_file, "--k", "2", "--n", "4", "--out", str(report_path)])
  report = json.loads(report_path.read_text())
  assert report["step"] == 4 and report["prompts"] == 4 and (report["k"], report["n"]) == (2, 4)
  assert report["pass@2"] == pytest.approx(
      float(np.mean(evaluate.pass_at_k(4, np.array(report["correct_counts"]), 2))))
  assert 0 <= report["accuracy"] <= 1 and len(report["examples"]) == 4
  assert report["examples"][0]["prompt"] == "50+2=" and len(report["examples"][0]["samples"]) == 4


def test_bad_reward_stops_training_with_the_sample(tmp_path, monkeypatch):
  module = tmp_path / "wrong.py"
  module.write_text("def f(prompts, completions, **fields):\n  return [0.5]\n")
  # No held-out set: training starts without one, and the first reward call is on the
  # first rollout (4 prompts x 2 responses).
  cfg = dataset_cfg(tmp_path, reward=(f"{module}:f",), iterations=1)
  cfg = dataclasses.replace(cfg, task=dataclasses.replace(
      cfg.task, data=dataclasses.replace(cfg.task.data, heldout_file="")))
  with pytest.raises(ValueError, match=r"reward f .* returned 1 values for 8 completions .*"
                                       r"first: prompt '\d+\+\d='"):
    T.train(cfg, str(tmp_path / "run"), progress=False)


# ------------------------------------------------------------------------------ worked example


def test_word_problem_example_data_reward_and_config(tmp_path):
  import importlib.util
  import os
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

  def load(name):
    spec = importlib.util.spec_from_file_location(
        f"_wp_{name}", os.path.join(root, "experiments", "word_problems", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

  make = load("make_data")
  train, held = make.make(50, 10)
  assert (train, held) == make.make(50, 10)  # deterministic
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
  for r in train + held:  # the stated answer is the sum / difference of the two numbers
    a, b = (int(x) for x in __import__("re").findall(r"\d+", r["prompt"])[:2])
    assert int(r["answer"]) == (a + b if r["op"] == "+" else a - b) >= 0
  reward = load("reward")
  assert reward.correct(None, ["7", "5 + 2 = 7", "Tom has 7 apples", "3 and 4", "none"],
                        ["7"] * 5) == [1, 1, 1, 0, 0]
  assert reward.brief(None, ["7", " 12.", "7 apples"]) == [1, 1, 0]
  cfg = configlib.load_config(os.path.join(root, "configs", "smollm2_word_problems.py"))
  assert cfg.task.name == "dataset" and cfg.task.reward[0].endswith("reward.py:correct")
  assert configlib.from_dict(C.TrainConfig, configlib.to_dict(cfg)) == cfg


def test_a_byte_that_is_not_utf8_names_its_line(tmp_path):
  (tmp_path / "d.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
  with pytest.raises(ValueError, match=r"d.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"):
    D.read_jsonl(str(tmp_path / "d.jsonl"))
