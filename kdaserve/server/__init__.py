"""HTTP server: OpenAI-compatible and SGLang-native API over the engine process."""
