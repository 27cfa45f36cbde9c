"""Models written for one device, annotated with logical axis names only."""
