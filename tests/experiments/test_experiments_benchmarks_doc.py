"""docs/benchmarks.md's Targets table against the committed benchmark records it cites:
each phrase below is rendered from experiments/results/benchmark_<name>.json and must appear
in the doc (whitespace aside). Runs the doc quotes that no record holds (the second and third
`train` runs) are not checked."""

import json
import os
import re

import pytest

from experiments._results import RESULTS, ROOT
from experiments._stats import rnd

DOC = os.path.join(ROOT, "docs", "benchmarks.md")
MIB = 2 ** 20


def result(name: str) -> dict:
  with open(os.path.join(RESULTS, f"benchmark_{name}.json")) as f:
    return json.load(f)["result"]


def train() -> list[str]:
  r = result("train")
  run = r["remat_none"]
  return [f"step {rnd(run['seconds'], 3)}", f"**MFU {rnd(100 * run['mfu'], 1)}%",
          f"peaks of {rnd(r['peak_gflops'], 1)}", f"each step: {rnd(100 * run['mfu_paired'], 1)}%"]


def sampler() -> list[str]:
  r = result("sampler")
  nnx, jx = r["host_nnx"], r["host_jax"]
  return [f"in-graph {rnd(r['in_graph_seconds'], 3)} s ({r['in_graph_tokens_per_s']:,.0f} "
          f"tokens/s; {rnd(r['in_graph_ms_per_decode_step'], 2)} ms per decode step), nnx.jit "
          f"loop {rnd(nnx['seconds'], 3)} s: **{rnd(nnx['speedup_in_graph'], 2)}×**, jax.jit loop "
          f"{rnd(jx['seconds'], 3)} s: **{rnd(jx['speedup_in_graph'], 2)}×**; repeated prompts "
          f"{rnd(r['repeated_prompt_seconds'], 3)} s: sharing is "
          f"**{rnd(r['speedup_shared_prefix_over_repeated'], 2)}×**"]


def prefix() -> list[str]:
  r = result("prefix")
  off, on = r["share_False"], r["share_True"]
  return [f"{rnd(off['seconds'], 2)} → **{rnd(on['seconds'], 2)} s, {rnd(r['speedup'], 2)}×** "
          f"(paired {rnd(r['speedup_paired'], 2)}×; token positions through the layers "
          f"{r['positions_unshared']:,} → {r['positions_shared']:,}",
          f"temporaries {off['temp_bytes'] / MIB:,.0f} → {on['temp_bytes'] / MIB:,.0f} MiB"]


def logprobs() -> list[str]:
  r = result("logprobs")
  lean, plain = r["lean"]["temp_bytes"], r["plain"]["temp_bytes"]
  return [f"{lean / MIB:,.0f} vs {plain / MIB:,.0f} MiB", f"lean is **{rnd(lean / plain, 2)}×**"]


def iteration() -> list[str]:
  r = result("iteration")
  ph = r["phases_median"]
  share = lambda k: f"{rnd(ph[k], 3)} s ({rnd(100 * ph[k] / ph['time_total'], 0)}%)"
  return [f"**loop {rnd(r['time_iteration'], 3)} s**",
          f"sample {share('time_sample')}, score {share('time_score')}, prepare "
          f"{share('time_prepare')}, update {share('time_update')}, total "
          f"{rnd(ph['time_total'], 3)} s (the loop is {rnd(r['phases_total_over_loop'], 2)}× "
          f"faster); fused {rnd(r['fused']['time_iteration'], 3)} s "
          f"({rnd(r['speedup_fused_over_loop'], 2)}× the loop)"]


def compile_() -> list[str]:
  rows = result("compile")["rows"]
  t = {(r["mode"], r["layers"], p): r[f"{p}_lower_seconds"] + r[f"{p}_compile_seconds"]
       for r in rows for p in ("update", "sampler")}
  span = lambda mode, p, digits: (f"{rnd(t[mode, 2, p], 1)} → {rnd(t[mode, 28, p], 1)} s "
                                  f"({rnd(t[mode, 28, p] / t[mode, 2, p], digits)}×")
  return [f"unrolled {span('unrolled', 'update', 1)}**)".replace("s (", "s (**"),
          f"`scan_layers` {span('scan', 'update', 2)}**)".replace("s (", "s (**"),
          f"sampler: unrolled {span('unrolled', 'sampler', 1)}), scanned {span('scan', 'sampler', 1)})"]


QUOTES = [q for f in (train, sampler, prefix, logprobs, iteration, compile_) for q in f()]


@pytest.mark.parametrize("quote", QUOTES)
def test_targets_table_quotes_its_record(quote):
  text = re.sub(r"\s+", " ", open(DOC, encoding="utf-8").read())
  assert re.sub(r"\s+", " ", quote) in text, f"docs/benchmarks.md does not say {quote!r}"
