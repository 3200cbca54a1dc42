"""Task data: records and their adapters (GSM8K, synthetic arithmetic, the calculator task), prompts and
tokenizers. A library: it may import `config`, `formats` and the shared types, nothing above them.
"""

from miles_lite.data.arithmetic import ArithmeticSpec, generate_problems, write_dataset
from miles_lite.data.gsm8k import DatasetError, MathProblem, load_gsm8k, save_gsm8k
from miles_lite.data.prompts import SYSTEM_PROMPT, build_messages, format_solution, render_prompt
from miles_lite.data.tokenizer import build_tokenizer, load_or_build_tokenizer

__all__ = [
    "SYSTEM_PROMPT",
    "ArithmeticSpec",
    "DatasetError",
    "MathProblem",
    "build_messages",
    "build_tokenizer",
    "format_solution",
    "generate_problems",
    "load_gsm8k",
    "load_or_build_tokenizer",
    "render_prompt",
    "save_gsm8k",
    "write_dataset",
]
