"""The controller tests' fixtures; they live in `controller_rig` with the helpers the tests import."""

from controller_rig import gateway_url, rig, upstream

__all__ = ["gateway_url", "rig", "upstream"]
