"""The CPU reference engine: an HF transformers model behind SGLang's HTTP API.

Started as `python -m miles_lite.engines.reference.engine`.
"""
