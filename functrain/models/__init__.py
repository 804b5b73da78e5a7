"""Model families. Each is a package `functrain/models/<name>/` holding the model (plain nn.Modules
with no parallelism inside and their sharding rules beside them), its loss factory, `checks.py`
(the checks of the config keys it reads, torch-free: `functrain.main` runs them before the heavy
modules load) and `task.py`, whose `build(config, ctx, workdir)` returns the `functrain.task.Task`
the training loop runs.

Internals: docs/internals.md "functrain.models".
"""
