"""The sink's runs: the router, each run's backends and spool, its temporality and step rules, its
durable series state, the reorder hold, the shared threads, start-up replay and the live roll call.
"""
