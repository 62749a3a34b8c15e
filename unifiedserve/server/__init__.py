"""The OpenAI-compatible HTTP front end (api process)."""
