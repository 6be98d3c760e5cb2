"""task="gym" (gspo_jax/tasks/gym.py): reasoning-gym's problems and verifiers through the
dataset path.

Without reasoning-gym installed, the config checks (name with close matches from the
static list, the gym group's settings) and the "pip install" error at setup still run;
the tests that generate problems are skipped, saying why. With it: for chain_sum,
basic_arithmetic and countdown, problems load, the oracle answer in its tag scores 1
through `Task.score_batch` and a wrong one does not, the held-out split shares no
question with training (colliding ones dropped, and said), unknown dataset settings are
refused, and the static name list matches the installed package."""

import importlib.metadata
import json
import sys

import numpy as np
import pytest

from gspo_jax import config as C
from gspo_jax.tasks import DataConfig, DatasetTask
from gspo_jax.tasks import gym as G
from gspo_jax.train import run as R
from gspo_jax.train import rundir
from gspo_jax.utils import configlib

# Small settings keep generation fast: countdown with 3 numbers takes ~20 ms a problem here,
# with its default 4-6 numbers ~90 ms.
SETTINGS = {"chain_sum": {}, "basic_arithmetic": {},
            "countdown": {"min_numbers": 3, "max_numbers": 3}}


@pytest.fixture(scope="module")
def rg():
  return pytest.importorskip(
      "reasoning_gym", reason="reasoning-gym is an optional extra (pip install "
      "reasoning-gym==0.1.25); task.name='gym' tests that generate problems need it")


def gym_cfg(name="chain_sum", **kw) -> C.TrainConfig:
  return C.TrainConfig(task=C.TaskConfig(name="gym", gym=G.GymConfig(name=name, **kw)))


def make(name, log=print, **kw) -> G.GymTask:
  kw.setdefault("kwargs", json.dumps(SETTINGS.get(name, {})))
  return G.GymTask(G.GymConfig(name=name, **kw), DataConfig(), log=log)


# ------------------------------------------------------------------ without reasoning-gym


def test_unknown_name_is_refused_with_close_matches_when_the_config_is_built():
  with pytest.raises(configlib.ConfigError,
                     match=r"gym.name 'chain_summ' is not a reasoning-gym.*did you mean "
                           r"'chain_sum'"):
    configlib.apply_overrides(C.TrainConfig(), ["task=gym", "task.gym.name=chain_summ"])
  with pytest.raises(ValueError, match="did you mean 'countdown'"):
    G.GymConfig(name="count_down")
  with pytest.raises(ValueError, match="gym.name 'zzzz' is not a reasoning-gym") as e:
    G.GymConfig(name="zzzz")
  assert "did you mean" not in str(e.value)  # nothing close: no made-up suggestion


def test_gym_settings_are_checked_when_the_config_is_built():
  with pytest.raises(ValueError, match="task.name='gym' needs task.gym.name"):
    C.TaskConfig(name="gym")
  with pytest.raises(ValueError, match="task.gym.\\* applies to task.name='gym'; task.name is "
                                       "'addition'"):
    C.TaskConfig(gym=G.GymConfig(name="chain_sum"))
  with pytest.raises(ValueError, match="task.data.heldout_file.*apply to task.name='dataset'"):
    C.TaskConfig(name="gym", gym=G.GymConfig(name="chain_sum"),
                 data=DataConfig(heldout_fraction=0.1))
  with pytest.raises(ValueError, match="gym.kwargs must be a JSON object; got '\\[1\\]'"):
    G.GymConfig(name="chain_sum", kwargs="[1]")
  with pytest.raises(ValueError, match="gym.kwargs must be a JSON object, e.g."):
    G.GymConfig(name="chain_sum", kwargs="max_terms=3")
  with pytest.raises(ValueError, match="task.gym.kwargs sets \\['seed'\\]: use task.gym.seed"):
    G.GymConfig(name="chain_sum", kwargs='{"seed": 3}')
  with pytest.raises(ValueError, match="gym.size \\(0\\)"):
    G.GymConfig(name="chain_sum", size=0)
  # Extra rewards are allowed with the verifier; the held-out seed keeps clear of training.
  cfg = C.TrainConfig(task=C.TaskConfig(name="gym", gym=G.GymConfig(name="chain_sum", seed=5),
                                       reward=("format_reward*0.1",)))
  assert cfg.task.gym.resolved_heldout_seed == 5 + 2**31
  assert configlib.from_dict(C.TrainConfig, json.loads(json.dumps(configlib.to_dict(cfg)))) == cfg


def test_missing_package_is_named_at_setup_with_the_setting(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails, installed or not
  cfg = gym_cfg("countdown", size=4, heldout_size=2)       # in the static list: builds
  with pytest.raises(ImportError, match=r"task.name='gym' \(task.gym.name='countdown'\) needs the "
                                        r"optional package reasoning-gym: pip install "
                                        r"reasoning-gym"):
    R.setup(cfg, str(tmp_path / "run"))  # before the tokenizer and the model


def test_resume_refuses_other_problems():
  saved = gym_cfg("chain_sum")
  with pytest.raises(rundir.RunDirError, match="task.gym.size: saved 1000, requested 10 "
                                               "\\(the task"):
    rundir.check_resume(saved, configlib.apply_overrides(saved, ["task.gym.size=10"]), print)


# --------------------------------------------------------------------- with reasoning-gym


def test_static_names_are_the_installed_packages(rg):
  version = importlib.metadata.version("reasoning-gym")
  assert G.NAMES == set(rg.factory.DATASETS), (
      f"reasoning-gym {version}: update gym.NAMES (and TESTED_VERSION) to its datasets")


def wrong_countdown(meta) -> str:
  """An expression that uses every number once and misses the target."""
  numbers = list(map(str, meta["numbers"]))
  for op in "+*-":
    if eval(op.join(numbers)) != meta["target"]:
      return op.join(numbers)
  raise AssertionError(f"no wrong expression found for {meta}")


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_problems_load_and_score_through_the_reward_path(rg, name):
  task = make(name, size=6, heldout_size=3)
  assert isinstance(task, DatasetTask) and len(task._train) == 6
  examples = task.train_batch(0, 0, 4)
  for e in examples:
    assert e.prompt == e.meta["prompt"] and e.answer and "metadata" in e.meta
  tagged = [f"Sure. <answer>{e.answer}</answer>" for e in examples]
  rewards, correct, parts = task.score_batch(examples, tagged)
  np.testing.assert_array_equal(rewards, 1.0)
  assert correct.all() and set(parts) == {f"reward/{name}"}
  assert task.demonstration(examples[0]) == f"<answer>{examples[0].answer}</answer>"
  # The oracle without its tag is no answer (reasoning-gym's convention); a wrong one in
  # the tag scores what the verifier says: 0 for the arithmetic tasks, countdown's shaping
  # 0.05 for a well-formed wrong expression and 0.01 for no answer.
  untagged = task.score_batch(examples[:1], [examples[0].answer])[0][0]
  if name == "countdown":
    wrong = [f"<answer>{wrong_countdown(e.meta['metadata'])}</answer>" for e in examples]
  else:
    wrong = [f"<answer>{int(e.answer) + 1}</answer>" for e in examples]
  rewards, correct, _ = task.score_batch(examples, wrong)
  assert not correct.any()
  expected = (0.05, 0.01) if name == "countdown" else (0.0, 0.0)
  np.testing.assert_allclose(rewards, expected[0])
  assert untagged == pytest.approx(expected[1])


def test_held_out_split_shares_no_question_with_training(rg):
  lines = []
  task = make("chain_sum", log=lines.append, size=300, heldout_size=50,
              kwargs='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}')
  train = {e.meta["prompt"] for e in task._train}
  held = [e.meta["prompt"] for e in task._heldout]
  assert held and not train & set(held)
  # These settings allow 200 distinct questions: held-out problems did collide, and were
  # dropped and said (so the disjointness above is the filter's, not luck's).
  dropped = 50 - len(held)
  assert dropped > 0 and any(f"dropped {dropped} of 50 held-out" in s for s in lines)
  # Default settings: the held-out seed (seed + 2**31) draws problems of its own.
  wide = make("chain_sum", size=200, heldout_size=50)
  assert len(wide._heldout) == 50
  assert not {e.meta["prompt"] for e in wide._train} & {e.meta["prompt"] for e in wide._heldout}


def test_every_held_out_problem_seen_is_an_error(rg):
  with pytest.raises(ValueError, match="every held-out problem of chain_sum is also a training"):
    make("chain_sum", size=400, heldout_size=5, log=lambda s: None,
         kwargs='{"min_terms": 1, "max_terms": 1, "min_digits": 1, "max_digits": 1}')


def test_extra_rewards_follow_the_verifier(rg):
  cfg = C.TrainConfig(task=C.TaskConfig(
      name="gym", gym=G.GymConfig(name="chain_sum", size=4, heldout_size=2),
      reward=("format_reward*0.5",)))
  task = R.make_task(cfg)  # the run's way: gym.* and reward from the config
  assert isinstance(task, G.GymTask)
  e = task.train_batch(0, 0, 1)[0]
  rewards, correct, parts = task.score_batch([e, e], [f"<answer>{e.answer}</answer>",
                                                      "<answer>nope</answer>"])
  np.testing.assert_allclose(rewards, [1.5, 0.5])  # verifier + 0.5 * format
  assert correct.tolist() == [True, False] and set(parts) == {"reward/chain_sum",
                                                              "reward/format_reward"}


def test_unknown_or_refused_dataset_settings_are_named(rg):
  with pytest.raises(ValueError, match="gym.kwargs: 'max_term' is not a setting of chain_sum.*"
                                       "did you mean 'max_terms'"):
    make("chain_sum", size=2, heldout_size=1, kwargs='{"max_term": 3}')
  with pytest.raises(ValueError, match="refused by reasoning-gym's chain_sum: max_terms must "
                                       "be >= min_terms"):
    make("chain_sum", size=2, heldout_size=1, kwargs='{"min_terms": 4, "max_terms": 3}')
