"""The trace-based simulator: traces, network models, the replay, and experiments on them."""
