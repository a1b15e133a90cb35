"""Speculative decoding: draft proposers and their helpers."""
