"""experiment layer."""
