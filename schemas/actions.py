"""What the model did in a recorded call: the texts of its actions, read from `ModelRequestRecorded.response`.

Monitors and the projector's flags look at actions, not prose: each tool call's name and
arguments, and each fenced code block of the reply (harnesses that run code from the reply's
text, such as mini-SWE-agent, act through those).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|$)", re.S)


def _messages(response: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The reply's messages: each choice's `message` (or streamed `delta`), else the response's own `message`."""
    choices = response.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                message = choice.get("message") or choice.get("delta")
                if isinstance(message, dict):
                    yield message
    elif isinstance(response.get("message"), dict):
        yield response["message"]


def actions(response: dict[str, Any]) -> Iterator[str]:
    """The texts of what the model did: `name arguments` of each tool call, then each fenced code block."""
    for message in _messages(response):
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                yield f"{function.get('name', '')} {function.get('arguments', '')}"
        content = message.get("content")
        if isinstance(content, str) and "```" in content:
            yield from _FENCE.findall(content)
