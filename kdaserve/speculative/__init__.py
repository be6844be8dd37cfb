"""Speculative decoding: drafters and verification with KDA state rollback."""
