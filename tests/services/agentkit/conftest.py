"""The agent helper's tests run on the controller tests' rig (`tests/services/controller/controller_rig.py`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))  # controller_rig

from controller_rig import gateway_url, rig, upstream

__all__ = ["gateway_url", "rig", "upstream"]
