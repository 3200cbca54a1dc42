"""`miles-lite check-template`: prove a chat template append-only on a tokenizer.

    miles-lite check-template                                      # every shipped family, each on the project's
                                                                   # offline tokenizer of that family
    miles-lite check-template --template qwen3                     # one family
    miles-lite check-template --template qwen2.5 --tokenizer DIR   # a family on a checkpoint's tokenizer
    miles-lite check-template --template hf --tokenizer DIR        # the checkpoint's own (Jinja) template

Over generated conversations with tools (and reasoning, for thinking families) a session is simulated as the
rollout gateway runs it; at every point where the model speaks the ids built turn by turn must equal a fresh
tokenisation of the whole conversation, and every model turn must read back as the message it came from
(`miles_lite/formats/chat/check.py`). Exit code 0 when every template passes, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from miles_lite.formats.chat import CHAT_TEMPLATE_CHOICES, FAMILIES, load_chat_template, unknown_family_message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--template", default="all",
                        help=f"a family ({', '.join(FAMILIES)}), hf (the tokenizer's own template) or all (default)")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer (or model) directory; default: the project's offline tokenizer of the family")
    parser.add_argument("--conversations", type=int, default=200, help="generated conversations per template")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default="outputs/.cache/tokenizers",
                        help="where the project's offline tokenizers are built and kept")
    parser.add_argument("--show", type=int, default=10, help="failures printed per template")


def run(args: argparse.Namespace) -> int:
    from miles_lite.data.family_tokenizer import load_or_build_family_tokenizer
    from miles_lite.formats.chat.check import check_template

    if args.template not in (*CHAT_TEMPLATE_CHOICES, "all") or args.template == "auto":
        print(f"miles-lite check-template: {unknown_family_message(args.template, '--template')}")
        return 2
    if args.template == "hf" and not args.tokenizer:
        print("miles-lite check-template: --template hf checks a checkpoint's own template: give --tokenizer DIR")
        return 2
    if args.conversations < 1:
        print("miles-lite check-template: --conversations must be >= 1")
        return 2
    names = FAMILIES if args.template == "all" else (args.template,)
    loaded = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(args.tokenizer)
    failed = 0
    for name in names:
        tokenizer = loaded if loaded is not None else load_or_build_family_tokenizer(Path(args.cache_dir), name)
        try:
            template = load_chat_template(name, tokenizer)
        except ValueError as exc:
            print(f"{name}: {exc}")
            failed += 1
            continue

        def tokenize(text: str, tok=tokenizer) -> list[int]:
            return list(tok(text, add_special_tokens=False)["input_ids"])

        report = check_template(template, tokenize, args.conversations, args.seed)
        where = args.tokenizer or f"the project's {name} tokenizer"
        print(f"{report.summary()} on {where}")
        for line in report.failures[:args.show]:
            print(f"  {line}")
        failed += not report.passed
    return 1 if failed else 0
