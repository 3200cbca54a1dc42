"""What runs on the engine side: the CPU reference engine server (`reference/`), SGLang's command line
(`sglang/`), and the launcher that starts engine servers and hands their clients to the rollout fleet.

Imports point one way: engines use the rollout client (process, HTTP client, fleet), the weight-sync
pieces both sides share (plan, engine layout, shard protocol, weight group) and the libraries, never the
run layer; the rollout client never imports an engine.
"""
