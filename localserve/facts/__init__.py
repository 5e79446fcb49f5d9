"""What a model is and whether it fits, from its files' metadata alone: the facts
behind ``localserve show`` (checkpoint.py, show.py) and ``localserve fit`` (fit.py).
checkpoint.py and show.py need no torch; fit.py follows the engine's pool rule."""
