"""Where an experiment or benchmark writes its output: a scratch folder unless asked to record.

The committed results under experiments/results/ change only when a script is run with
--record (or given an explicit --out). Without it the same files go under runs/results/,
which git ignores, so running a script to try it never dirties the checkout."""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")  # committed: written with --record
SCRATCH = os.path.join(ROOT, "runs", "results")  # ignored by git (runs/): the default


def add_record_arg(parser) -> None:
  """--record: write the committed results instead of scratch ones."""
  parser.add_argument("--record", action="store_true",
                      help="write under experiments/results/ (committed) rather than "
                           "runs/results/ (scratch, ignored by git)")


def results_dir(record: bool) -> str:
  """The folder the results of a run go under: committed with record, scratch without."""
  return RESULTS if record else SCRATCH


def out_path(args, *parts: str) -> str:
  """`args.out` where given, else `parts` joined under `results_dir(args.record)`."""
  return args.out or os.path.join(results_dir(args.record), *parts)


def write_record(args, name: str, record: dict) -> str:
  """`record` as JSON at `out_path(args, name)` (its folder made); prints and returns the path."""
  path = out_path(args, name)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(record, f, indent=2)
  print("wrote", path)
  return path
