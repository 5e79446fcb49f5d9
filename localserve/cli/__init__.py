"""The ``localserve`` command: its verbs (main.py), where ``serve`` reads its settings
(options.py), and what ``run`` uses (run_backends.py, chat_repl.py). Verbs import what
they need when called, so ``list`` or ``ps`` never load torch."""
