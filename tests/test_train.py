"""The GSPO training loop on a tiny config: one iteration of each loss, the on-policy
equivalence of the three losses, resume = uninterrupted, config round trip, bad input."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import configlib
from gspo_jax import train as T
from gspo_jax.models.config import tiny


def tiny_cfg(**kw) -> T.TrainConfig:
  base = dict(
      model=tiny(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16),
      rollout=T.RolloutConfig(prompts_per_iter=4, group_size=4, max_new_tokens=4, max_prompt_len=8),
      sft=T.SFTConfig(steps=30, batch_size=32, learning_rate=3e-3),
      optim=T.OptimConfig(learning_rate=1e-3),
      iterations=2, eval_every=0, eval_size=16, num_minibatches=2)
  return T.TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return T.setup(tiny_cfg(), str(tmp_path_factory.mktemp("run")))


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("loss,eps", [("gspo", (3e-4, 4e-4)), ("gspo_token", (3e-4, 4e-4)),
                                      ("grpo", (0.2, 0.27))])
def test_one_iteration_of_each_loss(run, loss, eps):
  cfg = tiny_cfg(loss=loss, eps_low=eps[0], eps_high=eps[1])
  state = run.state
  before = leaves(state.params)
  batch, stats = T.rollout_step(state, run.graphdef, run.task, run.tok, cfg)
  # An untrained model earns reward 0 everywhere (advantages 0, no gradient): give the
  # rows advantages so the update has something to do.
  batch = batch.replace(adv_R=jnp.asarray(np.random.default_rng(0).normal(size=batch.adv_R.shape),
                                          jnp.float32))
  state = jax.tree.map(jnp.copy, state)  # the update donates its input
  new, m = T._update_jit(state, batch, run.graphdef, run.tx, cfg)
  assert int(new.step) == 1
  assert all(np.isfinite(float(v)) for v in m.values()) and all(np.isfinite(v) for v in stats.values())
  assert any(np.any(a != b) for a, b in zip(before, leaves(new.params)))
  assert float(m["skipped_updates"]) == 0
  # Old log-probs recomputed by the trainer equal the sampler's (same policy, same tokens).
  sampler_cfg = dataclasses.replace(cfg, old_logp="sampler")
  batch2, _ = T.rollout_step(run.state, run.graphdef, run.task, run.tok, sampler_cfg)
  np.testing.assert_array_equal(batch2.tokens_RxT, batch.tokens_RxT)
  np.testing.assert_allclose(batch2.old_logp_RxT, batch.old_logp_RxT, rtol=1e-5, atol=1e-5)


def test_on_policy_single_minibatch_losses_give_the_same_update(run):
  # One minibatch, old = current policy: GSPO, GSPO-token and GRPO share loss and gradient.
  results = []
  for loss in ("gspo", "gspo_token", "grpo"):
    cfg = tiny_cfg(loss=loss, num_minibatches=1)
    batch, _ = T.rollout_step(run.state, run.graphdef, run.task, run.tok, cfg)
    batch = batch.replace(adv_R=jnp.asarray(
        np.random.default_rng(1).normal(size=batch.adv_R.shape), jnp.float32))
    new, m = T._update_jit(jax.tree.map(jnp.copy, run.state), batch, run.graphdef, run.tx, cfg)
    results.append((leaves(new.params), float(m["loss"])))
  for params, loss in results[1:]:
    assert abs(loss - results[0][1]) < 1e-6
    for a, b in zip(params, results[0][0]):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_non_finite_gradient_skips_the_update(run):
  cfg = tiny_cfg()
  batch, _ = T.rollout_step(run.state, run.graphdef, run.task, run.tok, cfg)
  bad = batch.replace(adv_R=batch.adv_R.at[0].set(jnp.nan))
  new, m = T._update_jit(jax.tree.map(jnp.copy, run.state), bad, run.graphdef, run.tx, cfg)
  # The minibatch holding row 0 is skipped (params of that step unchanged); others apply.
  assert float(m["skipped_updates"]) >= 1
  assert all(np.all(np.isfinite(x)) for x in leaves(new.params))


def test_resume_equals_uninterrupted(tmp_path, capsys):
  cfg = tiny_cfg(iterations=4)
  full = T.train(cfg, str(tmp_path / "full"), checkpoint_every=2, progress=False)
  # Interrupted after step 2 (its checkpoint), then resumed to 4.
  part = str(tmp_path / "part")
  T.train(dataclasses.replace(cfg, iterations=2), part, checkpoint_every=2, progress=False)
  T.train(cfg, part, resume=True, checkpoint_every=2, progress=False)
  read = lambda d: [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
  a, b = read(str(tmp_path / "full")), read(part)
  assert [r["step"] for r in b] == [1, 2, 3, 4]
  for ra, rb in zip(a, b):
    for k in ("reward_mean", "loss", "grad_norm", "clip_frac_token", "ratio_max"):
      assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["step"], k)
  assert full["heldout_accuracy_end"] >= 0.0
  # The evaluation command reads the run back (config, tokenizer, newest checkpoint).
  from gspo_jax import evaluate
  evaluate.main(["--run", str(tmp_path / "full"), "--size", "8"])
  assert "step 4: held-out accuracy" in capsys.readouterr().out


def test_existing_run_without_resume_is_refused(tmp_path):
  cfg = tiny_cfg(iterations=1, sft=T.SFTConfig(steps=1))
  T.train(cfg, str(tmp_path), progress=False)
  with pytest.raises(ValueError, match="--resume"):
    T.train(cfg, str(tmp_path), progress=False)


def test_config_round_trip_and_overrides():
  cfg = tiny_cfg(loss="grpo", eps_low=0.2, eps_high=0.27)
  back = configlib.from_dict(T.TrainConfig, json.loads(json.dumps(configlib.to_dict(cfg))))
  assert back == cfg
  changed = configlib.apply_overrides(cfg, ["rollout.group_size=8", "model.qk_norm=false",
                                            "optim.learning_rate=3e-4"])
  assert changed.rollout.group_size == 8 and not changed.model.qk_norm
  with pytest.raises(configlib.ConfigError, match="rollout.groupsize"):
    configlib.apply_overrides(cfg, ["rollout.groupsize=8"])
  with pytest.raises(configlib.ConfigError, match="loss"):
    configlib.apply_overrides(cfg, ["loss=ppo"])
  with pytest.raises(configlib.ConfigError, match="num_minibatches"):
    configlib.apply_overrides(cfg, ["num_minibatches=3"])


def test_decode_marks_special_tokens(run):
  tok = run.tok
  ids = np.asarray([tok.encode("1") + [tok.bos_id] + tok.encode("22") + [tok.eos_id]])
  text = T.decode_completions(tok, ids, np.ones_like(ids, np.float32))[0]
  assert text == "1\ufffd22" and not run.task.is_correct(run.task.example(10, 12), text)


def test_unwritable_run_dir_fails_before_training(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match="not writable"):
    T.train(tiny_cfg(), str(blocker / "run"), progress=False)
