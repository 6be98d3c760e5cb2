"""GSPO training: cold start (SFT), then iterations of rollout -> rewards -> update.

    python -m gspo_jax.train --config configs/addition_tiny.py [--set loss=grpo ...]

One iteration (each device phase one compiled program, `gspo_jax.train.programs`):
  rollout  `Run.rollout.collect` (`rollout.Groups`, or multi-turn `Episodes`): sample G
           responses per prompt, dispatch pi_old / pi_ref (`prepare`), decode and score on
           the host meanwhile, feed the rewards back
  update   advantages from the rewards, then one optax step per minibatch (`step.update`)

The loop keeps the step counter on the host and fetches each iteration's metrics one
iteration late, so the host waits for an update only where the next rollout's sampler
needs its parameters (which also keeps the update's tail out of `time_sample`). With
`profile_phases` it waits for every phase, each timed alone. The module map is in README.md.

SIGTERM (preemption) and Ctrl-C save a checkpoint at the next iteration boundary and exit
with 128 + the signal number, printing the command that resumes; the run directory's
rules (what a resume compares, what is cut back) are in `gspo_jax/train/rundir.py`, the faults
tried and what each keeps in docs/training.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from gspo_jax.config import TrainConfig
from gspo_jax.lora import run as lora_run
from gspo_jax.objectives import row_skip
from gspo_jax.train import checkpoint, coldstart, evaluation, metrics, pipeline, rundir
from gspo_jax.train.run import Run, heldout, reference_params, setup
from gspo_jax.utils import configlib

SHOW = ("reward_mean", "accuracy", "clip_frac_token", "heldout_accuracy", "sample_tokens_per_s")


def _log(*args):
  if jax.process_index() == 0:
    print(*args, flush=True)


class Stop(Exception):
  """Raised by an on_step hook to end `iterate` after this iteration (its metrics are
  still delivered); `extra` is what on_step would have returned."""

  def __init__(self, extra=None):
    super().__init__()
    self.extra = extra or {}


def iterate(run: Run, start: int, stop: int, *, ref_params=None, on_metrics=None,
            on_step=None, rollouts: pipeline.Pipeline | None = None) -> int:
  """RL iterations start..stop-1 on `run.state`; returns the step reached.

  on_metrics(step, metrics) gets each iteration's metrics (host floats) once they are
  fetched, one iteration late (the last one at the end); on_step(step) runs after the
  update of iteration step - 1 is dispatched (evaluation, checkpoints) and may add to the
  metrics it returns (a dict, or None), or raise `Stop` to end the loop at `step`.
  `rollouts`: an asynchronous run's pipeline (`gspo_jax.train.pipeline`; built here when the
  config asks for one and none is given)."""
  if rollouts is None and pipeline.is_async(run.cfg):
    rollouts = pipeline.Pipeline(run, start, ref_params, log=_log)
  try:
    return _iterate(run, start, stop, ref_params, on_metrics, on_step, rollouts)
  finally:
    if rollouts is not None:
      rollouts.close()


def _iterate(run, start, stop, ref_params, on_metrics, on_step, rollouts) -> int:
  pending = None
  last = time.perf_counter()
  step = start
  for it in range(start, stop):
    if rollouts is None:  # the kind of rollout the run makes (single- or multi-turn)
      r = run.rollout.collect(run, run.state.params, run.state.key, it, ref_params, log=_log)
    else:
      r = rollouts.rollout(it)
    t_update = time.perf_counter()
    run.state, update_metrics = run.programs.update(run.state, r.batch, r.rewards_BxG)
    if rollouts is not None:
      rollouts.updated(it, update_metrics, t_update)
    phases = {}
    if run.cfg.profile_phases:  # the update alone (the host then waits for it)
      jax.block_until_ready(run.state)
      phases["time_update"] = time.perf_counter() - t_update
    if pending is not None and on_metrics is not None:
      on_metrics(*_fetch(*pending))
    now = time.perf_counter()
    host = {**r.stats, **phases, "time_iteration": now - last}
    last = now
    step, stopping = it + 1, False
    try:
      extra = (on_step(step) if on_step is not None else None) or {}
    except Stop as e:
      extra, stopping = e.extra, True
    pending = (step, update_metrics, r.device_stats, {**host, **extra})
    if stopping:
      break
  if pending is not None and on_metrics is not None:
    on_metrics(*_fetch(*pending))
  return step


def _fetch(step: int, update_metrics, device_stats, host):
  m = {**jax.device_get(update_metrics), **jax.device_get(device_stats), **host}
  m["tokens_per_s"] = float(m["response_tokens"]) / max(m["time_iteration"], 1e-9)
  if "time_sample" in m:  # the sampler's own rate (time_sample excludes the update's tail)
    m["sample_tokens_per_s"] = float(m["response_tokens"]) / max(m["time_sample"], 1e-9)
  return step, m


class Interrupted(RuntimeError):
  """The run stopped on SIGTERM / SIGINT after saving a checkpoint at `step`."""

  def __init__(self, signum: int, step: int, run_dir: str):
    self.signum, self.step, self.run_dir = signum, step, run_dir
    super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}: checkpoint "
                     f"saved in {run_dir}; resume with the same command and --resume")


class _Signals:
  """SIGTERM (preemption: Cloud TPU spot / preemptible VMs get it before they go away) and
  SIGINT (Ctrl-C) ask for a stop at the next iteration boundary; a second Ctrl-C stops at
  once (KeyboardInterrupt). `requested()` is the same on every host: the steps where it is
  asked are the same on all of them, and it is true where any host got a signal."""

  def __init__(self):
    self.signum = None
    self.previous = {}

  def install(self, *signums) -> None:
    if threading.current_thread() is not threading.main_thread():
      return  # only the main thread may install handlers
    for signum in signums:
      self.previous.setdefault(signum, signal.signal(signum, self._handle))

  def _handle(self, signum, frame):
    if self.signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = self.signum or signum
    if jax.process_index() == 0:  # os.write: a print here could re-enter a print in progress
      os.write(1, f"\n{signal.Signals(signum).name}: stopping after a checkpoint at the end "
               "of this iteration (Ctrl-C again stops at once, without saving)\n".encode())

  def requested(self) -> int | None:
    mine = self.signum or 0
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      mine = int(np.max(multihost_utils.process_allgather(np.int32(mine))))
    return mine or None

  def restore(self) -> None:
    for signum, handler in self.previous.items():
      signal.signal(signum, handler)


def check_checkpoint_args(checkpoint_every: int, keep: int) -> None:
  if keep < 1:
    raise rundir.RunDirError(f"--keep-checkpoints must be >= 1 (the newest checkpoint is "
                             f"the run); got {keep}")
  if checkpoint_every < 0:
    raise rundir.RunDirError(f"--checkpoint-every must be >= 0 (0 = only the step-0, final "
                             f"and signal saves); got {checkpoint_every}")


def train(cfg: TrainConfig, run_dir: str, *, resume: bool = False, checkpoint_every: int = 10,
          keep: int = 3, progress: bool = True) -> dict[str, Any]:
  """Cold start (unless resuming), then `cfg.iterations` GSPO iterations. Returns a summary.

  Everything that can refuse the start (arguments, an existing run without --resume, a
  resume whose config changes the saved state's meaning) is checked before anything is
  written (`gspo_jax/train/rundir.py`). On SIGTERM / SIGINT a checkpoint is saved at the next
  iteration boundary and `Interrupted` is raised.

  Multi-host: every process calls this with the same arguments after
  `jax.distributed.initialize`; `run_dir` must be shared by all hosts."""
  check_checkpoint_args(checkpoint_every, keep)
  ckpt_dir = os.path.join(run_dir, "checkpoints")
  steps = checkpoint.complete_steps(ckpt_dir)
  if not resume and steps:
    raise rundir.RunDirError(f"{run_dir!r} already holds checkpoints (newest: step "
                             f"{steps[-1]}); pass --resume to continue it, or choose a new "
                             "--run-dir; nothing in it was changed")
  saved = rundir.load_saved_config(run_dir, TrainConfig) if resume else None
  if saved is not None:
    rundir.check_resume(saved, cfg, _log)
  elif resume and steps:
    _log(f"--resume: {run_dir} has checkpoints but no {rundir.CONFIG}: the requested config "
         "cannot be compared with the saved run's")
  try:
    run = setup(cfg, run_dir)
  except ValueError as e:  # the config, the data or the tokenizer: named, no traceback
    raise rundir.RunDirError(f"setup refused the run: {e}") from e
  checkpoint.check_free_space(run_dir, run.state, keep)
  _log(lora_run.describe_state(run))
  cfg = run.cfg  # with `model` filled in from a pretrained directory
  ckpt = checkpoint.Checkpointer(ckpt_dir, every=checkpoint_every, keep=keep)
  writer = None
  signals = _Signals()
  signals.install(signal.SIGTERM)  # a preemption in the cold start: stop once step 0 is saved
  try:
    held = heldout(run.task, cfg)
    if not held:
      _log("no held-out set (data.heldout_file / data.heldout_fraction): held-out accuracy "
           "is reported as nan")
    evaluate_now = lambda: float("nan") if not held else evaluation.evaluate(
        run, run.state.params, held)["accuracy"]
    if resume and ckpt.latest_step() is not None:
      try:
        start, run.state = ckpt.restore_newest(run.state, log=_log)
      except ValueError as e:  # nothing was moved: the requested config does not fit
        hint = ("" if saved is not None else f"\n{run_dir} has no {rundir.CONFIG} to compare "
                "the requested config with: resume with the settings the run was started with")
        raise rundir.RunDirError(f"{e}{hint}") from None
      if run.frozen is not None:  # LoRA: the base the adapters were trained on
        lora_run.restore_base(run.frozen, run_dir)
      _log(f"resumed from checkpoint step {start} in {run_dir}")
    else:
      if resume:
        _log(f"--resume: no checkpoint in {run_dir}, starting the run")
      cold = lora_run.cold_start_view(run)  # LoRA: the whole base model
      probe = lambda params, examples: evaluation.evaluate(cold, params, examples)["accuracy"]
      params = coldstart.cold_start(cold, probe_accuracy=probe, log=_log)
      # LoRA: the cold start's policy is the frozen base and the adapters start at B = 0,
      # or (lora.cold_start = "adapters") RL goes on training the cold start's adapters.
      run.state = lora_run.start_rl(run, params, run_dir)
      ckpt.maybe_save(0, run.state, force=True)
      start = 0
    if jax.process_index() == 0:  # the run has really started (or been restored)
      rundir.save_config(run_dir, cfg, previous_step=start)
      cut = rundir.cut_metrics(run_dir, start)
      if cut:
        _log(cut)
    position = run.task.position(start, cfg.rollout.sampled_prompts)
    if position is not None:
      _log(f"data position at step {start}: epoch {position[0]}, index {position[1]} of "
           f"{len(run.task.train_records)} training records")
    if cfg.row_skip.enabled:
      _log(row_skip.note(cfg.loss.name))
    first = run.task.train_batch(cfg.seed, start, cfg.rollout.sampled_prompts)[0]
    _log(f"first prompt as the model sees it: {first.prompt!r}")
    summary: dict[str, Any] = {"heldout_accuracy_start": evaluate_now()}
    _log(f"held-out accuracy at step {start}: {summary['heldout_accuracy_start']:.3f}")
    writer = metrics.MetricsWriter(run_dir, total=cfg.iterations, initial=start,
                                   progress=progress)
    # A LoRA run's reference is its frozen base, read inside `prepare` (nothing to pass),
    # unless its cold start trained adapters: then the base with those (saved like a policy).
    ref_params = (reference_params(run, run_dir, fresh=start == 0)
                  if lora_run.trains_reference(cfg) else None)
    rollouts = None
    if pipeline.is_async(cfg):  # the sampler ahead of the trainer (gspo_jax/train/pipeline.py)
      try:
        rollouts = pipeline.Pipeline(run, start, ref_params, run_dir=run_dir, log=_log)
      except ValueError as e:
        raise rundir.RunDirError(str(e)) from None
    signals.install(signal.SIGINT)  # from here on Ctrl-C saves at the next boundary
    stopped = signals.requested()
    if stopped and start < cfg.iterations:
      raise Interrupted(stopped, start, run_dir)

    def on_step(step: int):
      nonlocal stopped
      extra = {}
      if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.iterations):
        extra["heldout_accuracy"] = evaluate_now()
        if step == cfg.iterations:  # the final policy: its evaluation is the summary's
          summary["heldout_accuracy_end"] = extra["heldout_accuracy"]
      stopped = signals.requested() if step < cfg.iterations else None
      force = step == cfg.iterations or bool(stopped)
      if rollouts is not None and ckpt.due(step, force=force):
        rollouts.save(run_dir, step)  # the rollouts in flight, before the checkpoint
      if ckpt.maybe_save(step, run.state, force=force) and rollouts is not None:
        pipeline.prune_inflight(run_dir)
      if stopped:
        raise Stop(extra)
      return extra

    def on_metrics(step: int, m: dict):
      writer.write(step, m, show=SHOW)
      summary["last"] = m
      if m.get("skipped_updates", 0) >= cfg.num_minibatches:
        writer.print(f"step {step}: every minibatch was skipped (no counted token left, or a "
                     "non-finite loss or gradient): the policy did not change")

    reached = iterate(run, start, cfg.iterations, ref_params=ref_params,
                      on_metrics=on_metrics, on_step=on_step, rollouts=rollouts)
    if stopped:
      raise Interrupted(stopped, reached, run_dir)
    if "heldout_accuracy_end" not in summary:
      summary["heldout_accuracy_end"] = evaluate_now()
    writer.print(f"held-out accuracy: {summary['heldout_accuracy_start']:.3f} at the start, "
                 f"{summary['heldout_accuracy_end']:.3f} after {cfg.iterations} {cfg.loss.name} "
                 f"iterations ({len(held)} problems, seed {cfg.seed})")
    return summary
  finally:
    signals.restore()
    if writer is not None:
      writer.close()
    ckpt.close()


def init_distributed(args) -> None:
  """Join the processes of a multi-host run (JAX's own runtime; before any JAX computation).

  On Cloud TPU, `--distributed` alone is enough: JAX finds the coordinator and the process
  ids from the TPU metadata. Elsewhere (CPU or GPU hosts) give the coordinator address, the
  number of processes and this one's id."""
  if args.cpu_devices:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.coordinator_address or args.num_processes:
    jax.distributed.initialize(coordinator_address=args.coordinator_address,
                               num_processes=args.num_processes, process_id=args.process_id)
  elif args.distributed:
    jax.distributed.initialize()


def run_name(config: str | None) -> str:
  """The default run directory's name: configs/addition_tiny.py -> addition_tiny, and its
  smoke variant configs/addition_tiny.py:smoke -> addition_tiny_smoke (a smoke run never
  lands in the full run's directory)."""
  if not config:
    return "default"
  path, _, variant = config.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return f"{name}_{variant}" if variant else name


def main(argv=None):
  parser = argparse.ArgumentParser(description="GSPO training (cold start, then RL)")
  configlib.add_cli_args(parser)
  parser.add_argument("--run-dir", default=None, help="default: runs/<config file name>")
  parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
  parser.add_argument("--checkpoint-every", type=int, default=10,
                      help="iterations between saves (>= 0; 0 = only step 0, the last step "
                      "and a save on SIGTERM / SIGINT)")
  parser.add_argument("--keep-checkpoints", type=int, default=3,
                      help="newest checkpoints kept (>= 1)")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument("--profile-phases", action="store_true",
                      help="time each phase alone (time_sample, time_prepare, time_score, "
                      "time_update): the host waits for each, so phases stop overlapping; "
                      "same as --set profile_phases=true")
  dist = parser.add_argument_group("multi-host (see docs/sharding_and_tpu.md)")
  dist.add_argument("--distributed", action="store_true",
                    help="jax.distributed.initialize() with auto-detection (Cloud TPU pods)")
  dist.add_argument("--coordinator-address", default=None, help="host:port of process 0")
  dist.add_argument("--num-processes", type=int, default=None)
  dist.add_argument("--process-id", type=int, default=None)
  dist.add_argument("--cpu-devices", type=int, default=0,
                    help="simulate this many devices per process on CPU")
  args = parser.parse_args(argv)
  try:
    check_checkpoint_args(args.checkpoint_every, args.keep_checkpoints)
    cfg = configlib.config_from_args(args, TrainConfig)
    if args.profile_phases:
      cfg = dataclasses.replace(cfg, profile_phases=True)
  except ValueError as e:
    raise SystemExit(f"config error: {e}") from None
  init_distributed(args)
  run_dir = args.run_dir or os.path.join("runs", run_name(args.config))
  argv = sys.argv[1:] if argv is None else list(argv)
  command = " ".join(["python -m gspo_jax.train", *map(shlex.quote, argv)]
                     + ([] if args.resume else ["--resume"]))
  try:
    train(cfg, run_dir, resume=args.resume, checkpoint_every=args.checkpoint_every,
          keep=args.keep_checkpoints, progress=not args.no_progress)
  except rundir.RunDirError as e:
    raise SystemExit(f"error: {e}") from None
  except Interrupted as e:
    _log(f"{e}:\n  {command}")
    raise SystemExit(128 + e.signum) from None
  except KeyboardInterrupt:
    steps = checkpoint.complete_steps(os.path.join(run_dir, "checkpoints"))
    where = (f"the newest checkpoint is step {steps[-1]}; continue with:\n  {command}"
             if steps else "no checkpoint was saved yet")
    _log(f"\ninterrupted (Ctrl-C) without saving: {where}")
    raise SystemExit(130) from None
  finally:
    if jax.process_count() > 1:
      jax.distributed.shutdown()


if __name__ == "__main__":
  main()
