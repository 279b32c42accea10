"""The trainer: turns a run's recorded model calls into policy updates.

`trainer.core` is the pure adapter (calls → samples → advantages → loss weights → steps), with no
I/O and no torch, shared by the live trainer and the replay tool. `trainer.loss` is the torch side:
collating samples into tensors and the clipped policy loss.
"""
