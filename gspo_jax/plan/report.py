"""The planner's report as text (`python -m gspo_jax.plan` without --json): memory per
program against the chip's HBM, traffic, the roofline per call and the largest
collectives."""

from __future__ import annotations

from typing import Any

from gspo_jax.plan.hlo import COLLECTIVES

GIB = 2 ** 30


def _gib_text(gib: float) -> str:
  return f"{gib:g} GiB" if gib else "unknown"


def format_report(report: dict[str, Any]) -> str:
  gib = lambda b: f"{b / GIB:8.3f}"
  lines = [f"{report['topology']}: {report['chips']} chips, mesh {report['mesh']}, "
           f"{_gib_text(report['hbm_per_chip_gib'])} HBM per chip; parameters "
           f"{report['param_bytes'] / GIB:.3f} GiB, {report['param_bytes_per_chip'] / GIB:.3f} "
           "GiB per chip",
           f"{'program':8s} {'args':>8s} {'output':>8s} {'donated':>8s} {'temp':>8s} "
           f"{'code':>8s} {'peak':>8s}  GiB per chip   compile  {'traffic':>8s}  "
           "collectives (static count)"]
  for name, p in report["programs"].items():
    if "peak" not in p:
      lines.append(f"{name:8s} does not fit: {p['error']}")
      continue
    coll = ", ".join(f"{k} {v}" for k, v in p["collectives"].items() if v) or "none"
    moved = sum(v for k, v in p["collective_bytes"].items() if k in COLLECTIVES)
    loops = p["collective_bytes"]["dynamic_loops"]
    lines.append(f"{name:8s} {gib(p['argument'])} {gib(p['output'])} {gib(p['alias'])} "
                 f"{gib(p['temp'])} {gib(p['code'])} {gib(p['peak'])}  "
                 f"{'fits' if p['fits'] else 'DOES NOT FIT':12s}  {p['compile_s']:6.1f} s  "
                 f"{gib(moved)}{'+' if loops else ' '} {coll}")
  lines.append(f"{'program':8s} {'TFLOP':>9s} {'HBM GiB':>8s} {'ICI GiB':>8s} "
               f"{'compute':>9s} {'HBM':>9s} {'ICI':>9s}  roofline per call (per chip)")
  ms = lambda s: f"{s * 1e3:7.1f}ms"
  for name, p in report["programs"].items():
    if "time_s" in p:
      lines.append(f"{name:8s} {p['flops'] / 1e12:9.2f} {gib(p['hbm_bytes'])} "
                   f"{gib(p['collective_bytes']['wire'])} {ms(p['compute_s'])} "
                   f"{ms(p['hbm_s'])} {ms(p['ici_s'])}  {p['bound']} binds")
  if "iteration_s" in report:
    lines.append(f"iteration (sample + prepare + update) at the roofline: "
                 f"{report['iteration_s']:.3f} s")
  lines.append("largest collectives (GiB per chip, times run):")
  for name, p in report["programs"].items():
    big = p.get("collective_bytes", {}).get("largest", [])
    if big:
      lines.append(f"  {name:8s} " + "; ".join(
          f"{o['kind']} {o['shape']} x{o['times']} = {o['bytes'] / GIB:.2f}" for o in big))
  worst = [n for n, p in report["programs"].items() if not p["fits"]]
  lines.append("traffic: GiB per chip of collective results, each weighted by the trip counts "
               "of its loops ('+': a loop with an early exit, the decode loop, counted once); "
               "ICI: bytes sent per chip (ring estimates); TFLOP: all chips; HBM: weights, "
               "optimiser state and KV cache (activations not counted); decode counted to "
               "max_new_tokens")
  lines.append("verdict: every program fits" if not worst else
               f"verdict: does not fit ({', '.join(worst)} over "
               f"{report['hbm_per_chip_gib']:g} GiB per chip)")
  return "\n".join(lines)
