"""Every experiment plot: one style (sizes, colours, legend outside the data), and the figures
that show a claim — paired per-seed differences with their intervals, the stability map with
collapsed seeds counted per cell, the smallest and largest ratios of each run, and the
precision-gap histogram with both clip bands marked.

The drawing functions take plain numbers (summaries, arrays), never runs, so a figure built
from a committed summary can be redrawn without the runs (experiments/figures.py).
"""

from __future__ import annotations

import math
import os

import numpy as np

from experiments import _stats

DPI = 110
SEED_MARKERS = "osD^v<>p*h"
# One colour per loss wherever it appears; variants of a loss darken or lighten it.
LOSS_COLOURS = {"gspo": "tab:blue", "grpo": "tab:red", "luspo": "tab:cyan", "gmpo": "tab:olive",
                "cispo": "tab:purple", "sapo": "tab:brown"}
INTERVAL_COLOUR = "black"


def figure(ncols: int = 1, figsize=(6, 4), nrows: int = 1):
  """(fig, ax), or (fig, axes) with more than one panel, on the non-interactive Agg backend
  (no display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt.subplots(nrows, ncols, figsize=figsize)


def save(fig, ax, out: str, name: str, *, grid: bool = True, legend_size=None) -> str:
  """The legend of `ax` outside the axes, to the right (no legend over data; none if `ax`
  has no labelled artist), optional light grid, saved as a 110 dpi PNG at out/name cropped
  to what was drawn; closes the figure."""
  import matplotlib.pyplot as plt
  if ax is not None and ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=legend_size or 8, loc="upper left", bbox_to_anchor=(1.02, 1),
              borderaxespad=0, frameon=False)
  for a in np.atleast_1d(fig.axes):
    if grid and a.get_label() != "<colorbar>":
      a.grid(alpha=0.3)
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, name)
  fig.savefig(path, dpi=DPI, bbox_inches="tight")
  plt.close(fig)
  return path


def paired(comparisons, out: str, name: str, title: str = "") -> str:
  """One row per (label, a, b): each seed's a − b as a marker, the mean with its 95%
  t-interval as a bar (none with one seed), n in the row's label, and a zero line. A row whose
  interval excludes zero is drawn solid, one that does not hollow."""
  fig, ax = figure(figsize=(7.5, 0.55 * len(comparisons) + 1.2))
  for row, (label, a, b) in enumerate(comparisons):
    y = len(comparisons) - 1 - row
    p = _stats.paired(a, b)
    for k, d in enumerate(p["diffs"]):
      ax.plot(d, y + 0.12, SEED_MARKERS[k % len(SEED_MARKERS)], color="tab:gray", ms=5,
              label=f"seed {k}" if row == 0 else None)
    if p["n"] > 1:
      ax.errorbar(p["mean"], y - 0.12, xerr=p["half_width"], fmt="o", capsize=3,
                  color=INTERVAL_COLOUR, mfc=INTERVAL_COLOUR if _stats.resolved(p) else "white",
                  label="mean, 95% t-interval" if row == 0 else None)
  ax.axvline(0, color="black", lw=0.8)
  labels = [f"{c[0]} (n = {len(c[1])})" for c in comparisons]
  ax.set_yticks(range(len(comparisons)), labels[::-1], fontsize=8)
  ax.set_ylim(-0.7, len(comparisons) - 0.3)
  ax.set_xlabel("a − b, per seed (same cold start)")
  if title:
    ax.set_title(title, fontsize=10)
  return save(fig, ax, out, name)


def stability_map(cells: dict, out: str, lengths, columns, losses=("gspo", "grpo"),
                  name: str = "stability_map.png") -> str:
  """One panel per loss: rows = response length, columns = (lr, minibatches); colour = mean
  held-out gain over the seeds run, text = seeds collapsed of seeds run (k/n); blank = not
  run. `cells[(length, loss, lr, minibatches)]` = {"gains": [...], "collapsed": [...]}."""
  fig, axes = figure(ncols=len(losses), figsize=(4.2 * len(losses) + 1.2, 3.4))
  for ax, loss in zip(axes, losses):
    grid = np.full((len(lengths), len(columns)), np.nan)
    for i, length in enumerate(lengths):
      for j, (lr, mb) in enumerate(columns):
        cell = cells.get((length, loss, lr, mb))
        if not cell:
          continue
        grid[i, j] = float(np.mean(cell["gains"]))
        k, n = sum(cell["collapsed"]), len(cell["collapsed"])
        ax.text(j, i, f"{k}/{n}", ha="center", va="center", fontsize=9,
                fontweight="bold" if k else "normal")
    im = ax.imshow(grid, cmap="RdYlGn", vmin=-0.4, vmax=0.4, aspect="auto")
    ax.set_xticks(range(len(columns)), [f"{mb} mb" for lr, mb in columns], fontsize=8)
    # Length labels on the first panel only: on the second they would overprint the first.
    ax.set_yticks(range(len(lengths)), lengths if ax is axes[0] else [])
    for j, (lr, mb) in enumerate(columns):  # one lr label per group of columns, below them
      if j == 0 or columns[j - 1][0] != lr:
        group = [jj for jj, c in enumerate(columns) if c[0] == lr]
        ax.annotate(f"lr {lr:g}", (np.mean(group), -0.22), xycoords=("data", "axes fraction"),
                    ha="center", fontsize=8)
    ax.set_title(f"{loss.upper()}: collapsed seeds / seeds run", fontsize=10)
  fig.colorbar(im, ax=list(axes), label="held-out gain, mean over seeds (end − cold start)")
  return save(fig, None, out, name, grid=False)


def ratio_extremes(runs: dict, out: str, name: str = "ratio_extremes.png") -> str:
  """Per variant and seed: a line from the smallest to the largest ratio of the whole run,
  and markers at the smallest and largest per update averaged over iterations.
  `runs[variant]` = the summary's {ratio_min_min, ratio_max_max, ratio_min_mean,
  ratio_max_mean} lists, one value per seed."""
  fig, ax = figure(figsize=(1.3 * len(runs) + 2.5, 4))
  for i, (variant, r) in enumerate(runs.items()):
    n = len(r["ratio_min_min"])
    for k in range(n):
      x = i + (k - (n - 1) / 2) * 0.15
      first = i == 0 and k == 0
      ax.plot([x, x], [r["ratio_min_min"][k], r["ratio_max_max"][k]], color="tab:gray", lw=2,
              label="smallest to largest over the run" if first else None)
      ax.plot([x, x], [r["ratio_min_mean"][k], r["ratio_max_mean"][k]], "_", color="black",
              ms=10, mew=2, label="per update, mean over iterations" if first else None)
    ax.annotate(f"n = {n}", (i, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                textcoords="offset points", ha="center", fontsize=8)
  ax.axhline(1, color="black", lw=0.8)
  for edge in (0.8, 1.27):  # GRPO's clip range on the token ratio
    ax.axhline(edge, color="tab:red", lw=0.8, ls=":",
               label="GRPO's clip range [0.8, 1.27]" if edge == 0.8 else None)
  ax.set_yscale("log")
  ax.set_xticks(range(len(runs)), [v.replace("_", " ") for v in runs], fontsize=8, rotation=20)
  ax.set_ylabel("importance ratio (token; GSPO: sequence)")
  return save(fig, ax, out, name)


def log_ratio_hist(token_lr, seq_lr, out: str, name: str = "log_ratio_hist.png",
                   grpo=(0.2, 0.27), gspo=(3e-4, 4e-4)) -> str:
  """Two panels, each at its own scale: the per-token log-ratios with GRPO's clip band, and
  the per-sequence log-ratios with GSPO's, the band shaded and the fraction outside it
  printed (with the counts), so a band narrower than the other panel's bins is visible."""
  fig, axes = figure(ncols=2, figsize=(11, 3.8))
  panels = ((axes[0], np.asarray(token_lr), grpo, "per token: log r_it (GRPO)", "tokens"),
            (axes[1], np.asarray(seq_lr), gspo, "per sequence: mean_t log r_it (GSPO)",
             "responses"))
  for ax, x, (lo, hi), title, unit in panels:
    band = (math.log(1 - lo), math.log(1 + hi))
    half = max(4 * float(np.std(x)) if len(x) else 0.0, 1.2 * band[1])
    bins = np.linspace(-half, half, 61)
    ax.hist(np.clip(x, bins[0], bins[-1]), bins=bins, color="tab:gray")
    # Shaded and edged: GSPO's band can be narrower than a bin, and must still be seen.
    ax.axvspan(*band, color="tab:green", alpha=0.25)
    for edge in band:
      ax.axvline(edge, color="tab:green", lw=1)
    outside = float(np.mean((x < band[0]) | (x > band[1]))) if len(x) else float("nan")
    ax.set_title(f"{title}\nclip band [1 − {lo:g}, 1 + {hi:g}] (green): {pct(outside)} of "
                 f"{len(x):,} {unit} outside it", fontsize=8)
    ax.set_xlabel("log(pi_float32 / pi_bfloat16) at theta = theta_old (edges: clipped)")
  axes[0].set_ylabel("count")
  return save(fig, None, out, name)


def figure1(variants: dict, out: str, name: str = "figure1.png", *, colours=None,
            smooth: int = 10) -> str:
  """The paper's Figure 1 view: training reward (top; a running mean over `smooth`
  iterations) and held-out accuracy (bottom, from the cold start) against the responses
  sampled (left) and the model FLOPs spent (right). `variants`: name -> a summary entry
  with `reward_curve` (per seed [[iteration, samples, FLOPs, reward], ...]) and
  `heldout_curve` (per seed [[iteration, accuracy], ...]). One thin line per seed, the
  mean over seeds bold (seeds share their iterations), n seeds in the legend."""
  fig, axes = figure(ncols=2, nrows=2, figsize=(11, 7))
  colours = colours or {}
  for i, (variant, entry) in enumerate(sorted(variants.items())):
    colour = colours.get(variant, f"C{i}")
    curves = [np.asarray(c, float) for c in entry["reward_curve"]]
    n = len(curves)
    for col in (0, 1):  # x: responses sampled, model FLOPs
      xs_seed, rewards, heldouts = [], [], []
      for c, h in zip(curves, entry["heldout_curve"]):
        k = min(smooth, max(1, len(c) // 4))
        r = np.convolve(c[:, 3], np.ones(k) / k, mode="valid")
        x = c[k - 1:, 1 + col]
        axes[0, col].plot(x, r, color=colour, alpha=0.3, lw=0.8)
        # held-out at iteration s: x after s iterations (0 at the cold start)
        at = dict(zip(c[:, 0].astype(int), c[:, 1 + col]))
        h = np.asarray(h, float)
        hx = np.array([at.get(int(s), 0.0) if s else 0.0 for s in h[:, 0]])
        axes[1, col].plot(hx, h[:, 1], color=colour, alpha=0.3, lw=0.8)
        xs_seed.append(x), rewards.append(r), heldouts.append((hx, h[:, 1]))
      label = f"{variant.upper().replace('_', ' ')} (n = {n})" if col == 1 else None
      if len({len(r) for r in rewards}) == 1:
        axes[0, col].plot(np.mean(xs_seed, 0), np.mean(rewards, 0), color=colour, lw=2,
                          label=label)
      if len({len(h[1]) for h in heldouts}) == 1:
        axes[1, col].plot(np.mean([h[0] for h in heldouts], 0),
                          np.mean([h[1] for h in heldouts], 0), color=colour, lw=2, marker="o",
                          ms=3)
  for col, xlabel in enumerate(("responses sampled", "model FLOPs")):
    axes[1, col].set_xlabel(xlabel)
  for ax in axes.flat:  # 160000 as 1.6 x 1e5: six-digit tick labels ran into each other
    ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 3))
  axes[0, 0].set_ylabel(f"training reward (mean of {smooth} iterations)")
  axes[1, 0].set_ylabel("held-out greedy accuracy")
  return save(fig, axes[0, 1], out, name)


def pct(x: float) -> str:
  return f"{100 * x:.1f}%"
