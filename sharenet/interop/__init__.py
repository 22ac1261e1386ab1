"""Hugging Face checkpoints in and out."""
