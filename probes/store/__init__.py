"""The run directory: its layout and manifest, the telemetry and iteration-log schemas, crash-safe
recording, following a run while it is written, and imports of other tools' results."""
