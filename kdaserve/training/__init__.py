"""Training the small models speculative decoding is measured on: `lm` (a Kimi Linear
target or draft model, from scratch on GSM8K text) and `drafter` (DSpark drafters distilled
from a target)."""
