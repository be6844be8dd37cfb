"""nn.Module building blocks of Kimi Linear. No device-specific code: kernels come in resolved."""
