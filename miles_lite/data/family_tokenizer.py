"""Small offline tokenizers shaped like the Qwen2.5/Qwen3 and Llama 3 tokenizers, for checking the project's
chat templates without a checkpoint (`miles-lite check-template`): byte-level BPE behind the family's own
pre-tokenisation regex (runs of newlines stay one piece wherever they end, which a generation prompt ending in
"\\n\\n" relies on), the family's special tokens (the turn markers, end of turn as EOS) and its added tags
(`<tool_call>`, `<think>` ...), trained on conversations the family's template renders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_lite.data.tokenizer import build_once
from miles_lite.formats.chat import load_chat_template
from miles_lite.formats.chat.check import generate_conversations

# The pre-tokenisation regexes of the Qwen2 and Llama 3 tokenizers (`tokenizer.json`'s Split pre-tokenizer).
_QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_LLAMA_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>")
# family -> (regex, special tokens, eos, pad); the added tags are the template's own (`ChatTemplate.tags`).
FAMILY_SPECS = {
    "qwen2.5": (_QWEN_PATTERN, _QWEN_SPECIAL, "<|im_end|>", "<|endoftext|>"),
    "qwen3": (_QWEN_PATTERN, _QWEN_SPECIAL, "<|im_end|>", "<|endoftext|>"),
    "llama3": (_LLAMA_PATTERN, _LLAMA_SPECIAL, "<|eot_id|>", "<|end_of_text|>"),
}
_RECIPE_VERSION = 1


def build_family_tokenizer(family: str, out_dir: str | Path, vocab_size: int = 2048, seed: int = 0) -> Any:
    """Train the `family`'s tokenizer into `out_dir` (``save_pretrained``) and return it loaded back."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family not in FAMILY_SPECS:
        raise ValueError(f"no project tokenizer for family {family!r}; families: {', '.join(FAMILY_SPECS)}")
    pattern, special, eos, pad = FAMILY_SPECS[family]
    template = load_chat_template(family)
    tags = template.tags
    corpus = [template.render(c.messages, c.tools, add_generation_prompt=False, options=c.options)
              for c in generate_conversations(template, 300, seed=seed + 1)]
    for token in (*special, *tags):
        corpus = [text.replace(token, "\n") for text in corpus]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(tags), special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in tags])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, pad_token=pad)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out)
    return PreTrainedTokenizerFast.from_pretrained(out)


def load_or_build_family_tokenizer(cache_dir: str | Path, family: str, vocab_size: int = 2048) -> Any:
    """The family's tokenizer from `cache_dir`, built there on first use (atomically, as the task tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    target = Path(cache_dir) / f"{family}-v{_RECIPE_VERSION}-vocab{vocab_size}"
    build_once(target, lambda out: build_family_tokenizer(family, out, vocab_size))
    return PreTrainedTokenizerFast.from_pretrained(target)
