"""Experiments 1 and 2 of the paper: GSPO vs GRPO training efficiency, and clipping fractions.

Same task, model, data stream and seeds; each loss with its own clip range, the paper's
(`losses.LOSS_DEFAULTS`: GSPO 3e-4 / 4e-4, GRPO 0.2 / 0.27); each rollout batch split into
4 minibatches, so later updates are off-policy.
The cold start is deterministic per seed, so GSPO and GRPO start from the same policy.

    python -m experiments.gspo_vs_grpo --quick                    # a few minutes on 2 CPU cores
    python -m experiments.gspo_vs_grpo --seeds 0 1 2              # full: configs/addition_tiny.py
    python -m experiments.gspo_vs_grpo --losses grpo --seeds 0    # one part (run parts in parallel),
    python -m experiments.gspo_vs_grpo --plot-only                # then summarise what is there
    python -m experiments.gspo_vs_grpo --task long --seeds 0 1 2  # configs/long_chain.py
    python -m experiments.gspo_vs_grpo --task long --losses sapo cispo gmpo luspo --seeds 0 1
    python -m experiments.gspo_vs_grpo --task long --losses gspo grpo gspo_len --eps-tokens 63 \
        --set task.steps=6 rollout.max_new_tokens=72 num_minibatches=8   # preregistered.md
                                          # the objectives after GSPO beside the same runs

Writes under --out: runs/<loss>_seed<k>/ (metrics.jsonl ...), summary.json, and plots
reward.png, heldout.png, reward_vs_time.png, reward_vs_flops.png, heldout_vs_flops.png,
clip_fraction.png, and with --task long clip_by_length.png (clip fractions per response-length
quartile of max_new_tokens).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments import _runs

LOSSES = ("gspo", "grpo")  # the default comparison
# GSPO with its clip range scaled to the response length (experiments/preregistered.md,
# part 5): GRPO's token range divided by sqrt(T), on request with --eps-tokens T.
LENGTH_SCALED = ("gspo_len",)
AFTER_GSPO = ("sapo", "sapo_seq", "cispo", "gmpo", "luspo")  # docs/losses.md, on request




def length_scaled_eps(tokens: float, token_eps=(0.2, 0.27)) -> tuple[float, float]:
  """GSPO's (eps_low, eps_high) for responses of `tokens` tokens: GRPO's per-token range
  divided by sqrt(tokens). If the token log-ratios were independent with spread sigma, the
  sequence log-ratio (their mean) would have spread sigma / sqrt(T): this is GRPO's trust
  region moved to the sequence mean. It is our rule, not the paper's calibration."""
  return tuple(e / tokens ** 0.5 for e in token_eps)


def config(variant: str, seed: int, quick: bool, iterations: int | None, task: str,
           eps_tokens: float | None = None):
  """One loss's run: the task's config file with the loss, clipping at its own range
  (`_runs.loss_config`, shared with precision_training.py); gspo_len: GSPO at
  `length_scaled_eps(eps_tokens)`."""
  if variant not in LENGTH_SCALED:
    return _runs.loss_config(variant, seed, quick, iterations, task)
  if not eps_tokens:
    raise SystemExit("gspo_len needs --eps-tokens T (the response length its range is scaled to)")
  cfg = _runs.loss_config("gspo", seed, quick, iterations, task)
  low, high = length_scaled_eps(eps_tokens)
  return dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, eps_low=low, eps_high=high))


BIN_KEYS = tuple(f"clip_frac_{u}_len_q{k}" for u in ("token", "seq") for k in range(1, 5))
LENGTH_KEYS = ("response_length", "response_length_p90", "truncated_frac")


def summarise(runs: dict[str, list[dict]]) -> dict:
  keys = ("clip_frac_token", "clip_frac_seq") + LENGTH_KEYS
  out = {loss: _runs.summarise(items, mean_keys=keys) for loss, items in runs.items()}
  for loss, items in runs.items():  # per length quartile: over the iterations it had responses
    for key in BIN_KEYS:
      q = key[-2:]
      vals = [[r[key] for r in it["rows"] if r.get(f"response_frac_len_{q}", 0) > 0 and key in r]
              for it in items]
      out[loss][f"{key}_mean"] = [float(np.mean(v)) if v else None for v in vals]
      out[loss][f"iterations_with_len_{q}"] = [len(v) for v in vals]
  if {"gspo", "grpo"} <= set(out):
    grpo = float(np.mean(out["grpo"]["clip_frac_token_mean"]))
    out["clip_ratio_gspo_over_grpo"] = (  # None: GRPO clipped no token at all
        float(np.mean(out["gspo"]["clip_frac_token_mean"])) / grpo if grpo > 0 else None)
  return out


def plot(runs: dict[str, list[dict]], out: str) -> list[str]:
  colours = {"gspo": "tab:blue", "grpo": "tab:orange", "sapo": "tab:green",
             "sapo_seq": "tab:olive", "cispo": "tab:red", "gmpo": "tab:purple",
             "luspo": "tab:brown", "gspo_len": "tab:cyan"}
  reward = ("reward_mean", "training reward (mean of 20 iterations)")
  paths = _runs.standard_plots(runs, out, colours) + [
      _runs.plot_curves(runs, out, "reward_vs_time.png", *reward, smooth=20, x="time",
                        colours=colours),
      _runs.plot_curves(runs, out, "reward_vs_flops.png", *reward, smooth=20, x="flops",
                        colours=colours),
      _runs.plot_curves(runs, out, "heldout_vs_flops.png", "heldout_accuracy",
                        "held-out greedy accuracy", x="flops", colours=colours)]
  if any(BIN_KEYS[0] in r for items in runs.values() for it in items for r in it["rows"]):
    paths.append(plot_clip_by_length(runs, out, colours))
  return paths


def plot_clip_by_length(runs, out: str, colours) -> str:
  """Fraction of tokens clipped per response-length quartile of max_new_tokens (pooled over
  training and seeds: each iteration's per-bin fraction weighted equally), one line per
  loss, each point labelled with n, the iterations behind it (most quartiles are nearly
  empty on a task whose responses all have one length); a quartile no response reached is
  left out."""
  from experiments import _plots
  fig, ax = _plots.figure()
  for loss, items in sorted(runs.items()):
    xs, ys, ns = [], [], []
    for k in range(1, 5):
      vals = [r[f"clip_frac_token_len_q{k}"] for it in items for r in it["rows"]
              if r.get(f"response_frac_len_q{k}", 0) > 0 and f"clip_frac_token_len_q{k}" in r]
      if vals:
        xs.append(k)
        ys.append(max(float(np.mean(vals)), 1e-5))
        ns.append(len(vals))
    ax.plot(xs, ys, "o-", color=colours.get(loss), label=loss.upper())
    for x, y, n in zip(xs, ys, ns):
      ax.annotate(f"n={n}", (x, y), xytext=(4, 4), textcoords="offset points", fontsize=7,
                  color=colours.get(loss))
  ax.set_yscale("log")
  ax.set_xticks([1, 2, 3, 4], ["(0, T/4]", "(T/4, T/2]", "(T/2, 3T/4]", "(3T/4, T]"])
  ax.set_xlabel("response length (T = max_new_tokens)")
  ax.set_ylabel("fraction of tokens clipped (floored at 1e-5)")
  return _plots.save(fig, ax, out, "clip_by_length.png")


def main(argv=None):
  return _runs.main(argv, doc=__doc__, name="gspo_vs_grpo",
                    variants=LOSSES + AFTER_GSPO + LENGTH_SCALED,
                    default_variants=LOSSES, seeds=(0, 1, 2),
                    flag="--losses", summarise=summarise, plot=plot,
                    config=lambda loss, seed, a: config(loss, seed, a.quick, a.iterations,
                                                        a.task, a.eps_tokens),
                    add_args=lambda p: p.add_argument(
                        "--eps-tokens", type=float, default=None,
                        help="gspo_len: the response length its clip range is scaled to"))


if __name__ == "__main__":
  main()
