"""The rollout client: what the trainer's side needs of the engines. `engine` is the seam (token ids in, ids
and log-probs out), `http_client` speaks SGLang's HTTP API, `fleet` keeps the engines' state machine
(starting, healthy, dead, replacing, stale), `manager` turns prompts into scored groups (dynamic sampling,
retries, multi-turn environments), `pipeline` runs steps one-step-off. A role: it may import the weight-sync
pieces both sides share, the libraries and the shared types, never an engine server (`engines/`) nor the run
layer.
"""
