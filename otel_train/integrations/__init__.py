"""Framework integrations: one module per framework, each importing its framework lazily."""
