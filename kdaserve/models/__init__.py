"""The Kimi Linear model and its checkpoint loader."""
