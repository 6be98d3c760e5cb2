"""Where arrays and programs live: device meshes and the logical-axis rules table
(`sharding`), expert parallelism's layout (`expert_mesh`), and which devices sample and how
far ahead of the trainer (`placement`, the `placement.*` / `asynchronous.*` groups).

May import: jax, numpy and gspo_jax.utils.
"""
