"""cancelfl server package."""
