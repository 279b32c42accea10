"""The projector: folds every event of the stream into Postgres read models, exactly once.

    python -m services.projector --nats-url ... --database-url ...

Queries never scan the stream: the gateway's GET endpoints and the trajectory viewer read the
tables this service maintains (`migrations/`). See `service.py` for the consumer loop and its
failure handling, `pgstore.py` for the exactly-once transaction, `fold.py` for the fold itself,
and `reader.py` for the query side the gateway uses.
"""
