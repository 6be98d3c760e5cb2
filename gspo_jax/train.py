"""GSPO training: cold start (SFT), then iterations of rollout -> rewards -> update.

    python -m gspo_jax.train --config configs/addition_tiny.py [--set loss=grpo ...]

One iteration (each device phase one compiled program, `gspo_jax.programs`):
  rollout  `rollout.rollout_step`: sample G responses per prompt, dispatch pi_old / pi_ref
           (`prepare`), decode and score on the host meanwhile, feed the rewards back
  update   advantages from the rewards, then one optax step per minibatch (`step.update`)

The loop keeps the step counter on the host and fetches each iteration's metrics one
iteration late, so the host never waits for an update it does not need yet: the next
rollout's sampler is queued behind it. The module map is in README.md.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import jax

from gspo_jax import checkpoint, coldstart, configlib, evaluate, metrics
from gspo_jax.config import TrainConfig
from gspo_jax.rollout import rollout_step
from gspo_jax.run import Run, heldout, reference_params, setup

SHOW = ("reward_mean", "accuracy", "clip_frac_token", "heldout_accuracy")


def _log(*args):
  if jax.process_index() == 0:
    print(*args, flush=True)


def iterate(run: Run, start: int, stop: int, *, ref_params=None, on_metrics=None,
            on_step=None) -> None:
  """RL iterations start..stop-1 on `run.state`.

  on_metrics(step, metrics) gets each iteration's metrics (host floats) once they are
  fetched, one iteration late (the last one at the end); on_step(step) runs after the
  update of iteration step - 1 is dispatched (evaluation, checkpoints) and may add to the
  metrics it returns (a dict, or None)."""
  pending = None
  last = time.perf_counter()
  for it in range(start, stop):
    r = rollout_step(run, run.state.params, run.state.key, it, ref_params, log=_log)
    run.state, update_metrics = run.programs.update(run.state, r.batch, r.rewards_BxG)
    if pending is not None and on_metrics is not None:
      on_metrics(*_fetch(*pending))
    now = time.perf_counter()
    host = {**r.stats, "time_iteration": now - last}
    last = now
    extra = (on_step(it + 1) if on_step is not None else None) or {}
    pending = (it + 1, update_metrics, r.device_stats, {**host, **extra})
  if pending is not None and on_metrics is not None:
    on_metrics(*_fetch(*pending))


def _fetch(step: int, update_metrics, device_stats, host):
  m = {**jax.device_get(update_metrics), **jax.device_get(device_stats), **host}
  m["tokens_per_s"] = float(m["response_tokens"]) / max(m["time_iteration"], 1e-9)
  return step, m


def train(cfg: TrainConfig, run_dir: str, *, resume: bool = False, checkpoint_every: int = 10,
          keep: int = 3, progress: bool = True) -> dict[str, Any]:
  """Cold start (unless resuming), then `cfg.iterations` GSPO iterations. Returns a summary.

  Multi-host: every process calls this with the same arguments after
  `jax.distributed.initialize`; `run_dir` must be shared by all hosts."""
  run = setup(cfg, run_dir)
  checkpoint.check_free_space(run_dir, run.state, keep)
  cfg = run.cfg  # with `model` filled in from a pretrained directory
  ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"), every=checkpoint_every,
                                 keep=keep)
  writer = None
  try:
    if not resume and ckpt.latest_step() is not None:
      raise ValueError(f"{run_dir!r} already holds checkpoints (newest: step "
                       f"{ckpt.latest_step()}); pass --resume to continue it, or choose a new "
                       "--run-dir")
    if jax.process_index() == 0:
      configlib.save_json(cfg, os.path.join(run_dir, "config.json"))
    held = heldout(run.task, cfg)
    if not held:
      _log("no held-out set (data.heldout_file / data.heldout_fraction): held-out accuracy "
           "is reported as nan")
    evaluate_now = lambda: float("nan") if not held else evaluate.evaluate(
        run, run.state.params, held)["accuracy"]
    start = ckpt.latest_step() if resume else None
    if start is not None:
      run.state = ckpt.restore(run.state)
      _log(f"resumed from checkpoint step {start} in {run_dir}")
    else:
      run.state = run.programs.init(coldstart.cold_start(run, log=_log))
      ckpt.maybe_save(0, run.state, force=True)
      start = 0
    position = run.task.position(start, cfg.rollout.prompts_per_iter)
    if position is not None:
      _log(f"data position at step {start}: epoch {position[0]}, index {position[1]} of "
           f"{len(run.task.train_records)} training records")
    first = run.task.train_batch(cfg.seed, start, cfg.rollout.prompts_per_iter)[0]
    _log(f"first prompt as the model sees it: {first.prompt!r}")
    summary: dict[str, Any] = {"heldout_accuracy_start": evaluate_now()}
    _log(f"held-out accuracy at step {start}: {summary['heldout_accuracy_start']:.3f}")
    writer = metrics.MetricsWriter(run_dir, total=cfg.iterations, initial=start,
                                   progress=progress)
    ref_params = reference_params(run, run_dir, fresh=start == 0) if cfg.kl_coef else None

    def on_step(step: int):
      extra = {}
      if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.iterations):
        extra["heldout_accuracy"] = evaluate_now()
      ckpt.maybe_save(step, run.state, force=step == cfg.iterations)
      return extra

    def on_metrics(step: int, m: dict):
      writer.write(step, m, show=SHOW)
      summary["last"] = m

    iterate(run, start, cfg.iterations, ref_params=ref_params, on_metrics=on_metrics,
            on_step=on_step)
    summary["heldout_accuracy_end"] = evaluate_now()
    writer.print(f"held-out accuracy: {summary['heldout_accuracy_start']:.3f} at the start, "
                 f"{summary['heldout_accuracy_end']:.3f} after {cfg.iterations} {cfg.loss} "
                 f"iterations ({len(held)} problems, seed {cfg.seed})")
    return summary
  finally:
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
  parser.add_argument("--checkpoint-every", type=int, default=10, help="iterations between saves")
  parser.add_argument("--keep-checkpoints", type=int, default=3, help="newest checkpoints kept")
  parser.add_argument("--no-progress", action="store_true")
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
    cfg = configlib.config_from_args(args, TrainConfig)
  except ValueError as e:
    raise SystemExit(f"config error: {e}") from None
  init_distributed(args)
  run_dir = args.run_dir or os.path.join("runs", run_name(args.config))
  try:
    train(cfg, run_dir, resume=args.resume, checkpoint_every=args.checkpoint_every,
          keep=args.keep_checkpoints, progress=not args.no_progress)
  finally:
    if jax.process_count() > 1:
      jax.distributed.shutdown()


if __name__ == "__main__":
  main()
