"""The serving engine: scheduler, model runner, sampler, and the engine loop."""
