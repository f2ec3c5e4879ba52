"""What the server holds: the `TemperServer` facade and its config, sessions and their
lifetimes, the checkpoint catalog, ids, and the policies on models, memory and snapshots."""
