"""The session gateway: an OpenAI-compatible chat-completions server per run, in front of the engines, that
keeps every session's conversation as the exact token ids the engines saw and produced (`session`), speaks
OpenAI's wire format (`openai_io`), runs each turn on the fleet with sticky routing (`turns`) and serves it
over HTTP (`server`). Part of the rollout client: it imports the rollout modules it runs on, `formats.chat`,
`net` and the shared types.
"""
