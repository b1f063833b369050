"""`radiancectl bench`: the serving benchmark, a client that measures the daemon over HTTP (issue 24)."""
