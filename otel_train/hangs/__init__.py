"""Hangs: the per-rank watchdog (`watchdog`), its records (`hang_file`) and the roll call over ranks (`roll_call`)."""
