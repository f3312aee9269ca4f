"""Loads models: Hugging Face checkpoints, the embedded default model, GGUF weight blocks."""
