"""Windows to backends: framing (the encoding), the exporter process and its spool, the one delivery engine
(`delivery`, `backend_feed`; memory-only in the training process), DataLoader workers' channel, replay and the
exporter process's self-telemetry."""
