"""gspo_jax.tasks.chain (the long task): hand-checked problems and solutions, every
demonstration verifies, disjoint splits, wrong answers score 0, solution length follows
task.steps, and settings whose solutions cannot fit the rollout are refused by name."""

import dataclasses
import re

import numpy as np
import pytest

from gspo_jax.config import RolloutConfig, TaskConfig, TrainConfig
from gspo_jax.tasks import TASKS, Chain, make_task
from gspo_jax.tasks.tokenizer import SentencePieceTokenizer
from gspo_jax.train import run as run_lib


def _tokenizer(task, n=500):
  """A task tokenizer as `run.make_tokenizer` trains it (split digits, BPE), smaller corpus."""
  return SentencePieceTokenizer.train(task.corpus(np.random.default_rng(0), n), vocab_size=64)


def _replay(prompt):
  """Independent evaluation of a prompt "17a+5b-3c+8=": the running totals."""
  m = re.fullmatch(r"([0-9]+)((?:[a-z][+-][0-9]+)+)=", prompt)
  assert m, prompt
  totals = [int(m[1])]
  for letter, sign, x in re.findall(r"([a-z])([+-])([0-9]+)", m[2]):
    totals.append(totals[-1] + int(x) if sign == "+" else totals[-1] - int(x))
  return totals


def test_hand_checked_problems():
  task = Chain(digits=1, steps=3)
  ex = task.example(17, [("+", 5), ("-", 3), ("+", 8)])
  assert ex.prompt == "17a+5b-3c+8="
  assert task.demonstration(ex) == "a:17+5=22;b:22-3=19;c:19+8=27;#27"
  assert ex.answer == "27"
  # Totals are zero-padded to digits + 1 places, operands to `digits` places.
  task2 = Chain(digits=2, steps=2)
  ex2 = task2.example(105, [("-", 99), ("+", 7)])
  assert ex2.prompt == "105a-99b+07="
  assert task2.demonstration(ex2) == "a:105-99=006;b:006+07=013;#013"
  with pytest.raises(ValueError, match="running total -2 leaves"):
    task.example(3, [("-", 5)])


def test_registry_and_run_pass_the_knobs():
  assert TASKS["chain"] is Chain
  task = make_task("chain", digits=2, steps=7)
  assert (task.digits, task.steps) == (2, 7)
  cfg = TrainConfig(task=TaskConfig(name="chain", digits=1, steps=5),
                    rollout=RolloutConfig(max_new_tokens=64, max_prompt_len=24))
  assert repr(run_lib.make_task(cfg)) == repr(Chain(digits=1, steps=5))
  default = TrainConfig(task=TaskConfig(name="chain", digits=1),
                        rollout=RolloutConfig(max_new_tokens=130, max_prompt_len=48))
  assert run_lib.make_task(default).steps == 12


@pytest.mark.parametrize("digits,steps", [(1, 1), (1, 12), (2, 5), (3, 26)])
def test_demonstrations_verify_and_replay(digits, steps):
  task = Chain(digits=digits, steps=steps)
  examples = task.sample(np.random.default_rng(1), 200, "train")
  demos = [task.demonstration(e) for e in examples]
  for e, d in zip(examples, demos):
    totals = _replay(e.prompt)
    assert len(totals) == steps + 1 and all(0 <= t < 10**(digits + 1) for t in totals)
    assert int(e.answer) == totals[-1] and len(e.answer) == digits + 1
    assert task.is_correct(e, d) and task.reward(e, d) == 1.0 and task.format_ok(d)
    assert task.step_errors(e, d) == 0 and len(d) == task.solution_chars()
    assert len(e.prompt) == task.prompt_chars()
  rewards, correct, _ = task.score_batch(examples, demos)
  assert rewards.tolist() == [1.0] * 200 and correct.all()


def test_sampling_is_deterministic():
  task = Chain(digits=1, steps=6)
  a = task.sample(np.random.default_rng(7), 50, "heldout")
  assert a == task.sample(np.random.default_rng(7), 50, "heldout")
  assert a != task.sample(np.random.default_rng(8), 50, "heldout")


def test_splits_are_disjoint():
  # steps=1: about 1,700 distinct problems, so both samples repeat problems and would
  # overlap if membership depended on the draw.
  task = Chain(digits=1, steps=1)
  train = task.sample(np.random.default_rng(3), 3000, "train")
  held = task.sample(np.random.default_rng(4), 600, "heldout")
  assert not {e.prompt for e in train} & {e.prompt for e in held}
  assert {task.split_of(e) for e in train} == {"train"}
  assert {task.split_of(e) for e in held} == {"heldout"}
  many = Chain(digits=1, steps=8)
  rng = np.random.default_rng(6)
  frac = np.mean([many.is_heldout(many._draw(rng).prompt) for _ in range(4000)])
  assert 0.08 < frac < 0.12


def test_wrong_final_answer_scores_zero():
  task = Chain(digits=1, steps=3)
  ex = task.example(17, [("+", 5), ("-", 3), ("+", 8)])
  steps = "a:17+5=22;b:22-3=19;c:19+8=27;"
  assert task.reward(ex, steps + "#27") == 1.0
  assert task.reward(ex, " " + steps + "#27\n") == 1.0       # outer whitespace ignored
  for wrong in (steps + "#28", steps + "#7", steps + "#027", steps + "#27#27",
                steps, "", "#2 7", steps.replace("22", "23") + "#28"):
    assert task.reward(ex, wrong) == 0.0 and not task.is_correct(ex, wrong), wrong
  # Only the answer is verified: wrong work with the right answer is correct, and shows
  # up in step_errors.
  assert task.is_correct(ex, "a:17+5=23;b:23-3=20;c:20+8=27;#27")
  assert task.step_errors(ex, "a:17+5=23;b:23-3=20;c:20+8=27;#27") == 3
  assert task.step_errors(ex, "#27") is None
  partial = Chain(digits=1, steps=3, format_reward=0.1)
  assert partial.reward(ex, steps + "#28") == 0.1            # well formed, wrong answer
  assert partial.reward(ex, steps + "#28 oops") == 0.0       # malformed


def test_lengths_follow_task_steps():
  lengths = {}
  for digits, steps in [(1, 5), (1, 12), (1, 26), (2, 23)]:
    task = Chain(digits=digits, steps=steps)
    tok = _tokenizer(task)
    examples = task.sample(np.random.default_rng(2), 20, "train")
    n = [len(tok.encode(task.demonstration(e))) for e in examples]
    lengths[digits, steps] = (min(n), max(n))
    assert max(n) <= task.solution_chars()             # merges only shorten
    assert min(n) >= task.solution_digits()            # every digit is one token
  assert 50 <= lengths[1, 5][0] and lengths[1, 5][1] <= 60
  assert 115 <= lengths[1, 12][0] and lengths[1, 12][1] <= 125
  assert lengths[1, 5][1] < lengths[1, 12][0] <= lengths[1, 12][1] < lengths[1, 26][0]
  assert 255 <= lengths[1, 26][0] and lengths[2, 23][1] <= 305 and 290 <= lengths[2, 23][0]


def test_bad_task_settings_are_refused():
  for kwargs, field in [({"steps": 0}, "steps"), ({"steps": 27}, "steps"),
                        ({"steps": True}, "steps"), ({"digits": 4}, "digits")]:
    with pytest.raises(ValueError, match=f"Chain: {field} must be an int"):
      Chain(**kwargs)
  wide = RolloutConfig(max_new_tokens=400, max_prompt_len=100)
  with pytest.raises(ValueError, match=r"task.name='chain' needs task.steps in \[1, 26\] \(one "
                                       r"letter per operation\); got 30"):
    TrainConfig(task=TaskConfig(name="chain", steps=30), rollout=wide)
  with pytest.raises(ValueError, match=r"task.name='chain' needs task.digits in \[1, 3\]; got 5"):
    TrainConfig(task=TaskConfig(name="chain", digits=5), rollout=wide)
  with pytest.raises(ValueError,
                     match="task.steps applies to task.name='chain'; task.name is 'addition'"):
    TrainConfig(task=TaskConfig(name="addition", steps=5))


def test_solutions_that_cannot_fit_are_refused_at_config_time():
  ok = RolloutConfig(max_new_tokens=130, max_prompt_len=48)
  TrainConfig(task=TaskConfig(name="chain", digits=1, steps=12), rollout=ok)
  # 12 steps hold 62 digits: fewer than 63 new tokens can never fit (digits are split).
  with pytest.raises(ValueError, match=r"needs rollout.max_new_tokens >= 63 .* got "
                                       r"rollout.max_new_tokens=62"):
    TrainConfig(task=TaskConfig(name="chain", digits=1, steps=12),
                rollout=dataclasses.replace(ok, max_new_tokens=62))
  with pytest.raises(ValueError, match=r"needs rollout.max_prompt_len >= 15 .* got "
                                       r"rollout.max_prompt_len=14"):
    TrainConfig(task=TaskConfig(name="chain", digits=1, steps=12),
                rollout=dataclasses.replace(ok, max_prompt_len=14))


def test_check_fits_is_exact_under_the_tokenizer():
  task = Chain(digits=1, steps=5)
  tok = _tokenizer(task)
  sol, prompt = task.check_fits(tok, 200, 200)
  assert sol == max(len(tok.encode(task.demonstration(e))) + 1
                    for e in task.sample(np.random.default_rng(0), 256, "train"))
  assert task.check_fits(tok, sol, prompt) == (sol, prompt)
  with pytest.raises(ValueError, match=rf"up to {sol} tokens \(EOS included\) > "
                                       rf"rollout.max_new_tokens={sol - 1}"):
    task.check_fits(tok, sol - 1, prompt)
  with pytest.raises(ValueError, match=rf"up to {prompt} tokens > rollout.max_prompt_len="
                                       rf"{prompt - 1}"):
    task.check_fits(tok, sol, prompt - 1)


def test_setup_refuses_a_rollout_too_short_before_any_work(tmp_path):
  # Passes the config's digit-count bound (18) but not the tokenizer's exact count (~58):
  # setup stops once the tokenizer exists, before the model or the programs are built.
  cfg = TrainConfig(task=TaskConfig(name="chain", digits=1, steps=5),
                    rollout=RolloutConfig(max_new_tokens=40, max_prompt_len=24))
  with pytest.raises(ValueError, match=r"> rollout.max_new_tokens=40; raise "
                                       r"rollout.max_new_tokens or lower task.steps"):
    run_lib.setup(cfg, str(tmp_path))
  # A refused start leaves the run directory as it was: no tokenizer for the next start.
  assert not (tmp_path / "tokenizer.model").exists()
