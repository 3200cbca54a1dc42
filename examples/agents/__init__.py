"""Agents trained through the session gateway (`rollout.agent`): `lookup_agent` follows a chain of lookups with
the `openai` client; `lookup/` holds its task's records (`python examples/agents/lookup/make_data.py`)."""
