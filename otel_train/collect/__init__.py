"""Off the training thread: the step-aligned reader collects the SDK's instruments and the capture buffers at
step boundaries and builds one window of rows per collection (phases, system metrics, SDK objects -> rows)."""
