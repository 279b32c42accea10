"""The replay tests' fixtures; they live in `replay_support` with the helpers the tests import."""

from replay_support import rollwire

__all__ = ["rollwire"]
