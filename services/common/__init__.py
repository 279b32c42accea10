"""The shared client library: the event store on JetStream and the small helpers every service,
the trainer and the tools use. It imports the contract (`schemas`) and nothing from a service."""
