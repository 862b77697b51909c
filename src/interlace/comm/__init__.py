"""The communication core: cost models, planners and the runtime engine that every strategy uses."""
