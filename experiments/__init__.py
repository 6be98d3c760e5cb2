"""The experiments and benchmarks behind docs/ and experiments/README.md.

Run a script from the repository root as a module, `python -m experiments.<name>`, so that
`gspo_jax` and these modules come from this checkout: no script edits `sys.path`. Modules
named with a leading underscore are helpers (`_bench`, `_bench_long`, `_bench_decode`,
`_runs`, `_plots`): scripts import helpers, never another script, and a helper imports no
script, so the imports form no circle."""
