"""The demo two-tower retrieval model (the README's main command; docs/demo.md)."""
