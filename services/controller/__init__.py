"""The controller: turns queued rollouts into executions and reports how they end."""
