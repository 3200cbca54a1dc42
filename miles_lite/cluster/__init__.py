"""Where the roles run: Ray placement groups (one gang per role) or local processes. A role: it places the
trainer, the engines (through `engines/`) and the weight-sync endpoints, so it may import those roles and the
libraries, never the run layer.
"""
