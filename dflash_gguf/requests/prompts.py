"""A chat request's prompt and stop strings, as llama_cpp's chat handlers build them (the server's slots,
its token counts, and :class:`dflash_gguf.batch.BatchLlama`'s chats)."""
from __future__ import annotations

from typing import Sequence

from dflash_gguf.requests.calls import check_template_kwargs


def formatted_prompt(fmt, messages: Sequence[dict], tokenize, **extra) -> tuple[list[int], list[str]]:
    """The prompt ids and stop strings of a llama_cpp chat formatter for ``messages``, tokenized as
    llama_cpp's chat handler does it (``tokenize``: a ``tokenize(text, add_bos=, special=)``; ``extra``:
    what the handler passes on to the formatter: ``tools``, ``tool_choice``, template variables)."""
    r = fmt(messages=list(messages), **extra)
    ids = tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True)
    return ids, [r.stop] if isinstance(r.stop, str) else list(r.stop or [])


def chat_prompt(llm, messages: list[dict], tools: list | None = None, tool_choice=None,
                template_kwargs: dict | None = None) -> tuple[list[int], list[str]] | None:
    """The prompt ids and stop strings llama_cpp's chat handler would use for ``messages`` (the GGUF's
    template, or a named format with a formatter; ``tools``, ``tool_choice`` and ``template_kwargs``
    passed on to it, as the handler does), or None when it cannot say."""
    from dflash_gguf.native.llama import llama_chat_format as F

    name = llm.chat_format
    fmt = None
    if llm.chat_handler is not None:
        return None
    if name and name.startswith("chat_template."):
        template = llm.metadata.get("tokenizer." + name) if name != "chat_template.default" \
            else llm.metadata.get("tokenizer.chat_template")
        if not template:
            return None
        eos, bos = llm.token_eos(), llm.token_bos()
        text = lambda t: llm._model.token_get_text(t) if t != -1 else ""  # noqa: E731
        fmt = F.Jinja2ChatFormatter(template=template, eos_token=text(eos), bos_token=text(bos),
                                    stop_token_ids=[eos])
    elif name:
        for cand in (name, name.replace("-", "_"), name.replace("-", "")):
            fmt = getattr(F, f"format_{cand}", None)
            if fmt is not None:
                break
    if fmt is None:
        return None
    extra = dict(template_kwargs or {})
    check_template_kwargs(extra)
    return formatted_prompt(fmt, messages, llm.tokenize, tools=tools, tool_choice=tool_choice, **extra)
