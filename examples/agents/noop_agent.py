"""The smallest agent: reads its input and exits 0 (the controller benchmark runs hundreds of these)."""

from __future__ import annotations

import json
import os

json.loads(os.environ.get("ROLLWIRE_INPUT", "null"))
