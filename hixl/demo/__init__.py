"""The prefill -> decode KV-cache demo."""
