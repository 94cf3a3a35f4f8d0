"""Pure scaling decisions (arrive with the autoscaler)."""
