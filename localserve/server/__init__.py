"""The daemon's HTTP server: OpenAI-compatible /v1, the admin /api, /health, /metrics."""
