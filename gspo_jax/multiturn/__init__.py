"""Multi-turn rollouts with tools: environments (`envs`), the pausing in-graph sampler
(`sampler`) and the host loop between its turns (`episodes`)."""
