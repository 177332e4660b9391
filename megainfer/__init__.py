"""megainfer."""
