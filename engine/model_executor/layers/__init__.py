"""Building blocks shared by the model definitions (torch code, device-neutral)."""
