"""Single-turn rollouts (gspo_jax/train/collect.py): Groups answers evaluation prompts with the
greedy program, or with n samples drawn like the rollout's."""

import argparse
import dataclasses

from gspo_jax import config as C
from gspo_jax.train import programs
from gspo_jax.train.collect import Groups


def test_groups_respond_greedily_or_with_n_samples_like_the_rollout():
  out = argparse.Namespace(tokens_BxGxT="tokens", mask_BxGxT="mask")
  calls = []

  def make_sampler(scfg):
    calls.append(scfg)
    return lambda *args: out

  tok = argparse.Namespace(eos_id=1, pad_id=0, vocab_size=32)
  cfg = C.TrainConfig(rollout=C.RolloutConfig(group_size=4, temperature=0.7, top_k=5))
  run = argparse.Namespace(tok=tok, cfg=cfg, programs=argparse.Namespace(
      greedy=lambda *args: calls.append(("greedy", args)) or out, make_sampler=make_sampler))
  respond = Groups().responder(run)
  assert respond("params", "prompts", "lens", "key", ["example"]) == ("tokens", "mask")
  assert calls == [("greedy", ("params", "prompts", "lens", "key"))]
  calls.clear()
  respond = Groups().responder(run, n=3)
  rollout_cfg, _ = programs.sampler_configs(tok, cfg)
  assert calls == [dataclasses.replace(rollout_cfg, group_size=3)]
  assert respond("params", "prompts", "lens", "key", ["example"]) == ("tokens", "mask")
