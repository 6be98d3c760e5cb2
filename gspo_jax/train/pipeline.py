"""The asynchronous rollout pipeline: rollouts sampled up to `asynchronous.max_staleness`
policy versions ahead of the update that uses them, on the trainer's devices or the
sampler's own (`gspo_jax/parallel/placement.py` has the settings; docs/async.md the design).

The training loop (`train.iterate`) asks `Pipeline.rollout(i)` for iteration i's rollout and
then dispatches update i. Before handing rollout i over, the pipeline launches rollout
i + k with the current parameters (version i: i updates done), so with k >= 1 the sampler
(and `prepare` behind it) work on later rollouts while the trainer updates; the host scores
rollout i while the devices run. Rollouts 0..k-1 of a fresh run are sampled by version 0.
With k = 0 and no placement this is `rollout.rollout_step`'s order exactly.

What crosses between the meshes (`placement.sampler_devices` > 0): the parameters, copied
to the sampler's shardings with `jax.device_put` once per launch (bytes and time reported as
`weight_copy_bytes` / `time_weight_copy`), and the prepared batch (or with pi_old="proximal"
the rollout) to the trainer's rows.

Checkpoints: the k rollouts in flight at a checkpoint are finished (waited for and scored)
and saved beside it in `<run>/inflight/<step>.npz`, before the checkpoint itself, so a
resume uses exactly the rollouts the uninterrupted run would have used: none regenerated,
lost or used twice (`save` / `Pipeline(..., run_dir=)`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.parallel import sharding
from gspo_jax.parallel.placement import is_async
from gspo_jax.train import collect as rollout_lib

INFLIGHT = "inflight"


@dataclasses.dataclass
class SamplerSide:
  """The sampler's own devices: their layout and the programs compiled for them."""
  layout: object       # programs.Layout over the sampler mesh
  programs: object     # programs.Programs (sample and prepare are used)


class Ready:
  """When device arrays became ready (host perf_counter), seen by a thread that waits for
  them, so the loop itself never blocks. Only arrays nothing donates are waited for."""

  def __init__(self, arrays):
    self.time = None
    self._thread = threading.Thread(target=self._wait, args=(arrays,), daemon=True)
    self._thread.start()

  def _wait(self, arrays):
    jax.block_until_ready(arrays)
    self.time = time.perf_counter()

  def get(self) -> float:
    self._thread.join()
    return self.time


@dataclasses.dataclass
class _Item:
  """One rollout in the pipeline: launched, and once scored, its `result`."""
  step: int
  version: int
  launched: rollout_lib.Launched | None
  result: rollout_lib.RolloutResult | None = None
  sampled: Ready | None = None     # the sampler's device statistics ready
  start: float = 0.0               # when it was dispatched
  copy: dict | None = None         # the weight copy's bytes and timing
  # pi_old="proximal": (rollout, prompts_BxP, lens_B), which the trainer prepares
  rows: tuple | None = None


class Pipeline:
  """Rollouts for iterations start, start+1, ... (see the module docstring)."""

  def __init__(self, run, start: int, ref_params=None, *, run_dir: str | None = None,
               log=print):
    cfg = run.cfg
    self.run, self.ref_params, self.log = run, ref_params, log
    self.k = cfg.asynchronous.max_staleness
    self.side = getattr(run, "sampler", None)
    self.proximal = cfg.asynchronous.pi_old == "proximal"
    self.sync = not is_async(cfg)
    self.pending: collections.deque[_Item] = collections.deque()
    self._later: list = []   # updates dispatched whose end is not yet known
    self.version_ready = {start: time.perf_counter()}   # version -> when its params were
    self.timeline: list[dict] = []
    self.t0 = time.perf_counter()
    self.timeline_path = (os.path.join(run_dir, "timeline.jsonl")
                          if run_dir and cfg.asynchronous.timeline else None)
    self.sampler_ref = ref_params
    if self.side is not None and ref_params is not None and not self.proximal:
      self.sampler_ref = jax.device_put(ref_params, self.side.layout.state.params)
    if self.k and start > 0:
      self.pending.extend(load_inflight(run, run_dir, start, self.proximal))
    elif self.k:
      for j in range(start, start + self.k):   # a fresh run: sampled by the start version
        self.pending.append(self._launch(j, start))

  def _launch(self, step: int, version: int) -> _Item:
    run, side = self.run, self.side
    params, key, copy = run.state.params, run.state.key, None
    t = time.perf_counter()
    if side is not None:  # the parameters, copied to the sampler's shardings
      # From a copy on the trainer (one more copy of the parameters there, briefly): the
      # next update donates `params`, and the transfer must not depend on the runtime
      # keeping a donated buffer alive until a copy to other devices has read it.
      params = jax.device_put(jax.tree.map(jnp.copy, params), side.layout.state.params)
      key = jax.device_put(key, side.layout.replicated)
      nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
      copied = Ready(params)
      if run.cfg.profile_phases:
        copied.get()
      copy = {"bytes": nbytes, "dispatch": t, "ready": copied}
    launched = rollout_lib.launch(
        run, params, key, step, self.sampler_ref if not self.proximal else None,
        programs=side.programs if side is not None else None,
        mesh=side.layout.mesh if side is not None else None,
        prepare=not self.proximal, wait=self.sync)
    return _Item(step, version, launched, sampled=Ready(launched.device_stats), start=t,
                 copy=copy)

  def rollout(self, it: int) -> rollout_lib.RolloutResult:
    """Iteration `it`'s rollout (its batch on the trainer's mesh), after launching rollout
    it + k with the current parameters (version `it`)."""
    if self.sync:  # today's loop, to the bit
      return rollout_lib.rollout_step(self.run, self.run.state.params, self.run.state.key, it,
                                      self.ref_params, log=self.log)
    self.pending.append(self._launch(it + self.k, it))
    item = self.pending.popleft()
    assert item.step == it, (item.step, it)
    self._finish(item)
    r = item.result
    batch = r.batch
    mesh = self.run.layout.mesh
    if self.proximal:  # pi_old at the trainer's version, just before the update
      rows = jax.device_put(item.rows, sharding.by_rank(item.rows, mesh))
      batch = self.run.programs.prepare(self.run.state.params, self.ref_params, *rows)
    elif self.side is not None:
      batch = jax.device_put(batch, sharding.by_rank(batch, mesh))
    stats = {**r.stats, "policy_version": float(item.version),
             "staleness": float(it - item.version)}
    if item.copy is not None:
      stats["weight_copy_bytes"] = float(item.copy["bytes"])
      stats["time_weight_copy"] = item.copy["time"]
    return dataclasses.replace(r, batch=batch, stats=stats)

  def _finish(self, item: _Item) -> None:
    """Wait for the item's tokens and score them (once)."""
    if item.result is not None:
      return
    t = time.perf_counter()
    r = rollout_lib.finish(self.run, item.launched, log=self.log,
                           rows_mesh=self.run.layout.mesh)
    sampled = item.sampled.get()
    self._flush(final=False)
    # A device phase starts at the later of its dispatch and its inputs' readiness (the
    # version's parameters, then their copy); the waiting threads wake in any order, so
    # every start is kept at or before its end.
    inputs = max(item.start, self.version_ready.get(item.version) or item.start)
    if item.copy is not None:
      copied = item.copy["ready"].get()
      inputs = min(inputs, copied)
      item.copy["time"] = copied - inputs
      self._event(item.step, "weight_copy", inputs, copied)
      inputs = copied
    inputs = min(inputs, sampled)
    if "time_sample" not in item.launched.phases:
      r.stats["time_sample"] = sampled - inputs
    self._event(item.step, "sample", inputs, sampled)
    self._event(item.step, "score", max(t, sampled), time.perf_counter())
    item.result = r
    if self.proximal:
      L = item.launched
      item.rows = (L.rollout, L.prompts_BxP, L.lens_B)

  def updated(self, it: int, update_metrics, dispatched: float) -> None:
    """Update `it` was dispatched at `dispatched`: version it + 1 is ready when its metrics
    are (seen by a waiting thread), which the next launches' timings start from."""
    if self.sync:
      return
    ready = Ready(update_metrics)
    self._later.append((it, dispatched, ready))
    self.version_ready[it + 1] = None   # filled in by `_flush` once known
    self._flush(final=False)

  def _flush(self, final: bool) -> None:
    keep = []
    for it, dispatched, ready in self._later:
      if final or ready.time is not None:
        end = ready.get()
        self.version_ready[it + 1] = end
        self._event(it, "update", dispatched, end)
      else:
        keep.append((it, dispatched, ready))
    self._later = keep
    self._write()

  def _event(self, it: int, phase: str, start: float, end: float) -> None:
    if self.timeline_path is not None:
      self.timeline.append({"iteration": it, "phase": phase, "start": start - self.t0,
                            "end": end - self.t0})

  def _write(self) -> None:
    if self.timeline_path is None or not self.timeline or jax.process_index():
      return
    with open(self.timeline_path, "a") as f:
      for e in self.timeline:
        f.write(json.dumps(e) + "\n")
    self.timeline = []

  def close(self) -> None:
    self._flush(final=True)

  def save(self, run_dir: str, step: int) -> None:
    """Finish the rollouts in flight at checkpoint `step` and write them (atomically)
    to <run>/inflight/<step>.npz; called before the checkpoint itself is saved."""
    if not self.k:
      return
    for item in self.pending:
      self._finish(item)
    save_inflight(run_dir, step, list(self.pending), self.proximal)


def _payload(item: _Item, proximal: bool):
  r = item.result
  return ((*item.rows, r.rewards_BxG, r.device_stats) if proximal
          else (r.batch, r.rewards_BxG, r.device_stats))


def _template(run, proximal: bool):
  """The abstract payload of one rollout in flight, from the run's own programs."""
  cfg = run.cfg
  B, P, G = cfg.rollout.sampled_prompts, cfg.rollout.max_prompt_len, cfg.rollout.group_size
  prompts = jax.ShapeDtypeStruct((B, P), jnp.int32)
  lens = jax.ShapeDtypeStruct((B,), jnp.int32)
  params = run.layout.params
  rollout, stats = jax.eval_shape(run.programs.sample, params, prompts, lens, run.state.key, 0)
  rewards = jax.ShapeDtypeStruct((B, G), jnp.float32)
  if proximal:
    return (rollout, prompts, lens, rewards, stats)
  ref = params if cfg.loss.kl_coef else None
  batch = jax.eval_shape(run.programs.prepare, params, ref, rollout, prompts, lens)
  return (batch, rewards, stats)


def inflight_path(run_dir: str, step: int) -> str:
  return os.path.join(run_dir, INFLIGHT, f"{step}.npz")


def save_inflight(run_dir: str, step: int, items: list[_Item], proximal: bool) -> None:
  """Write the finished rollouts in flight at `step` (temporary file, then rename)."""
  if jax.process_index():
    return
  arrays, meta = {}, []
  for n, item in enumerate(items):
    leaves = jax.tree_util.tree_flatten_with_path(_payload(item, proximal))[0]
    arrays.update({f"{n}{jax.tree_util.keystr(p)}": np.asarray(x) for p, x in leaves})
    meta.append({"step": item.step, "version": item.version,
                 "stats": {k: float(v) for k, v in item.result.stats.items()}})
  arrays["meta"] = np.asarray(json.dumps(meta))
  path = inflight_path(run_dir, step)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "wb") as f:
    np.savez(f, **arrays)
  os.replace(path + ".tmp", path)


def prune_inflight(run_dir: str) -> None:
  """Remove the rollouts saved with checkpoints that no longer exist (after a save)."""
  from gspo_jax.train.checkpoint import complete_steps
  folder = os.path.join(run_dir, INFLIGHT)
  if jax.process_index() or not os.path.isdir(folder):
    return
  kept = set(complete_steps(os.path.join(run_dir, "checkpoints")))
  for name in os.listdir(folder):
    stem = name.split(".")[0]
    if stem.isdigit() and int(stem) not in kept:
      os.remove(os.path.join(folder, name))


def load_inflight(run, run_dir: str | None, step: int, proximal: bool) -> list[_Item]:
  """The rollouts saved in flight with checkpoint `step`, on the trainer's mesh; a
  ValueError naming the step and the file when they are missing or do not fit this run."""
  path = inflight_path(run_dir or "", step)
  k = run.cfg.asynchronous.max_staleness
  if not run_dir or not os.path.exists(path):
    raise ValueError(f"checkpoint step {step}: no rollouts in flight saved with it ({path}); "
                     f"an asynchronous run (asynchronous.max_staleness={k}) resumes only "
                     "from checkpoints it saved itself")
  template = _template(run, proximal)
  paths, treedef = jax.tree_util.tree_flatten_with_path(template)
  mesh = run.layout.mesh
  with np.load(path) as f:
    meta = json.loads(str(f["meta"]))
    if len(meta) != k or [m["step"] for m in meta] != list(range(step, step + k)):
      raise ValueError(f"checkpoint step {step}: {path} holds the rollouts of steps "
                       f"{[m['step'] for m in meta]}, not {list(range(step, step + k))} "
                       f"(asynchronous.max_staleness={k})")
    items = []
    for n, m in enumerate(meta):
      leaves = []
      for p, shape in paths:
        x = f[f"{n}{jax.tree_util.keystr(p)}"]
        if x.shape != shape.shape:
          raise ValueError(f"checkpoint step {step}: {path} {jax.tree_util.keystr(p)} has "
                           f"shape {x.shape}, this run's is {shape.shape}")
        leaves.append(x.astype(shape.dtype))
      payload = jax.tree_util.tree_unflatten(treedef, leaves)
      payload = jax.device_put(payload, sharding.by_rank(payload, mesh))
      *rows, rewards, stats = payload
      batch = None if proximal else rows[0]
      result = rollout_lib.RolloutResult(batch, rewards, m["stats"], stats)
      items.append(_Item(m["step"], m["version"], None, result,
                         rows=tuple(rows) if proximal else None))
  return items
