"""Runnable examples: each folder holds a task's data builder, agent, reward and `train.toml`."""
