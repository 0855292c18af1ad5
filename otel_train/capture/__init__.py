"""The training thread's side: the step context (`step`) and the buffers `log` and spans append to
(`instrument`). Nothing here waits for a device, a backend or another thread."""
