"""cancelfl protocols package."""
