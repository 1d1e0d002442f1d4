"""cachedarrays package."""
