"""cnn package."""
