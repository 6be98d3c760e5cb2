"""The training loop's phase times (gspo_jax/train/loop.py `iterate`, gspo_jax/train/collect.py):
time_sample is the sampler's own time, not the previous update's tail, and
sample_tokens_per_s divides by it; with profile_phases every phase is timed alone and the
phases fit inside the iteration."""

import dataclasses
import time

import jax
import numpy as np
import pytest

from gspo_jax import config as C
from gspo_jax.train import loop as T
from gspo_jax.train import run as R
from tests.helpers import tiny_cfg

SLOW_S = 3.0   # the delayed update's tail


def collected(run, iterations):
  out = {}
  T.iterate(run, 0, iterations, on_metrics=lambda step, m: out.__setitem__(step, m))
  return out


def slowed(run, seconds, monkeypatch):
  """`run` whose every update has a tail of `seconds`: the first wait for its new state
  (or its parameters) takes that long, as waiting for a large model's update does. (XLA:CPU
  may run a small program inline at dispatch, so a real delay inside a program would not
  reliably become a tail; the wait is simulated where the host waits.)"""
  pending = []
  real = jax.block_until_ready

  def block_until_ready(x):
    for p in list(pending):
      if x is p or getattr(x, "params", None) is p:
        pending.remove(p)
        time.sleep(seconds)
    return real(x)

  monkeypatch.setattr(jax, "block_until_ready", block_until_ready)
  update = run.programs.update

  def slow_update(state, batch, rewards):
    state, metrics = update(state, batch, rewards)
    pending.append(state.params)
    return state, metrics
  return dataclasses.replace(run, programs=dataclasses.replace(run.programs, update=slow_update))


@pytest.fixture(scope="module")
def setup_run(tmp_path_factory):
  def make(**kw):
    cfg = tiny_cfg(sft=C.SFTConfig(steps=0), **kw)
    return R.setup(cfg, str(tmp_path_factory.mktemp("run")))
  return make


def test_time_sample_leaves_out_the_previous_updates_tail(setup_run, monkeypatch):
  """The second iteration's sampler comes after an update that ends SLOW_S seconds late:
  the iteration takes that long, its time_sample does not."""
  m = collected(slowed(setup_run(), SLOW_S, monkeypatch), 2)[2]
  assert m["time_iteration"] > SLOW_S
  # Holding the tail would make it longer than SLOW_S; the sampling itself took up to 1.8 s
  # with the machine's 2 cores shared by 4 busy processes, so no tighter bound.
  assert m["time_sample"] < SLOW_S
  np.testing.assert_allclose(m["sample_tokens_per_s"], m["response_tokens"] / m["time_sample"])
  assert "time_update" not in m and "time_prepare" not in m   # only when asked


def test_profiled_phases_are_disjoint_parts_of_the_iteration(setup_run, monkeypatch):
  """With profile_phases the update's time is its own (it holds the slow tail), and
  sample + prepare + score + update fit in the iteration."""
  metrics = collected(slowed(setup_run(profile_phases=True), SLOW_S, monkeypatch), 2)
  for step, m in metrics.items():
    phases = [m[k] for k in ("time_sample", "time_prepare", "time_score", "time_update")]
    assert all(p > 0 for p in phases), m
    assert sum(phases) <= m["time_iteration"], (step, phases, m["time_iteration"])
    assert m["time_update"] > SLOW_S and m["time_sample"] < SLOW_S
