"""The lookup-chain task's records (see make_data.py)."""
