"""The model-call path under `/proxy/`: each attempt's OpenAI and Anthropic base URLs.

`handler.py` parses the path and admits the call, a front end (`frontends/`) turns the request into
the engine's chat-completions body, `call.py` is the call in flight, and `pipeline.py` forwards,
records and answers it (`relay.py` relays a stream as it arrives). Around them: the per-call
limits (`limits.py`), budgets (`budgets.py`, `ledger.py`), the endpoint chosen for a rollout
(`routing.py`), the upstream client (`upstream.py`), how calls are recorded (`recording.py`,
`payload.py`), continuous prompt mode (`continuity.py`, `render.py`, `tokenin.py`) and the reaper
of calls whose gateway died (`reaper.py`).
"""
