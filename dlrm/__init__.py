"""dlrm package."""
