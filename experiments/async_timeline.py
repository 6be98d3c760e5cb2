"""The asynchronous pipeline's timeline on 4 + 4 simulated devices: when the sampler, the
weight copy, the host's scoring and the update ran in each iteration, at
asynchronous.max_staleness 0 and 1, and what the weight copy costs.

configs/long_chain.py at the medium length (63-token solutions, 32 prompts x 8, 4
minibatches), no cold start (the timeline does not need a policy that learns), 8
iterations; the trainer on devices 0-3 (`mesh.num_devices=4`, fsdp 4), the sampler on 4-7
(`placement.sampler_devices=4`, data 4), `asynchronous.timeline=true`. The 8 simulated
devices share this machine's CPU cores, so the two meshes compete for the same cores: the
timeline shows whether the phases overlap in time, not a speed-up a TPU slice would see.

    python -m experiments.async_timeline [--iterations 8] [--record]

Writes under runs/results/async_timeline (experiments/results/ with --record):
runs/k<k>/ (each run's directory, with timeline.jsonl), summary.json (per k: iteration
time, weight copy bytes and ms, the share of update time the sampler ran alongside) and
timeline.png.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402

from experiments import _plots, _results, stability_map  # noqa: E402
from gspo_jax.config import SFTConfig  # noqa: E402
from gspo_jax.parallel import sharding
from gspo_jax.parallel.placement import AsyncConfig, PlacementConfig  # noqa: E402
from gspo_jax.train import loop as train  # noqa: E402

ROWS = {"sample": 0, "weight_copy": 0, "score": 1, "update": 2}
LANES = ("sampler (devices 4-7)", "host", "trainer (devices 0-3)")
COLOURS = {"sample": "tab:blue", "weight_copy": "tab:purple", "score": "tab:gray",
           "update": "tab:orange"}


def config(k: int, iterations: int):
  cfg = stability_map.config("medium", "gspo", 4, 1e-4, 0, False, iterations)
  return dataclasses.replace(
      cfg, sft=SFTConfig(steps=0), eval_every=0, eval_size=8,
      mesh=sharding.MeshConfig(data=1, fsdp=4, num_devices=4),
      placement=PlacementConfig(sampler_devices=4),
      asynchronous=AsyncConfig(max_staleness=k, timeline=True))


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
  """Total time during which an interval of `a` and one of `b` both run."""
  return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def summarise(events: list[dict], rows: list[dict], skip: int) -> dict:
  """Iterations >= skip (the first ones compile)."""
  late = [e for e in events if e["iteration"] >= skip]
  spans = lambda phase: [(e["start"], e["end"]) for e in late if e["phase"] == phase]
  update = sum(e - s for s, e in spans("update"))
  kept = [r for r in rows if r["step"] > skip]
  return {"iterations_timed": len(kept),
          "time_iteration_mean_s": float(np.mean([r["time_iteration"] for r in kept])),
          "weight_copy_bytes": kept[0]["weight_copy_bytes"],
          "time_weight_copy_mean_ms": 1e3 * float(np.mean([r["time_weight_copy"] for r in kept])),
          "update_time_s": update,
          "sampling_during_update_share": overlap(spans("sample"), spans("update")) / update,
          "scoring_during_update_share": overlap(spans("score"), spans("update")) / update}


def plot(timelines: dict, out: str) -> str:
  fig, axes = _plots.figure(nrows=len(timelines), figsize=(10, 2.2 * len(timelines)))
  for ax, (k, events) in zip(np.atleast_1d(axes), timelines.items()):
    for e in events:
      y = ROWS[e["phase"]]
      ax.barh(y, e["end"] - e["start"], left=e["start"], height=0.6,
              color=COLOURS[e["phase"]], edgecolor="black", linewidth=0.3)
      if e["phase"] in ("sample", "update"):
        ax.text(e["start"], y, str(e["iteration"]), fontsize=6, va="center")
    ax.set_yticks(range(3), LANES)
    ax.set_title(f"asynchronous.max_staleness = {k}", fontsize=9)
  np.atleast_1d(axes)[-1].set_xlabel("seconds since the loop started")
  for phase, colour in COLOURS.items():
    np.atleast_1d(axes)[0].barh(0, 0, color=colour, label=phase)
  return _plots.save(fig, np.atleast_1d(axes)[0], out, "timeline.png")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--iterations", type=int, default=8)
  parser.add_argument("--skip", type=int, default=2, help="first iterations left out (compiles)")
  parser.add_argument("--out", default=None)
  _results.add_record_arg(parser)
  args = parser.parse_args(argv)
  out = _results.out_path(args, "async_timeline")
  record, timelines = {}, {}
  for k in (0, 1):
    run_dir = os.path.join(out, "runs", f"k{k}")
    shutil.rmtree(run_dir, ignore_errors=True)
    train.train(config(k, args.iterations), run_dir, progress=False, checkpoint_every=0)
    with open(os.path.join(run_dir, "timeline.jsonl")) as f:
      events = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    timelines[k] = [e for e in events if e["iteration"] >= args.skip]
    record[f"k{k}"] = {**summarise(events, rows, args.skip), "events": timelines[k]}
  record["command"] = "python -m experiments.async_timeline " + " ".join(argv or [])
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(record, f, indent=2)
  print(json.dumps(record, indent=2), plot(timelines, out))
  return record


if __name__ == "__main__":
  main()
