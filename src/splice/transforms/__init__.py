"""One module per transform; each exposes ``check`` (validation only) and one ``(model, config, ctx) -> model``."""
