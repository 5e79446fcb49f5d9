"""``python -m localserve.cli``: the ``localserve`` command."""

from .main import main

main()
