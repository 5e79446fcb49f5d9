"""`localserve top`: a live terminal dashboard of the daemon, a client of its HTTP API only."""
