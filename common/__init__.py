"""The small shared floor of the rooms: telemetry. It imports no other room."""
