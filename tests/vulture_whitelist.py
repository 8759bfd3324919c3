"""Names the dead-code check (``tests/test_dead_code.py``, vulture) cannot see used, each
with why it is used. Never imported: vulture reads it as source only."""

# ruff: noqa
# flake8: noqa
_ = None

_.__getattr__  # module attribute hooks: edge0/__init__.py's and edge0/tiny/__init__.py's lazy exports
_.__dir__  # module attribute hook: edge0/__init__.py lists its lazy exports
_.sorted_indices  # Edge0SwitchLinear.__call__ keeps QuantizedSwitchLinear's signature (mlx-lm's models pass it)
_.PREFILL_PATHS  # config_sources/cli_flags.py names the choices of --prefill-path by this constant's name
_.maxother, _.maxstring, _.maxlist, _.repr__Object  # reprlib.Repr settings read by reprlib (header messages)
_.read_wait_seconds  # GenerationStats field: the public stats (seconds the generation waited on reads)
_.should_exit  # uvicorn.Server's flag, read by uvicorn's own loop
_.pre_tokenizer, _.decoder, _.post_processor  # the tokenizers library's Tokenizer parts, read when it saves
_.tool_choice, _.parallel_tool_calls  # request body fields: read from the body by server/tools.parse_tools
_.cache_control  # Anthropic request field accepted and passed over: a hint for Anthropic's own prompt cache
_.token_logprobs, _.text_offset, _.system_fingerprint, _.owned_by  # response body fields: pydantic dumps them
_.pytestmark  # pytest's module marker
_.anyio_backend, _.close_clients  # pytest fixtures, used by name
