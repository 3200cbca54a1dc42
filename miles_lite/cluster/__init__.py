"""Where the roles run: Ray placement groups (one gang per role) or local processes."""
