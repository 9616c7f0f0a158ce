"""Optional integrations with other systems (each behind its own extra)."""
