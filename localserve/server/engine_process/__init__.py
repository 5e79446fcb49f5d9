"""A model's engine in a process of its own: the daemon (a torch-free front: HTTP, templates,
tokenizing) starts it first thing of a load, so torch's import and the load run beside the
daemon's own start, and a crash in a kernel ends one model's process, not the daemon."""
