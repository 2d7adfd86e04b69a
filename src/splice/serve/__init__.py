"""splice serve: continuous batching over the engine and its OpenAI-compatible HTTP app."""
