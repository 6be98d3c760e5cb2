"""Live-row compaction (`SamplerConfig.compact_rows`, gspo_jax/rollout/compaction.py): the same
rollout as the uncompacted sampler for the same key, with dense and MoE models, spread
lengths and the edge cases; the default program builds no stages; bad values are named.

One compiled pair (off, on) per model: the length regimes come from the parameters (an
EOS "knob", see `eos_knob`), which are inputs of the compiled sampler, not from configs.
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import config
from gspo_jax.config import TrainConfig
from gspo_jax.models import config as model_config
from gspo_jax.models import transformer
from gspo_jax.rollout import compaction, sampling
from gspo_jax.rollout.sampling import SamplerConfig, sample_groups
from gspo_jax.train import programs

EOS = 1
# T = 8 in two decode phases (4, 8); B*G = 12 rows in stages of 6 and 3.
CFG = SamplerConfig(group_size=4, max_new_tokens=8, eos_id=EOS, pad_id=2, max_prompt_len=8,
                    decode_window=4, vocab_limit=16)


def eos_knob(model, c: float):
  """A copy of `model` whose EOS logit gets c * (a positive feature) added.

  Residual dimension 0 holds a constant: every embedding has 0.05 there and no layer writes
  to it; the final norm passes it on (positive) and the unembedding reads it only into EOS.
  Its logit share is about 0.035 c here: c >> 0 ends every row at once, c << 0 none, c
  around 50 spreads the lengths over T = 8, c = 0 leaves the model's own lengths.
  """
  model = nnx.clone(model)
  model.embed[...] = model.embed[...].at[:, 0].set(0.05)
  # Attention output and (expert) MLP down projections; scanned layers are one stacked Block.
  for layer in ([model.layers] if model.cfg.scan_layers else model.layers):
    layer.attn.o[...] = layer.attn.o[...].at[..., 0].set(0.0)
    layer.mlp.down[...] = layer.mlp.down[...].at[..., 0].set(0.0)
  model.final_norm.weight[...] = model.final_norm.weight[...].at[0].set(1.0)
  model.lm_head[...] = model.lm_head[...].at[0].set(0.0).at[0, EOS].set(c)
  return model


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  p = rng.integers(3, 16, (3, 6)).astype(np.int32)
  lens = np.array([6, 2, 4], np.int32)
  p[np.arange(6)[None, :] >= lens[:, None]] = 0
  return jnp.asarray(p), jnp.asarray(lens)


def assert_same_rollout(off, on, experts: bool):
  for f in ("tokens_BxGxT", "mask_BxGxT", "lengths_BxG", "eos_BxG", "truncated_BxG", "steps"):
    np.testing.assert_array_equal(np.asarray(getattr(on, f)), np.asarray(getattr(off, f)), f)
  # Equal to float32 rounding, not bit for bit: XLA:CPU compiles the decode step at N rows
  # into kernels whose rounding can differ from the B x G step's by ~1e-6.
  for f in ("logp_BxGxT", "entropy_BxGxT"):
    np.testing.assert_allclose(np.asarray(getattr(on, f)), np.asarray(getattr(off, f)),
                               atol=1e-5, rtol=0, err_msg=f)
  if experts:  # every slot a counted log-prob depends on: prompt positions and slots < |y| - 1
    P = off.experts[0].shape[1] - CFG.max_new_tokens
    used = np.concatenate([np.ones((12, P), bool), np.arange(CFG.max_new_tokens)[None]
                           < np.asarray(off.lengths_BxG).reshape(12, 1) - 1], axis=1)
    for a, b in zip(off.experts, on.experts):
      np.testing.assert_array_equal(np.asarray(b)[used], np.asarray(a)[used])


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_compacted_rollout_equals_uncompacted(which, prompts):
  """Spread lengths (stages entered in both phases), every row ending in the first step,
  and no row ending, for the same keys: the same rollout with compaction on and off.
  The MoE model scans its layers, so both cache layouts (tuple, stacked) are covered."""
  mcfg = model_config.tiny() if which == "dense" else model_config.tiny_moe(scan_layers=True)
  base = transformer.create(mcfg, seed=3)
  off_cfg = dataclasses.replace(CFG, record_experts=which == "moe")
  on_cfg = dataclasses.replace(off_cfg, compact_rows=2)
  seen = set()
  for c, key in ((0.0, 1), (40.0, 2), (60.0, 3), (1e4, 4), (-1e4, 5)):
    model = eos_knob(base, c)
    off = sample_groups(model, *prompts, jax.random.key(key), off_cfg)
    on = sample_groups(model, *prompts, jax.random.key(key), on_cfg)
    assert_same_rollout(off, on, experts=which == "moe")
    # Every slot after a row's end holds pad_id (2 here, so a 0 written there would show).
    assert np.all(np.asarray(off.tokens_BxGxT)[np.asarray(off.mask_BxGxT) == 0] == CFG.pad_id)
    lengths = np.asarray(off.lengths_BxG)
    ended = np.asarray(off.eos_BxG)
    seen.add("all_first_step" if lengths.max() == 1 else "none_end" if not ended.any()
             else "spread_both_phases" if len(set(lengths[ended].tolist())) > 2
             and lengths.max() > CFG.decode_window else "other")
  # The regimes the test claims to cover did occur.
  assert {"all_first_step", "none_end", "spread_both_phases"} <= seen, seen


def test_all_rows_end_inside_the_first_phase(prompts):
  """Lengths spread inside the first phase only: the later phases start with no live row."""
  base = transformer.create(model_config.tiny(), seed=3)
  model = eos_knob(base, 150.0)
  off = sample_groups(model, *prompts, jax.random.key(6), CFG)
  on = sample_groups(model, *prompts, jax.random.key(6),
                     dataclasses.replace(CFG, compact_rows=2))
  assert_same_rollout(off, on, experts=False)
  lengths = np.asarray(off.lengths_BxG)
  assert lengths.max() <= CFG.decode_window and len(set(lengths.ravel().tolist())) > 1, lengths


def _count(jaxpr, name: str) -> int:
  """Equations of primitive `name` in `jaxpr` and the jaxprs nested in it."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == name
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          n += _count(sub, name)
  return n


def test_default_sampler_builds_no_stages(prompts):
  """compact_rows=0 traces exactly one while loop per decode phase and no cond; L > 0 adds
  L conds and L loops per phase."""
  graphdef, params = nnx.split(transformer.create(model_config.tiny(), seed=3))
  trace = lambda cfg: jax.make_jaxpr(lambda p, x, n, k: sampling.sample(
      graphdef, p, x, n, k, cfg=cfg))(params, *prompts, jax.random.key(0)).jaxpr
  phases = len(sampling.decode_windows(CFG.max_new_tokens, CFG.decode_window))
  for L in (0, 2):
    jaxpr = trace(dataclasses.replace(CFG, compact_rows=L))
    assert (_count(jaxpr, "while"), _count(jaxpr, "cond")) == (phases * (1 + L), phases * L)


def test_bad_compact_rows_are_named():
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="SamplerConfig.compact_rows"):
      dataclasses.replace(CFG, compact_rows=bad)
    with pytest.raises(ValueError, match="rollout.compact_rows"):
      config.RolloutConfig(compact_rows=bad)
  assert compaction.row_sizes(12, 2) == (12, 6, 3) and compaction.row_sizes(10, 3) == (10, 5, 3, 2)
  with pytest.raises(ValueError, match=r"compact_rows=4 \(rollout.compact_rows\).*B\*G = 12"):
    compaction.row_sizes(12, 4)


def test_rollout_compact_rows_reaches_the_rollout_sampler_only():
  tok = argparse.Namespace(eos_id=1, pad_id=0, vocab_size=32)
  cfg = TrainConfig(rollout=config.RolloutConfig(compact_rows=2))
  rollout, greedy = programs.sampler_configs(tok, cfg)
  assert (rollout.compact_rows, greedy.compact_rows) == (2, 0)
