"""Rollwire's gateway: the rollout API, the agents' OpenAI-compatible proxy and the phase gate.

python -m services.gateway --port 8080          # NATS_URL, ROLLWIRE_ADMIN_TOKEN, ROLLWIRE_SECRET
"""

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings, settings_from_env

__all__ = ["GatewaySettings", "create_app", "settings_from_env"]
