"""A small byte-level BPE tokenizer trained offline on the synthetic arithmetic corpus.

Tiny models trained from scratch need a tokenizer that matches their data: digits are split
into single-digit tokens (so arithmetic is learnable digit by digit), each answer tag is one
token, and ChatML markers frame the conversation. Training uses only generated text, so no
network access is needed (``HF_HUB_OFFLINE=1`` is fine), and the same arguments always give a
byte-identical ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from miles_lite.data.arithmetic import SUPPORTED_OPS, ArithmeticSpec, generate_problems
from miles_lite.data.prompts import SYSTEM_PROMPT, format_solution, render_plain_prompt
from miles_lite.formats.answer import ANSWER_TAGS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CONTROL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Bump when the corpus or training recipe changes so cached tokenizers are rebuilt.
_RECIPE_VERSION = 1
_CORPUS_PROBLEMS = 500
_BYTE_ALPHABET = 256
_MIN_VOCAB = _BYTE_ALPHABET + len(CONTROL_TOKENS) + len(ANSWER_TAGS) + 1


def _training_corpus(seed: int, extra_tags: tuple[str, ...] = (), extra_texts: tuple[str, ...] = ()) -> list[str]:
    """Texts the model will see: questions, reference solutions, tagged targets and prompts (and `extra_texts`,
    e.g. conversations in an agent run's chat template)."""
    spec = ArithmeticSpec(min_steps=1, max_steps=4, ops=SUPPORTED_OPS, seed=seed)
    texts = []
    for problem in generate_problems(_CORPUS_PROBLEMS, spec):
        texts += [problem.question, problem.solution, format_solution(problem),
                  render_plain_prompt(problem.question)]
    texts += [f"system\n{SYSTEM_PROMPT}", "user\n", "assistant\n", *extra_texts]
    # Tags and control tokens are single added tokens and never reach the BPE model, so they
    # are cut out here to keep merges from being spent on their pieces.
    for token in (*ANSWER_TAGS, *extra_tags, *CONTROL_TOKENS):
        texts = [text.replace(token, "\n") for text in texts]
    return texts


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, seed: int = 0,
                    extra_tags: tuple[str, ...] = (), extra_texts: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and save it with ``save_pretrained`` into ``out_dir``.

    Args:
        out_dir: directory to write (``tokenizer.json``, ``tokenizer_config.json``, chat
            template); created if missing, existing files are overwritten.
        vocab_size: upper bound on the vocabulary, including the 256 byte tokens, the three
            control tokens and the four answer tags; the regular corpus may saturate below it.
        seed: seed of the synthetic training corpus.
        extra_tags: more tags to hold as single added tokens (e.g. a tool's call and result tags).
        extra_texts: more training text (its merges make e.g. a chat template's tool-call syntax a few tokens).

    Returns:
        The tokenizer as loaded back from ``out_dir``: eos ``<|im_end|>``, pad
        ``<|endoftext|>``, a ChatML chat template. The control tokens are special (dropped by
        ``skip_special_tokens``); the answer tags are added but not special, so decoded
        completions keep them for the rewards.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tags = (*ANSWER_TAGS, *extra_tags)
    if vocab_size < _MIN_VOCAB + len(extra_tags):
        raise ValueError(f"vocab_size must be >= {_MIN_VOCAB + len(extra_tags)} (bytes + added tokens + 1), "
                         f"got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(tags),
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(seed, tuple(extra_tags), tuple(extra_texts)), trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in tags])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=IM_END, pad_token=ENDOFTEXT, chat_template=CHATML_TEMPLATE
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out_dir)
    # Name the generic fast class and inline the chat template so that older transformers
    # releases (which may serve rollouts) load the same tokenizer.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHATML_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return PreTrainedTokenizerFast.from_pretrained(out_dir)


def tokenizer_cache_key(vocab_size: int = 512, seed: int = 0, extra_tags: tuple[str, ...] = (),
                        extra_texts: tuple[str, ...] = ()) -> str:
    """Directory name under which :func:`load_or_build_tokenizer` caches a build."""
    key = f"bpe-v{_RECIPE_VERSION}-vocab{vocab_size}-seed{seed}"
    if extra_tags:
        key += "-tags" + hashlib.sha256("\0".join(extra_tags).encode()).hexdigest()[:12]
    if extra_texts:
        key += "-texts" + hashlib.sha256("\0".join(extra_texts).encode()).hexdigest()[:12]
    return key


def load_or_build_tokenizer(
    cache_dir: str | Path, vocab_size: int = 512, seed: int = 0, extra_tags: tuple[str, ...] = (),
    extra_texts: tuple[str, ...] = (),
) -> PreTrainedTokenizerFast:
    """Load the tokenizer for these arguments from ``cache_dir``, building it on first use.

    A build goes to a private temporary directory that is renamed into place in one step,
    so concurrent processes never see a half-written tokenizer; when two build at once, the
    first rename wins and the other copy is discarded.
    """
    from transformers import PreTrainedTokenizerFast

    target = Path(cache_dir) / tokenizer_cache_key(vocab_size, seed, tuple(extra_tags), tuple(extra_texts))
    build_once(target, lambda out: build_tokenizer(out, vocab_size=vocab_size, seed=seed, extra_tags=tuple(extra_tags),
                                                   extra_texts=tuple(extra_texts)))
    return PreTrainedTokenizerFast.from_pretrained(target)


def build_once(target: Path, build: Callable[[Path], object]) -> None:
    """Run `build(directory)` into a private temporary directory beside `target` and rename it into place in one
    step, unless `target` already holds a tokenizer; when two processes build at once the first rename wins."""
    if (target / "tokenizer.json").is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(staging)
        # mkdtemp makes the directory private; a shared cache must stay readable.
        staging.chmod(0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
