"""The proxy's front ends: Chat Completions, the Responses API and Anthropic's Messages API.

Each turns its API's request into the engine's chat completions (through the one canonical
`Conversation` in `canonical.py`) and writes the answer back in its own format (`base.Translator`).
"""
