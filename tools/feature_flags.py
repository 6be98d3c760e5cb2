"""Which package files read each feature's config flag: attribute reads in code (not
docstrings or comments), found with `ast`. The measure behind the feature-seams work: a
feature whose flag is read in many files pays a tax in each of them.

    python tools/feature_flags.py [PACKAGE_DIR]     # default: gspo_jax
"""

from __future__ import annotations

import ast
import os
import sys

# The attribute each feature's flag is read by (`cfg.kl_coef`, `cfg.loss.kl_coef`,
# `cfg.multiturn.env`, `cfg.rollout.oversample`, ...).
FLAGS = ("kl_coef", "multiturn", "routing", "oversample", "rollout_correction", "truncation",
         "compact_rows", "sampler_dtype")


def readers(package: str) -> dict[str, list[str]]:
  out: dict[str, list[str]] = {flag: [] for flag in FLAGS}
  for folder, _, names in sorted(os.walk(package)):
    for name in sorted(n for n in names if n.endswith(".py")):
      path = os.path.join(folder, name)
      tree = ast.parse(open(path).read(), path)
      read = {node.attr for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)}
      for flag in FLAGS:
        if flag in read:
          out[flag].append(os.path.relpath(path, package))
  return out


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  package = argv[0] if argv else "gspo_jax"
  for flag, files in readers(package).items():
    print(f"{flag:20s} {len(files):2d}  {' '.join(files)}")


if __name__ == "__main__":
  main()
