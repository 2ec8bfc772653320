"""Development tools: never imported on the serving path."""
