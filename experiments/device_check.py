"""Accelerator check: the sampler and update benchmarks in one command, one JSON out.

    python -m experiments.device_check                  # on a lent GPU / TPU: a few minutes
    python -m experiments.device_check --shapes issue   # the issue's CPU shape only
    python -m experiments.device_check --tiny           # any machine, seconds (the suite runs it)
    python -m experiments.device_check --plan configs/addition_tiny.py   # + the planner's
        # predicted peak memory and iteration time against this device's measured ones

Per shape: `benchmark.py decode` (ms per decode step of the phased sampler, of one phase
over the full cache and of a bfloat16 KV cache, at each T; compile seconds, temporary
memory, tokens and log-probs against the phased sampler) and the update step of
`benchmark.py long` (seconds, model FLOP/s, XLA's memory analysis) at each T. A part that
fails is recorded with its error and the check goes on: a lent machine's minutes are
not spent twice. Writes runs/results/device_check_<backend>.json (experiments/results/ with
--record, or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

# The planner's check plans for this process's own backend (`plan --topology local`).
os.environ.setdefault("GSPO_PLAN_LOCAL", "1")

from experiments import _bench, _bench_decode, _bench_long, _results

# Sampler and update shapes: the CPU shape, a wider one where an accelerator's
# memory bandwidth rather than its dispatch decides, and a toy for tests.
SHAPES = {
    "issue": dict(prompts=8, group=4, prompt_len=32, width=256, layers=2, vocab=4096,
                  new_tokens=[64, 256, 1024], rows=16),
    "wide": dict(prompts=16, group=8, prompt_len=128, width=1024, layers=4, vocab=32768,
                 new_tokens=[256, 1024], rows=32),
    "tiny": dict(prompts=2, group=2, prompt_len=4, width=16, layers=1, vocab=32,
                 new_tokens=[6], rows=2),
}


def _guarded(fn, *args) -> dict:
  try:
    return fn(*args)
  except Exception as e:  # noqa: BLE001 - recorded, and the other parts still run
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def check_shape(name: str, repeats: int, variants) -> dict:
  s = SHAPES[name]
  args = argparse.Namespace(
      new_tokens=s["new_tokens"], prompts=s["prompts"], group=s["group"],
      prompt_len=s["prompt_len"], width=s["width"], layers=s["layers"], vocab=s["vocab"],
      scan=False, baseline="", variants=variants, rows=[], repeats=repeats)
  print(f"== {name}: sampler", flush=True)
  sampler = _guarded(_bench_decode.bench_decode, args)
  update_args = argparse.Namespace(**{**vars(args), "rows": s["rows"]})
  update = []
  for T in s["new_tokens"]:
    print(f"== {name}: update T={T}", flush=True)
    update.append(_guarded(_bench_long.update_row, update_args, T, "none"))
  return {"shape": s, "sampler": sampler, "update": update}


def plan_check(config: str, iterations: int, sets: list[str]) -> dict:
  """The planner against the device: plan `config` for this process's devices (`--topology
  local`), then train it for `iterations` iterations here and compare the predicted peak
  memory (the largest program's) and roofline iteration time with the measured peak bytes
  in use and the median iteration time (the first iteration, which compiles, left out)."""
  import statistics
  import tempfile

  import jax

  from gspo_jax.plan import planner as plan
  from gspo_jax.train import loop as train
  from gspo_jax.utils import configlib
  cfg = configlib.apply_overrides(configlib.load_config(config),
                                  [*sets, f"iterations={iterations}", "eval_every=0"])
  report = plan.plan(cfg, plan.LOCAL, only=plan.ITERATION)
  with tempfile.TemporaryDirectory() as run_dir:
    train.train(cfg, run_dir, progress=False)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
  times = [r["time_iteration"] for r in rows if "time_iteration" in r][1:]
  stats = jax.devices()[0].memory_stats() or {}
  predicted = max(p.get("peak", 0) for p in report["programs"].values())
  return {"config": config, "sets": sets, "plan": report,
          "predicted_peak_bytes": predicted, "measured_peak_bytes": stats.get("peak_bytes_in_use"),
          "predicted_iteration_s": report.get("iteration_s"),
          "measured_iteration_s": statistics.median(times) if times else None}


def main(argv=None) -> str:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", nargs="+", default=["issue", "wide"], choices=list(SHAPES))
  p.add_argument("--variants", nargs="+", default=["phased", "one_phase", "bf16_cache"],
                 choices=_bench_decode.VARIANTS[1:])
  p.add_argument("--tiny", action="store_true",
                 help="--shapes tiny --repeats 1 --variants phased")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default=None,
                 help="directory (default: runs/results/, or experiments/results/ with --record)")
  p.add_argument("--plan", default="", metavar="CONFIG",
                  help="also check the TPU planner against this device: plan CONFIG for the "
                       "local devices, train it a few iterations, compare peak memory and "
                       "iteration time (run with GSPO_PLAN_LOCAL=1)")
  p.add_argument("--plan-iterations", type=int, default=4)
  p.add_argument("--plan-set", action="append", default=[], metavar="FIELD=VALUE")
  _results.add_record_arg(p)
  args = p.parse_args(argv)
  if "phased" not in args.variants:
    p.error("--variants needs 'phased', the reference of the comparisons")
  shapes, repeats, variants = ((["tiny"], 1, ["phased"]) if args.tiny
                               else (args.shapes, args.repeats, args.variants))
  t0, load = time.perf_counter(), os.getloadavg()
  record = {"command": "python -m experiments.device_check " + " ".join(argv or sys.argv[1:]),
            "machine": _bench.machine(), "load_average_before": load,
            "shapes": {name: check_shape(name, repeats, variants) for name in shapes}}
  if args.plan:
    print(f"== plan check: {args.plan}", flush=True)
    record["plan_check"] = _guarded(plan_check, args.plan, args.plan_iterations, args.plan_set)
  record.update(load_average_after=os.getloadavg(), seconds=time.perf_counter() - t0)
  out = _results.out_path(args)
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, f"device_check_{record['machine']['backend']}.json")
  with open(path, "w") as f:
    json.dump(record, f, indent=2)
  print("wrote", path)
  return path


if __name__ == "__main__":
  main()
