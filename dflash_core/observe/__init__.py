"""What the engine says: the event vocabulary, the bus, the event log (events.jsonl) and the fold
base its readers share, the sinks, error classification, telemetry and stall reports."""
