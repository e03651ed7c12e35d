"""cancelfl client package."""
