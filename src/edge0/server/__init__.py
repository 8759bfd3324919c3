"""The OpenAI-compatible HTTP server (``edge0 serve``): docs/SERVER.md."""
