"""Prefill/decode disaggregation: the transfer engine and the layout of what is shipped."""
