"""The gateway's own HTTP API under `/api/`: runs, rollouts and attempts, events, models, reads.

`routes.py` adds the routes; each group of handlers has its module (`rollouts.py`, `events.py`,
`registry.py`, `queries.py`, `reads.py`), `commands.py` holds what they share, `bodies.py` the
request bodies and `views.py` the JSON shapes of the answers.
"""
