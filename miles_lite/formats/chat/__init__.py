"""Chat templates per model family, written in the project (`templates`), the checkpoint's own (`hf`), reading
a model's turn back (`parsing`), the token-exact continuation of a session (`incremental`) and the append-only
check (`check`). A library: it imports nothing of the package outside `formats.chat`; tokenizers are passed in.
"""

from __future__ import annotations

from typing import Any

from miles_lite.formats.chat.messages import Message, MessageError, ToolCall
from miles_lite.formats.chat.templates import FAMILY_TEMPLATES, ChatTemplate

__all__ = ["CHAT_TEMPLATE_CHOICES", "FAMILIES", "ChatTemplate", "Message", "MessageError", "ToolCall",
           "family_of_arch", "load_chat_template", "resolve_chat_template", "unknown_family_message"]

FAMILIES = tuple(FAMILY_TEMPLATES)
# `rollout.chat_template`: auto (the family of `model.arch`), a family, or hf (the checkpoint's template).
CHAT_TEMPLATE_CHOICES = ("auto", *FAMILIES, "hf")
# Architectures (`model.arch`) whose family the project ships a template for.
_ARCH_FAMILY = {"qwen2": "qwen2.5", "qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3"}


def unknown_family_message(name: str, field: str = "rollout.chat_template") -> str:
    return (f"{field}={name!r} is not a chat template family this project ships ({', '.join(FAMILIES)}); use "
            f"{field}=hf for the checkpoint's own template, once `miles-lite check-template --template hf "
            "--tokenizer MODEL_DIR` passes on it")


def family_of_arch(arch: str) -> str:
    """The template family of a model architecture; ValueError naming `miles-lite check-template` when none."""
    try:
        return _ARCH_FAMILY[arch]
    except KeyError:
        raise ValueError(f"rollout.chat_template=auto: no project chat template for model.arch={arch!r}; set "
                         f"rollout.chat_template to one of {', '.join(FAMILIES)}, or to hf once `miles-lite "
                         "check-template --template hf --tokenizer MODEL_DIR` passes on the checkpoint") from None


def load_chat_template(name: str, tokenizer: Any = None, arch: str | None = None) -> ChatTemplate:
    """The template `name` (a `CHAT_TEMPLATE_CHOICES` entry; `auto` needs `arch`, `hf` the tokenizer)."""
    if name == "auto":
        name = family_of_arch(arch or "")
    if name == "hf":
        from miles_lite.formats.chat.hf import HfTemplate

        return HfTemplate(tokenizer)
    if name not in FAMILY_TEMPLATES:
        raise ValueError(unknown_family_message(name))
    return FAMILY_TEMPLATES[name]()


def resolve_chat_template(name: str, tokenizer: Any, arch: str, tiny: bool, tokenize: Any,
                          conversations: int = 40) -> tuple[ChatTemplate, str | None]:
    """The template of `rollout.chat_template` for a run, checked append-only on its tokenizer; and a warning
    (None when the check passes). `auto` is the family of `arch`, or ChatML's qwen2.5 for a tiny random model
    (`tiny`: the offline tokenizer speaks ChatML whatever the architecture). An `hf` template that fails the
    check is refused (ValueError naming `miles-lite check-template`); a project family that fails it on this
    tokenizer is used with the warning: its sessions count the turns whose ids a fresh tokenisation would
    change (`rollout/tito_mismatch`)."""
    from miles_lite.formats.chat.check import check_template

    if name == "auto":
        name = "qwen2.5" if tiny else family_of_arch(arch)
    template = load_chat_template(name, tokenizer, arch)
    report = check_template(template, tokenize, conversations)
    if report.passed:
        return template, None
    detail = f"{report.summary()}; first: {report.failures[0]}"
    if name == "hf":
        raise ValueError(f"rollout.chat_template=hf: the checkpoint's template is not append-only on its tokenizer "
                         f"({detail}); see `miles-lite check-template --template hf --tokenizer MODEL_DIR`, or pick "
                         f"a project family ({', '.join(FAMILIES)})")
    return template, (f"rollout.chat_template={name}: {detail}; sessions on this tokenizer may hold ids a fresh "
                      "tokenisation would change (counted in rollout/tito_mismatch)")
