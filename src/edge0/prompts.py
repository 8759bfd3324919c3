"""Prompts as mlx-lm builds them, and the bound that refuses an oversize text before any
tokenizer work is spent on it."""

from __future__ import annotations

from typing import Callable, Sequence

from edge0.errors import ConfigError

def prompt_ids(tok, encode: Callable[[str], list[int]], prompt: str | None = None, *,
               messages: Sequence[dict] | None = None, system_prompt: str | None = None,
               chat_template: bool = True, tools: Sequence[dict] | None = None,
               check_chars: Callable[[int], None] | None = None, template_kwargs: dict | None = None,
               role_mapping: dict | None = None, prefill_response: str | None = None,
               after_cache: bool = False, render: Callable[..., str] | None = None) -> list[int]:
    """``prompt`` (text): with a chat template (the tokenizer has one and ``chat_template``),
    one user message after an optional ``system_prompt``; without, the text with the
    tokenizer's special tokens, or with a ``system_prompt`` the two as the messages below
    (``system_prompt``, a newline, ``prompt``: what the server makes of a system and a user
    message). ``messages`` (``{"role", "content"}``): the chat template, or,
    for a base model without one, their contents joined by newlines, continued as text
    (``encode``). ``tools`` (OpenAI function definitions) go into the chat template; a
    model whose template has no tool-call format refuses them. ``check_chars`` sees the
    rendered template's length before it is tokenized (``check_text_size``).
    ``template_kwargs`` go to the chat template as its variables (``enable_thinking``, as
    mlx-lm's ``chat_template_kwargs``); ``role_mapping`` (mlx-lm's: a prefix per role,
    ``stop`` after each message) writes the messages of a model without a chat template
    instead of joining their contents. ``prefill_response``: the start of the assistant's
    answer, written into the template as its last message, which the model continues
    (``mlx_lm.generate --prefill-response``; a prompt without a chat template refuses it).
    ``after_cache``: the prompt continues a prefix a prompt cache holds (``mlx_lm.generate
    --prompt-cache-file``): with a chat template, only the text from ``prompt``'s message on
    (what the template writes before it is in the cache); without, the text with no special
    tokens (a BOS belongs at the start, which the cache holds) and no system prompt (the
    cache holds the start). ``render(messages,
    **keywords)``: what renders the chat template into text (default: the tokenizer's
    ``apply_chat_template``, here; the server's runs in a process it can stop)."""
    templated = chat_template and getattr(tok, "has_chat_template", False)
    if prefill_response is not None and not templated:
        raise ConfigError("prefill_response (the start of the answer; over HTTP, a last assistant message) needs the "
                          "tokenizer's chat template (this prompt is plain text: put the answer's start at the end "
                          "of the prompt instead)")
    if tools and not (templated and getattr(tok, "has_tool_calling", False)):
        raise ConfigError("this model's chat template has no tool-call format: it cannot be given tools")
    if messages is None:
        if prompt is None:
            raise ConfigError("prompt_ids needs a prompt or messages")
        if not templated and (system_prompt is None or after_cache):
            return tok.encode(prompt, add_special_tokens=not after_cache)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
    if not templated:
        if role_mapping is not None:
            return encode(mapped_roles(messages, role_mapping))
        return encode("\n".join(m["content"] for m in messages))
    from jinja2 import TemplateError

    if render is None:
        def render(messages, **keywords):
            return tok.apply_chat_template(messages, tokenize=False, **keywords)
    try:
        extra = {**(template_kwargs or {}), **({"tools": list(tools)} if tools else {})}
        if prefill_response is not None:
            messages = [*messages, {"role": "assistant", "content": prefill_response}]
            extra["continue_final_message"] = True
        text = render(list(messages), add_generation_prompt=prefill_response is None, **extra)
    except TemplateError as e:  # the template's own raise_exception, e.g. roles that do not alternate
        raise ConfigError(f"the model's chat template refuses these messages: {e}") from None
    if after_cache:  # the prompt's message on: render it with a marker for its content, cut there
        marked = [dict(m) for m in messages]
        marked[-2 if prefill_response is not None else -1]["content"] = QUERY_MARK
        text = text[render(marked, add_generation_prompt=prefill_response is None, **extra).index(QUERY_MARK):]
    if check_chars is not None:
        check_chars(len(text))
    return tok.encode(text, add_special_tokens=False)


QUERY_MARK = "<query>"  # mlx_lm.generate's marker for where a cached prefix ends

# The template renderer's own parameters (transformers' ``apply_chat_template`` and
# ``render_jinja_template``, and the functions it hands every template): never a
# template's variable a caller may set (tests/test_server_mlxlm.py holds it to the installed
# transformers' signatures).
RENDERER_OWN = frozenset((
    "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
    "strftime_now", "kwargs"))


def template_variables(tokenizer, renderer=None) -> frozenset[str] | None:
    """The variables a Hugging Face tokenizer's chat template reads (its free names), or
    None where they cannot be known (a ``renderer`` in Python replaces the template, or
    jinja2 does not parse it). A tokenizer without a chat template reads none;
    ``enable_thinking`` is always one."""
    if renderer is not None:
        return None
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return frozenset()
    from jinja2 import TemplateSyntaxError, meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    names: set[str] = set()
    for text in (template.values() if isinstance(template, dict) else [template]):
        try:
            names |= meta.find_undeclared_variables(env.parse(text))
        except TemplateSyntaxError:
            return None
    return frozenset(names | {"enable_thinking"})  # mlx-lm's tokenizer sets it on every template (off by default)


def mapped_roles(messages: Sequence[dict], role_mapping: dict) -> str:
    """mlx-lm's prompt for a model without a chat template (its server's ``convert_chat``):
    each message as its role's prefix, its content and ``stop``, then the assistant's
    prefix, trailing whitespace stripped."""
    stop = role_mapping.get("stop", "")
    text = ""
    for m in messages:
        text += f"{role_mapping.get(m['role'], '')}{m['content']}{stop}"
    return (text + role_mapping.get("assistant", "")).rstrip()


def longest_token_chars(tok, vocab: int) -> int:
    """The most characters any one token decodes to (special tokens' texts included, in
    case decoding skips them)."""
    specials = [len(t) for t in (getattr(tok, "all_special_tokens", None) or []) if isinstance(t, str)]
    return max([len(tok.decode([i])) for i in range(vocab)] + specials + [1])


def check_text_size(longest: int, context: int | None, chars: int) -> None:
    """Refuse a text of ``chars`` characters that cannot fit ``context`` tokens, before it
    is tokenized: no token covers more than ``longest`` characters (``longest_token_chars``),
    so the text has at least chars / longest tokens."""
    if context is not None and chars > context * longest:
        raise ConfigError(f"the prompt is {chars} characters: at least {chars // longest} tokens, more than the "
                          f"model's context of {context} tokens (max_position_embeddings): shorten it")
