"""What every experiment plot shares: a headless figure, and saving it the same way."""

from __future__ import annotations

import os


def figure(ncols: int = 1, figsize=(6, 4)):
  """(fig, ax), or (fig, axes) with `ncols` > 1, on the non-interactive Agg backend (no
  display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt.subplots(1, ncols, figsize=figsize)


def save(fig, ax, out: str, name: str, *, grid: bool = True, legend_size=None) -> str:
  """Legend on `ax` (font size `legend_size`, default if None), optional light grid,
  tight layout, 110 dpi PNG at out/name; closes the figure."""
  import matplotlib.pyplot as plt
  ax.legend(fontsize=legend_size)
  if grid:
    ax.grid(alpha=0.3)
  fig.tight_layout()
  path = os.path.join(out, name)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
