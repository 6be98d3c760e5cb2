"""Checkpoints with orbax: the TrainState (params, optimiser state, step, RNG key) every N
iterations, keeping the last K. The data stream is a pure function of (seed, step), so the
step is the data-stream position. orbax writes to a temporary directory and renames it when
the save is complete, so a half-written checkpoint is never listed; restore takes the newest
complete one. Saves are synchronous here: an open async save would hang the process at exit.

A checkpoint whose data does not restore (damaged files behind complete metadata) is named
with its step and error; restore falls back to the newest one that does, and sets the
damaged ones aside as `<step>.damaged` (never deleted). If none restores, nothing is moved:
the same error on every step means the template (the config) is wrong, not the data.
"""

from __future__ import annotations

import os
import shutil

import jax
import orbax.checkpoint as ocp

from gspo_jax.parallel import sharding


def check_writable(directory: str) -> None:
  """Fail before training starts if the run directory cannot be written."""
  try:
    os.makedirs(directory, exist_ok=True)
    # One probe per process: hosts sharing the directory must not delete each other's.
    probe = os.path.join(directory, f".write_test.{jax.process_index()}.{os.getpid()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"run directory {directory!r} is not writable: {e}") from e


def set_aside_incomplete(directory: str) -> list[str]:
  """Rename step directories without orbax's metadata file to `<step>.incomplete` (kept, not
  deleted), so that restore never picks a half-written checkpoint. orbax already skips its
  own `*.orbax-checkpoint-tmp-*` directories; this covers a step directory left by a crash
  on a filesystem without atomic rename."""
  moved = []
  if not os.path.isdir(directory):
    return moved
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if name.isdigit() and os.path.isdir(path) and not os.path.exists(
        os.path.join(path, "_CHECKPOINT_METADATA")):
      os.rename(path, _free_name(path + ".incomplete"))
      moved.append(name)
  return moved


def complete_steps(directory: str) -> list[int]:
  """Steps of the complete checkpoints in `directory`, read without writing anything."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit() and os.path.exists(
      os.path.join(directory, n, "_CHECKPOINT_METADATA")))


def check_free_space(directory: str, state, keep: int) -> None:
  """Fail before training if the disk cannot hold `keep` + 1 checkpoints of `state` (the
  newest is written before the oldest is deleted) plus 16 MiB for logs."""
  need = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes")) * (keep + 1)
  need += 16 * 2**20
  free = shutil.disk_usage(directory).free
  if free < need:
    raise ValueError(f"not enough free disk space in {directory!r} for checkpoints: about "
                     f"{need / 2**20:.0f} MiB needed ({keep} kept + 1 being written), "
                     f"{free / 2**20:.0f} MiB free")


class Checkpointer:
  def __init__(self, directory: str, *, every: int, keep: int):
    self.every = every
    self.directory = directory = os.path.abspath(directory)
    if jax.process_index() == 0:
      for step in set_aside_incomplete(directory):
        print(f"checkpoint step {step} in {directory} is incomplete: set aside as "
              f"{step}.incomplete; using the newest complete one")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False,
                                           create=True)
    self.manager = ocp.CheckpointManager(directory, options=options,
                                         item_handlers=ocp.StandardCheckpointHandler())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def due(self, step: int, *, force: bool = False) -> bool:
    """Whether `maybe_save(step, ..., force=force)` saves."""
    return force or bool(self.every and step % self.every == 0)

  def maybe_save(self, step: int, state, *, force: bool = False) -> bool:
    if not self.due(step, force=force):
      return False
    state = jax.tree.map(_to_savable, state)
    return self.manager.save(step, args=ocp.args.StandardSave(state), force=force)

  def restore(self, abstract_state, step: int | None = None):
    """The state saved at `step` (default: the newest; no fallback, see `restore_newest`);
    ValueError naming the step and orbax's error."""
    step = self.latest_step() if step is None else step
    template = jax.tree.map(_to_savable, abstract_state)
    check_shapes(self.manager, step, template, self.directory)
    try:
      restored = self.manager.restore(step, args=ocp.args.StandardRestore(template))
    except Exception as e:  # noqa: BLE001 - orbax / tensorstore raise many kinds
      raise ValueError(f"checkpoint step {step} in {self.directory} does not restore: "
                       f"{type(e).__name__}: {str(e)[:400]}") from e
    return jax.tree.map(_from_savable, abstract_state, restored)

  def restore_newest(self, abstract_state, *, set_aside: bool = True, log=print):
    """(step, state) of the newest checkpoint that restores. Newer ones that do not are
    named (step and error) and, with set_aside, renamed to `<step>.damaged`."""
    failed = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        state = self.restore(abstract_state, step)
      except ValueError as e:
        failed.append((step, e))
        continue
      for bad, e in failed:
        kept = f"; set aside as {bad}.damaged" if set_aside else ""
        log(f"{e}\nusing step {step}, the newest checkpoint that restores{kept}")
      if set_aside and failed:
        if jax.process_index() == 0:
          for bad, _ in failed:
            path = os.path.join(self.directory, str(bad))
            os.rename(path, _free_name(path + ".damaged"))
        sharding.barrier("checkpoint_set_aside")
        self.manager.reload()
      return step, state
    if not failed:
      raise ValueError(f"no complete checkpoint in {self.directory}")
    raise ValueError("no checkpoint restores (nothing was moved):\n" +
                     "\n".join(str(e) for _, e in failed))

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _path(keys) -> str:
  return "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in keys)


def check_shapes(manager, step: int, template, directory: str) -> None:
  """ValueError naming the arrays whose stored shapes differ from `template`'s, read from
  the checkpoint's metadata before any data: a restore into the wrong shapes (another
  model config) fails in orbax's asynchronous reads, which leave tensorstore callbacks that
  print 'Event loop is closed' tracebacks at exit. Unreadable metadata is left to restore."""
  try:
    stored = manager.item_metadata(step)
    have = {_path(p): tuple(getattr(v, "shape", ()) or ())
            for p, v in jax.tree_util.tree_flatten_with_path(stored)[0]}
  except Exception:  # noqa: BLE001 - damaged metadata: restore names it
    return
  want = {_path(p): tuple(getattr(v, "shape", ())) for p, v in
          jax.tree_util.tree_flatten_with_path(template)[0]}
  differ = [f"{k}: stored {have[k]}, requested {want[k]}" for k in want
            if k in have and have[k] != want[k]]
  missing = sorted(set(want) ^ set(have))
  if differ or missing:
    lines = differ[:4] + ([f"{len(differ) - 4} more"] if len(differ) > 4 else [])
    if missing:
      lines.append(f"arrays in one but not the other: {', '.join(missing[:4])}"
                   + (" ..." if len(missing) > 4 else ""))
    raise ValueError(f"checkpoint step {step} in {directory} does not fit the requested "
                     f"config (another model or optimiser shape): " + "; ".join(lines))


def _free_name(path: str) -> str:
  """`path`, or `path.1`, `path.2`, ... when it is taken (never overwrite what was set aside)."""
  n, out = 0, path
  while os.path.exists(out):
    n += 1
    out = f"{path}.{n}"
  return out


def _to_savable(x):
  # Typed PRNG keys are stored as their raw uint32 data.
  if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(x)
  return x


def _from_savable(template, x):
  if hasattr(template, "dtype") and jax.dtypes.issubdtype(template.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(x)
  return x
