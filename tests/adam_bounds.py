"""How far two Adam(W) runs may drift apart when their gradients agree only to float32
rounding: tolerances for comparing parameters after optimizer steps.

Adam divides by sqrt(v): its first step from a fresh state is, per entry,
  u(g) = m_hat / (sqrt(v_hat) + eps) = g / (|g| + eps)        (m_hat = g, v_hat = g^2)
so theta_1 = theta_0 - lr * (u(g) + weight_decay * theta_0). u is ~sign(g): where |g| sits
at rounding noise, a flip moves an entry by up to 2 * lr whatever the CPU, while where |g|
is well resolved the step barely moves (du/dg = eps / (|g| + eps)^2). So a parameter
comparison must take its tolerance from the gradient tolerance and lr, never from one
machine's rounding; the gradients themselves are compared tightly.
"""

import numpy as np

EPS = 1e-8  # optax.adamw's default eps (gspo_jax/train/step.py make_optimizer keeps it)


def first_step(g, eps=EPS):
  """Adam's first update direction u(g) = g / (|g| + eps), in float64."""
  g = np.asarray(g, np.float64)
  return g / (np.abs(g) + eps)


def first_step_bound(g, g_tol, lr, eps=EPS):
  """Per entry, the largest |theta_a - theta_b| after one Adam step from the same
  parameters and a fresh state, when both runs' (clipped) gradients lie within g_tol of g:
  lr * (u(|g| + g_tol) - u(|g| - g_tol)), at most 2 * lr (u is odd and increasing)."""
  a = np.abs(np.asarray(g, np.float64))
  return lr * (first_step(a + g_tol, eps) - first_step(a - g_tol, eps))


def assert_first_step_close(got, want, g, g_tol, lr, rtol=1e-6, err_msg=""):
  """Parameters after one Adam step: within `first_step_bound` plus float32 rounding of
  theta - lr * u (rtol relative to the parameter, 1e-5 * lr for u's own arithmetic)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  bound = first_step_bound(g, g_tol, lr) + rtol * np.abs(want) + 1e-5 * lr
  worst = np.argmax(np.abs(got - want) - bound)
  assert np.all(np.abs(got - want) <= bound), (
      f"{err_msg}: entry {np.unravel_index(worst, want.shape)} differs by "
      f"{abs(got - want).flat[worst]:.3g} > bound {bound.flat[worst]:.3g} "
      f"(gradient {np.ravel(g)[worst]:.3g} +- "
      f"{np.ravel(np.broadcast_to(g_tol, want.shape))[worst]:.3g})")


def max_step(steps, b1=0.9, b2=0.99):
  """The largest |m_hat / sqrt(v_hat)| Adam can take at step `steps` from a fresh state
  (Cauchy-Schwarz over the gradient history): 1 at the first step."""
  k = np.arange(steps)
  m_w = (1 - b1) * b1 ** k / (1 - b1 ** steps)   # m_hat = sum m_w[k] * g[t - k]
  v_w = (1 - b2) * b2 ** k / (1 - b2 ** steps)   # v_hat = sum v_w[k] * g[t - k]^2
  return float(np.sqrt(np.sum(m_w ** 2 / v_w)))


def assert_steps_close(got_leaves, want_leaves, lr, steps, rtol, atol, loose_frac=0.01,
                       b1=0.9, b2=0.99):
  """Parameters after `steps` Adam steps from a fresh state, when the per-step gradients
  are not at hand: every entry within what the steps can move it (2 * lr * sum of
  `max_step`), and all but `loose_frac` of all entries within rtol/atol. The loose ones are
  those whose gradient sits at float32 noise; a real bug (other rows, another lr, a
  missed step) moves far more of them, or further."""
  cap = 2 * lr * sum(max_step(t, b1, b2) for t in range(1, steps + 1))
  loose = total = 0
  for i, (a, b) in enumerate(zip(got_leaves, want_leaves)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (i, a.shape, b.shape)
    diff = np.abs(a - b)
    assert np.all(diff <= cap * (1 + 1e-5) + rtol * np.abs(b)), (
        f"leaf {i}: max difference {diff.max():.3g} over {steps} Adam steps' reach {cap:.3g}")
    loose += int(np.sum(diff > atol + rtol * np.abs(b)))
    total += b.size
  assert total and loose <= loose_frac * total, (
      f"{loose} of {total} parameters differ beyond rtol={rtol}, atol={atol} "
      f"(at most {loose_frac:.0%} may, at float32 gradient noise)")


def assert_first_step_states_close(got, want, lr, rtol=1e-5, atol=1e-6, b1=0.9):
  """Two TrainStates one Adam step from the same parameters and a fresh optimizer state.
  Adam's first moment is then (1 - b1) * the clipped gradient, so the gradients are
  compared tightly through it (rtol, and atol relative to the largest |mu|); the
  parameters then within `first_step_bound` of that gradient tolerance."""
  import jax
  import optax
  mu = lambda s: [np.asarray(x, np.float64) for x in
                  jax.tree.leaves(optax.tree_utils.tree_get(s.opt_state, "mu"))]
  for s in (got, want):  # the bound holds for a first step only
    counts = optax.tree_utils.tree_get_all_with_path(s.opt_state, "count")
    assert counts and all(int(c) == 1 for _, c in counts), counts
  mu_got, mu_want = mu(got), mu(want)
  scale = max(np.abs(x).max() for x in mu_want)
  for i, (a, b) in enumerate(zip(mu_got, mu_want)):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale, err_msg=f"mu leaf {i}")
  p_got, p_want = jax.tree.leaves(got.params), jax.tree.leaves(want.params)
  assert len(p_got) == len(p_want) == len(mu_want)
  for i, (a, b, m) in enumerate(zip(p_got, p_want, mu_want)):
    g_tol = (rtol * np.abs(m) + atol * scale) / (1 - b1)
    assert_first_step_close(np.asarray(a), np.asarray(b), m / (1 - b1), g_tol, lr,
                            err_msg=f"param leaf {i}")
