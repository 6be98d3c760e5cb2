"""The fused iteration (sample -> token-id reward -> advantages -> update in one program):
its reward agrees with the task's text reward, and one fused iteration equals one phased
iteration of the training loop (`rollout.rollout_step`, then the update program) from the
same state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.config import OptimConfig, RolloutConfig, SFTConfig, TrainConfig
from gspo_jax.models.config import tiny
from gspo_jax.parallel import sharding
from gspo_jax.tasks import text
from gspo_jax.train import fused
from gspo_jax.train.collect import rollout_step
from gspo_jax.train.run import setup
from tests import adam_bounds


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  cfg = TrainConfig(
      model=tiny(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16),
      rollout=RolloutConfig(prompts_per_iter=4, group_size=4, max_new_tokens=4, max_prompt_len=8),
      sft=SFTConfig(steps=0), optim=OptimConfig(learning_rate=1e-3), num_minibatches=2,
      mesh=sharding.MeshConfig(num_devices=1))
  return setup(cfg, str(tmp_path_factory.mktemp("fused")))


def test_token_reward_agrees_with_the_text_reward(run):
  tok, task = run.tok, run.task
  examples = [task.example(37, 85), task.example(3, 4)]
  answer, answer_lens = text.encode_answers(tok, [ex.answer for ex in examples], 4)
  eos, pad = tok.eos_id, tok.pad_id
  right = lambda ex: tok.encode(ex.answer) + [eos]
  wrong = lambda ex: tok.encode(str(int(ex.answer) + 1)) + [eos]
  rows = [[right(ex), wrong(ex), tok.encode(ex.answer) + tok.encode("1"),  # no EOS
           tok.encode(ex.answer[:-1]) + [eos]] for ex in examples]           # cut short
  tokens = np.full((2, 4, 4), pad, np.int32)
  mask = np.zeros((2, 4, 4), np.float32)
  for b, group in enumerate(rows):
    for g, r in enumerate(group):
      r = r[:4]
      tokens[b, g, :len(r)] = r
      mask[b, g, :len(r) if eos not in r else r.index(eos) + 1] = 1
  texts = text.decode_completions(tok, tokens.reshape(8, 4), mask.reshape(8, 4))
  want = np.array([task.reward(examples[i // 4], t) for i, t in enumerate(texts)]).reshape(2, 4)
  got = fused.exact_match_reward(jnp.asarray(tokens), jnp.asarray(answer),
                                 jnp.asarray(answer_lens), eos)
  np.testing.assert_array_equal(got, want)
  assert want[:, 0].tolist() == [1.0, 1.0] and want[:, 1:].sum() == 0


def test_one_fused_iteration_equals_one_phased_iteration(run):
  state = jax.tree.map(jnp.copy, run.state)
  r = rollout_step(run, state.params, state.key, 0)
  phased, _ = run.programs.update(jax.tree.map(jnp.copy, state), r.batch, r.rewards_BxG)
  # rollout_step's examples for step 0.
  examples = run.task.train_batch(run.cfg.seed, 0, run.cfg.rollout.prompts_per_iter)
  prompts, lens = run.encode_prompts([e.prompt for e in examples])
  answer, answer_lens = text.encode_answers(run.tok, [e.answer for e in examples],
                                            run.cfg.rollout.max_new_tokens)
  new_state, metrics = fused.make_fused_iteration(run)(state, prompts, lens, answer, answer_lens)
  assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss"]))
  np.testing.assert_allclose(float(metrics["reward_mean"]), r.stats["reward_mean"], atol=1e-6)
  # One compiled program against another: float32 rounding, which Adam's g / sqrt(v) turns
  # into up to ~2 lr per step where a gradient is ~0 (adam_bounds).
  adam_bounds.assert_steps_close(jax.tree.leaves(jax.device_get(new_state.params)),
                                 jax.tree.leaves(jax.device_get(phased.params)),
                                 run.cfg.optim.learning_rate, steps=run.cfg.num_minibatches,
                                 rtol=1e-5, atol=1e-6)
