"""cancelfl strategies package."""
