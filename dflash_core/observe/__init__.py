"""What the engine says: the event vocabulary, the bus, the event log, its sinks, error classification, telemetry and stall reports."""
