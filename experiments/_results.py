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


def cpu_model() -> str:
  """The CPU's model name from /proc/cpuinfo (Linux), else the platform's machine type."""
  import platform
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.machine()


def provenance(started: float, load_before) -> dict:
  """What a committed summary says about how it was made: the commit, the command line,
  the machine's load average before and after, and the wall seconds since `started`
  (`time.time()`). The working tree's dirtiness is recorded too, since a run from an
  uncommitted tree names a commit that is not quite what ran."""
  import platform
  import subprocess
  import sys
  import time

  def git(*a):
    try:
      return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                            timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return ""
  return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
          "command": "python -m " + os.path.splitext(
              os.path.relpath(os.path.abspath(sys.argv[0]), ROOT))[0].replace(os.sep, ".")
          + " " + " ".join(sys.argv[1:]),
          "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.platform()}",
          "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
          "seconds": time.time() - started}
