"""The training loop's phase times (gspo_jax/train.py `iterate`, gspo_jax/rollout.py):
time_sample is the sampler's own time, not the previous update's tail, and
sample_tokens_per_s divides by it; with profile_phases every phase is timed alone and the
phases fit inside the iteration."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import config as C
from gspo_jax import run as R
from gspo_jax import train as T
from tests.helpers import tiny_cfg

SLOW_S = 3.0   # the delayed update's tail


def collected(run, iterations):
  out = {}
  T.iterate(run, 0, iterations, on_metrics=lambda step, m: out.__setitem__(step, m))
  return out


def slowed(run, seconds):
  """`run` whose update's parameters become ready `seconds` after the update program is
  dispatched (a host callback inside a program queued behind it): an update with a long
  tail, as a large model's is."""
  def wait():
    time.sleep(seconds)
    return np.float32(0)

  @jax.jit
  def delayed(params):
    zero = jax.pure_callback(wait, jax.ShapeDtypeStruct((), jnp.float32))
    return jax.tree.map(lambda p: p + zero.astype(p.dtype), params)

  update = run.programs.update

  def slow_update(state, batch, rewards):
    state, metrics = update(state, batch, rewards)
    return state.replace(params=delayed(state.params)), metrics
  return dataclasses.replace(run, programs=dataclasses.replace(run.programs, update=slow_update))


@pytest.fixture(scope="module")
def setup_run(tmp_path_factory):
  def make(**kw):
    cfg = tiny_cfg(sft=C.SFTConfig(steps=0), **kw)
    return R.setup(cfg, str(tmp_path_factory.mktemp("run")))
  return make


def test_time_sample_leaves_out_the_previous_updates_tail(setup_run):
  """The second iteration's sampler is queued behind an update that ends SLOW_S seconds
  late: the iteration takes that long, its time_sample does not."""
  m = collected(slowed(setup_run(), SLOW_S), 2)[2]
  assert m["time_iteration"] > SLOW_S
  assert m["time_sample"] < SLOW_S / 2
  np.testing.assert_allclose(m["sample_tokens_per_s"], m["response_tokens"] / m["time_sample"])
  assert "time_update" not in m and "time_prepare" not in m   # only when asked


def test_profiled_phases_are_disjoint_parts_of_the_iteration(setup_run):
  """With profile_phases the update's time is its own (it holds the slow tail), and
  sample + prepare + score + update fit in the iteration."""
  metrics = collected(slowed(setup_run(profile_phases=True), SLOW_S), 2)
  for step, m in metrics.items():
    phases = [m[k] for k in ("time_sample", "time_prepare", "time_score", "time_update")]
    assert all(p > 0 for p in phases), m
    assert sum(phases) <= m["time_iteration"], (step, phases, m["time_iteration"])
    assert m["time_update"] > SLOW_S and m["time_sample"] < SLOW_S / 2
