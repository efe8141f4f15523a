"""Disaggregated serving: prefill and decode instances behind an OpenAI-compatible proxy."""
