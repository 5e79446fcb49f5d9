"""Chat turns as models read and write them: OpenAI messages made ready for chat templates,
and a reply's text read back into thinking, answer and tool calls (streamed or whole).
Shared by the HTTP API, the Python API and ``localserve run``."""
