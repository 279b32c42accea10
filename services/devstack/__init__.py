"""Developer tooling: the `rollwire` command line, `rollwire up` and the embedded nats-server and
Postgres it runs from their PyPI wheels. Not deployed: compose and Kubernetes run the services."""
