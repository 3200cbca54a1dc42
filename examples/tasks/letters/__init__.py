"""Reverse a short sequence of letters: a string-label records task that a tiny model learns on a CPU."""
